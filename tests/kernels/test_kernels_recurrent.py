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
from kernel_refs import assert_compiles_as_eager, bf16_error_bound, reference64, rel  # noqa: E402

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


@pytest.mark.parametrize("Dv,blocks", [(96, 3), (128, 2)])
def test_wide_values_are_split_into_blocks_and_match_the_core(Dv, blocks):
    """Values wider than 64 run as blocks of 32 or 64 columns (no program holds the whole state);
    dq and dk are summed over the blocks' shares."""
    assert fast._blocks(8, Dv)[2] * blocks == Dv
    made = inputs(1, 2, 40, 8, Dv, True)
    clone = lambda: [t.detach().clone().requires_grad_() if t is not None else None for t in made]  # noqa: E731
    got = run(fast.chunked, clone())
    want = run(lambda *t: recurrent.chunked(*t, chunk=8), clone())
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.detach().abs().max())))


def test_batch_times_heads_is_on_the_grid_axis_without_the_65535_limit(monkeypatch):
    """B * H programs go on the grid's first axis (up to 2^31 - 1); the second and third axes,
    limited to 65,535 on CUDA, hold only the value blocks. Launches are recorded, not run."""
    grids = []
    monkeypatch.setattr(fast, "launch", lambda kernel, grid, configs, *a, **kw: grids.append((kernel.__name__, grid)))
    q, k, v, a, s0 = inputs(70_000, 1, 1, 1, 1, True)
    y, s = fast.chunked(q, k, v, a, s0)
    torch.autograd.backward([y, s], [torch.ones_like(y), torch.ones_like(s)])
    assert {name for name, _ in grids} == {"_fwd", "_bwd_dq", "_bwd_dkv"}
    for name, grid in grids:
        assert grid[0] == 70_000 and all(g <= 65_535 for g in grid[1:]), (name, grid)


def test_bf16_inputs_are_as_accurate_as_the_reference_in_bf16():
    """bf16 inputs take the TF32 products (which the interpreter computes as IEEE fp32: it ignores
    ``input_precision``) and keep dq and dk in fp32 until the log-decays' gradient (a reversed
    cumulative sum of q.dq - k.dk) is taken from them. Every output and gradient is within twice the
    error of the PyTorch core's result stored in bf16, both against a float64 recurrence on the
    same bf16-valued inputs."""
    made = inputs(1, 2, 70, 16, 16, True)
    q, k, v = (t.detach().to(torch.bfloat16) for t in made[:3])
    a, s0 = made[3].detach(), made[4].detach()
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(1, 2, 70, 16, generator=g).bfloat16().float()  # the gradient bf16 outputs get
    ds = torch.randn(1, 2, 16, 16, generator=g)

    def outcome(fn, dtype, qkv_dtype=None):
        xs = [t.to(qkv_dtype or dtype).requires_grad_() for t in (q, k, v)]
        xs += [a.to(dtype).requires_grad_(), s0.to(dtype).requires_grad_()]
        y, s = fn(*xs)
        return [y, s, *torch.autograd.grad([y, s], xs, [dy.to(y.dtype), ds.to(s.dtype)])]

    want = outcome(reference64, torch.float64)
    got = outcome(fast.chunked, torch.float32, torch.bfloat16)
    core = outcome(lambda *t: recurrent.chunked(*t, chunk=8), torch.float32)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float32] + [torch.bfloat16] * 3 + [torch.float32] * 2
    for name, x, c, w in zip(["y", "state", "dq", "dk", "dv", "da", "dstate"], got, core, want):
        assert rel(x, w) <= bf16_error_bound(c, w, x.dtype), (name, rel(x, w), bf16_error_bound(c, w, x.dtype))


@pytest.mark.parametrize("with_state", [True, False])
def test_the_kernel_compiles_in_one_graph_and_equals_eager(with_state):
    """Forward and backward are custom operators: torch.compile calls them as they are."""
    assert_compiles_as_eager(fast.chunked, *inputs(1, 2, 19, 8, 96, with_state))  # three blocks of value columns
