"""The Triton kernel of the chunked scalar-decay recurrence against the PyTorch core, on the CPU under
Triton's interpreter, in fp32: outputs, final state and every gradient (q, k, v, log-decays, initial
state), on lengths that are not multiples of the kernel's chunk and head widths that are not powers of
two; and the mixers choosing it through zoo.kernels."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: they then run on CPU tensors

import pytest
import torch

pytest.importorskip("triton")

import zoo.testing as zt  # noqa: E402
from zoo.core import kernels  # noqa: E402
from zoo.components.mixers import _recurrent as recurrent  # noqa: E402
from zoo.components.kernels import recurrent as fast  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(B, H, T, Dk, Dv, with_state, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, Dk, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g)
    a = -2 * torch.rand(B, H, T, generator=g)
    s0 = torch.randn(B, H, Dk, Dv, generator=g) if with_state else None
    return [t.requires_grad_() if t is not None else None for t in (q, k, v, a, s0)]


def run(fn, tensors, seed=1):
    y, s = fn(*tensors)
    g = torch.Generator().manual_seed(seed)
    loss = (y * torch.randn(y.shape, generator=g)).sum() + (s * torch.randn(s.shape, generator=g)).sum()
    grads = torch.autograd.grad(loss, [t for t in tensors if t is not None])
    return y, s, grads


@pytest.mark.parametrize("T,Dk,Dv,with_state", [(37, 5, 7, True), (16, 16, 16, False), (150, 20, 12, True)])
def test_kernel_matches_the_core_forward_and_backward(T, Dk, Dv, with_state):
    made = inputs(2, 2, T, Dk, Dv, with_state)
    clone = lambda: [t.detach().clone().requires_grad_() if t is not None else None for t in made]  # noqa: E731
    got = run(fast.chunked, clone())
    want = run(lambda *t: recurrent.chunked(*t, chunk=8), clone())
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.detach().abs().max())))


def test_mixers_choose_the_kernel_when_forced():
    model = zt.tiny_model(zt.hybrid_spec("lightning_attention", {"n_heads": 2, "head_dim": 8, "chunk": 4}))
    mixer = model.layers[0].mixer
    x = torch.randn(2, 9, 8)
    assert kernels.decide(mixer, "cpu", torch.float32).backend is None  # never chosen on the CPU by itself
    with kernels.using("scalar_decay:triton"):
        assert kernels.decide(mixer, "cpu", torch.float32, x).backend == "triton"
        ids = torch.randint(0, model.spec.vocab_size, (2, 11))
        with torch.no_grad():
            got = model(ids)
    with kernels.using("off"), torch.no_grad():
        want = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
