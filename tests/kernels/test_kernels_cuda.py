"""The recurrent Triton kernels compiled and run on a CUDA GPU at the presets' shapes (and head dim
256), fp32 and bf16, forward and backward, against the PyTorch references on the same GPU; the fused
loss under torch.compile (Inductor) against the same loss run eagerly. Skipped
without a GPU; ``benchmarks/gpu_check.sh`` runs this file (``-m cuda``, with ``TRITON_INTERPRET=0``)
before the GPU benchmark. Nothing here has run yet: no GPU has been at hand."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import bf16_error_bound, reference64, rel  # noqa: E402
from zoo.components import gated_deltanet as gdn  # noqa: E402
from zoo.components import recurrent  # noqa: E402
from zoo.tools import kernel_fit as fit  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 (benchmarks/gpu_check.sh does)"),
]


def problems():
    """One problem per component and head widths (the presets', and 256): the rest compile the same."""
    found = fit.preset_problems()
    found += [fit.widened(p, 256) for p in found]
    return list({(p.component, p.shapes[0][-1], p.shapes[2][-1]): p for p in found}.values())


PROBLEMS = problems() if torch.cuda.is_available() else []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.label for p in PROBLEMS])
def test_kernel_matches_the_reference_on_cuda(problem, dtype):
    """Two heads of the preset's shape, three chunks and a bit: outputs, final state and every
    gradient, within the bf16 bound of the CPU tests (twice the reference's own bf16 error against
    float64) or, in fp32, 1e-4 of the largest element (TF32 is off for fp32 inputs: IEEE products)."""
    from zoo.components.kernels import gated_deltanet as fast_gdn
    from zoo.components.kernels import recurrent as fast_rec

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    chunk = dict(problem.kwargs).get("chunk", dict(problem.kwargs).get("arg6", 64))
    T = 3 * min(chunk, 64) + 5
    shapes = [s[:1] + (min(s[1], 2),) + (T,) + s[3:] if s is not None else None for s in problem.shapes]
    if problem.component == "gated_delta":
        q, k = (gdn.l2norm(torch.randn(*shapes[i], device=dev, generator=g)) for i in (0, 1))
        q = q * q.shape[-1] ** -0.5
        v = torch.randn(*shapes[2], device=dev, generator=g)
        ga = -torch.rand(*shapes[3], device=dev, generator=g)
        beta = torch.rand(*shapes[4], device=dev, generator=g)
        s0 = torch.randn(shapes[2][0], shapes[2][1], q.shape[-1], v.shape[-1], device=dev, generator=g)
        extra = (ga, beta, s0)
        H, Hk = v.shape[1], q.shape[1]
        fast = lambda q, k, v, ga, beta, s0: fast_gdn.chunk_gated_delta_rule(q, k, v, ga, beta, s0, chunk)  # noqa: E731
        core = lambda q, k, v, ga, beta, s0: gdn.chunk_gated_delta_rule(q, k, v, ga, beta, s0, chunk)  # noqa: E731
        exact = lambda q, k, v, ga, beta, s0: gdn.recurrent_gated_delta_rule(  # noqa: E731
            q.repeat_interleave(H // Hk, 1), k.repeat_interleave(H // Hk, 1), v, ga, beta, s0)
    else:
        q, k = (torch.randn(*shapes[i], device=dev, generator=g) * shapes[i][-1] ** -0.5 for i in (0, 1))
        v = torch.randn(*shapes[2], device=dev, generator=g)
        a = -torch.rand(*shapes[3], device=dev, generator=g)
        s0 = torch.randn(v.shape[0], v.shape[1], q.shape[-1], v.shape[-1], device=dev, generator=g)
        extra = (a, s0)
        fast = fast_rec.chunked
        core = lambda q, k, v, a, s0: recurrent.chunked(q, k, v, a, s0, chunk=chunk)  # noqa: E731
        exact = reference64
    q, k, v = (t.to(dtype).float() for t in (q, k, v))  # values the dtype holds, for every path
    dy = torch.randn(v.shape, device=dev, generator=g).to(dtype).float()
    ds = torch.randn(s0.shape, device=dev, generator=g)

    def outcome(fn, dtype_, qkv_dtype=None):
        xs = [t.to(qkv_dtype or dtype_).requires_grad_() for t in (q, k, v)] + [t.to(dtype_).requires_grad_() for t in extra]
        y, s = fn(*xs)
        return [y, s, *torch.autograd.grad([y, s], xs, [dy.to(y.dtype), ds.to(s.dtype)])]

    want = outcome(exact, torch.float64)
    got = outcome(fast, torch.float32, dtype)
    ref = outcome(core, torch.float32)
    for i, (x, c, w) in enumerate(zip(got, ref, want)):
        bound = bf16_error_bound(c, w, x.dtype) if dtype == torch.bfloat16 else max(2 * rel(c, w), 1e-4)
        assert rel(x, w) <= bound, (problem.label, i, rel(x, w), bound)


def test_fused_loss_under_inductor_equals_the_eager_kernel_on_cuda():
    """A Llama-3-sized vocabulary block in bf16: the loss compiled by Inductor (its two custom
    operators called as they are, in one graph) gives the eager kernel's loss and gradients exactly,
    and the eager kernel's loss is the reference's within the bf16 logits' rounding."""
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy
    from zoo.model.loss import lm_loss

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(1024, 512, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (0.05 * torch.randn(32768, 512, device=dev, generator=g, dtype=torch.bfloat16)).requires_grad_()
    labels = torch.randint(0, 32768, (1024,), device=dev, generator=g)

    def loss(h, w, labels):
        return fused_linear_cross_entropy(h, w, labels, softcap=30.0, z_loss=1e-4)[0]

    torch._dynamo.reset()
    try:
        want = loss(h, w, labels)
        want_grads = torch.autograd.grad(want, (h, w))
        got = torch.compile(loss, fullgraph=True)(h, w, labels)
        got_grads = torch.autograd.grad(got, (h, w))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = lm_loss(30.0 * torch.tanh((h @ w.t()).float() / 30.0), labels, z_loss=1e-4).loss
    torch.testing.assert_close(want, ref, rtol=1e-3, atol=0)


@pytest.mark.parametrize("two_passes", [False, True], ids=["one pass", "two passes"])
def test_fused_loss_sums_bf16_products_in_fp32_and_zeroes_ignored_rows_on_cuda(monkeypatch, two_passes):
    """On CUDA each chunk's bf16 product reaches the float32 sum unrounded (the GEMM's own float32
    result): over 64 chunks the bf16 weight gradient's error against float64 is one chunk's within
    5%; an ignored row with a logit of 200 leaves every gradient finite."""
    from zoo.components.kernels import cross_entropy

    if two_passes:
        monkeypatch.setattr(cross_entropy, "FORWARD_SUM_BYTES", -1)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, d, v = 4096, 64, 4096
    h = torch.randn(n, d, device=dev, generator=g).bfloat16()
    h[7] = 0
    h[7, 0] = 200.0
    w = (torch.randn(v, d, device=dev, generator=g) * 0.5).bfloat16().requires_grad_()
    with torch.no_grad():
        w[:, 0] = 0
        w[3, 0] = 1.0
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    labels[7] = -100
    keep = labels != -100
    w64 = w.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.nn.functional.cross_entropy(h[keep].double() @ w64.T, labels[keep]), w64)

    def error():
        (grad,) = torch.autograd.grad(cross_entropy.fused_linear_cross_entropy(h, w, labels)[0], w)
        assert torch.isfinite(grad).all()
        return float((grad.double() - ref).norm() / ref.norm())

    monkeypatch.setattr(cross_entropy, "_chunk_rows", lambda n, d, v: 64)
    many = error()
    monkeypatch.setattr(cross_entropy, "_chunk_rows", lambda n, d, v: n)
    one = error()
    assert many <= 1.05 * one, (many, one)
