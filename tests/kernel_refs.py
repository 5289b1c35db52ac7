"""References and error bounds the kernel tests share (on the CPU under the interpreter, and on CUDA)."""

import torch


def reference64(q, k, v, a, s0):
    """The recurrence one step at a time in float64: S_t = e^{a_t} S_{t-1} + k_t v_t^T, y_t = q_t S_t."""
    S = s0.double()
    ys = []
    for t in range(q.shape[2]):
        S = S * a[:, :, t, None, None].double().exp() + k[:, :, t, :, None].double() * v[:, :, t, None, :].double()
        ys.append((q[:, :, t, None, :].double() @ S).squeeze(-2))
    return torch.stack(ys, 2), S


def rel(x, ref):
    return float((x.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())


def bf16_truncated(x):
    """x rounded to bf16 toward zero, as Triton's interpreter stores fp32 into bf16 (a GPU rounds to
    nearest): the reference's own bf16 error is measured with the interpreter's rounding."""
    return (x.detach().float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def bf16_error_bound(core32, want, dtype):
    """Twice the error of the PyTorch core (fp32 inside) once its result is stored in bf16 as the
    interpreter stores it; fp32 results (the states, the log-decays' gradient) are held to the fp32
    kernel tests' 1e-5 of the largest element."""
    return 2 * rel(bf16_truncated(core32), want) if dtype == torch.bfloat16 else max(2 * rel(core32, want), 1e-5)


def assert_compiles_as_eager(fn, *inputs, backend="aot_eager", wrt=None):
    """``fn`` (a kernel whose forward and backward are custom operators, or a model's loss with such
    kernels forced) traces in one graph with no break, and compiled with ``backend`` it gives the
    eager outputs and gradients bit for bit: the compiler calls the operators as they are, so the
    same code runs. ``fn`` returns a tensor or a tuple of them; the gradients, with respect to
    ``wrt`` (default: the inputs that require them), are of their sum with fixed random weights."""
    wrt = list(wrt) if wrt is not None else [t for t in inputs if torch.is_tensor(t) and t.requires_grad]

    def run(f):
        outs = f(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
        return [*outs, *torch.autograd.grad(loss, wrt)]

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(*inputs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        want = run(fn)
        got = run(torch.compile(fn, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
