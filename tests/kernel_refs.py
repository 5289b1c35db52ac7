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
