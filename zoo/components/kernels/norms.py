"""RMSNorm and LayerNorm in Triton, forward and backward, one row per program.

Statistics and the scale are computed in fp32 whatever the input dtype. The flags reproduce the
reference paths of ``zoo/components/norms.py`` exactly:

- ``center``/``bias``: LayerNorm (subtract the mean, add a bias) versus RMSNorm;
- ``unit_offset``: scale by ``1 + w`` (Gemma);
- ``round_h``: round the normalised input to the input dtype before scaling (Llama's
  ``w * h.to(dtype)``) instead of scaling in fp32 (Gemma, OLMo 2, LayerNorm).

The backward writes a fresh gradient tensor and never the incoming one: Gemma 2's sandwich norms
sit on the residual stream, whose incoming gradient is still needed by the skip connection.
"""

import torch
import triton
import triton.language as tl

from zoo.components.kernels import on_device

MAX_DIM = 65536  # one row must fit one block


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps,
              CENTER: tl.constexpr, HAS_B: tl.constexpr, UNIT_OFFSET: tl.constexpr, ROUND_H: tl.constexpr,
              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if CENTER:
        mean = tl.sum(x, axis=0) / N
        x = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    h = x * rstd
    if ROUND_H:
        h = h.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    y = h * w
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, W, DY, DX, DW, DB, MEAN, RSTD, stride_x, stride_dy, stride_dx, M, N, rows_per_program,
              CENTER: tl.constexpr, HAS_B: tl.constexpr, UNIT_OFFSET: tl.constexpr, ROUND_H: tl.constexpr,
              BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for r in range(start, end):
        row = r
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if CENTER:
            x = tl.where(mask, x - tl.load(MEAN + row), 0.0)
        h = x * tl.load(RSTD + row)
        hw = h
        if ROUND_H:
            hw = h.to(X.dtype.element_ty).to(tl.float32)
        dw += dy * hw
        if HAS_B:
            db += dy
        g = dy * w
        dx = g - h * (tl.sum(g * h, axis=0) / N)
        if CENTER:
            dx = dx - tl.sum(g, axis=0) / N
        dx = dx * tl.load(RSTD + row)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=mask)


def _programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, 4)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, center, unit_offset, round_h, out_dtype):
        shape, N = x.shape, x.shape[-1]
        if N > MAX_DIM:
            raise ValueError(f"the Triton norm handles rows of at most {MAX_DIM} features, got {N}")
        x2 = x.reshape(-1, N)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        y = torch.empty((M, N), dtype=out_dtype, device=x.device)
        mean = torch.empty(M, dtype=torch.float32, device=x.device) if center else None
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        BLOCK = triton.next_power_of_2(N)
        with on_device(x2):
            _norm_fwd[(M,)](x2, weight, bias, y, mean, rstd, x2.stride(0), y.stride(0), N, eps,
                            CENTER=center, HAS_B=bias is not None, UNIT_OFFSET=unit_offset, ROUND_H=round_h,
                            BLOCK=BLOCK, num_warps=min(max(BLOCK // 256, 1), 16))
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.flags = (center, unit_offset, round_h, shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        center, unit_offset, round_h, shape = ctx.flags
        M, N = x2.shape
        dy2 = dy.reshape(-1, N)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)  # never written into dy
        P = _programs(M, x2.device)
        dw = torch.empty((P, N), dtype=torch.float32, device=x2.device)
        db = torch.empty((P, N), dtype=torch.float32, device=x2.device) if bias is not None else None
        BLOCK = triton.next_power_of_2(N)
        with on_device(x2):
            _norm_bwd[(P,)](x2, weight, dy2, dx, dw, db, mean, rstd, x2.stride(0), dy2.stride(0), dx.stride(0),
                            M, N, triton.cdiv(M, P), CENTER=center, HAS_B=bias is not None,
                            UNIT_OFFSET=unit_offset, ROUND_H=round_h, BLOCK=BLOCK,
                            num_warps=min(max(BLOCK // 256, 1), 16))
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(shape), dw.sum(0).to(weight.dtype), dbias, None, None, None, None, None


def rms_norm(x, weight, eps, *, unit_offset=False, scale_in_fp32=False):
    """``components.norms.RMSNorm`` in one kernel per direction (same flags, same result)."""
    if scale_in_fp32:
        out_dtype = x.dtype
    else:
        out_dtype = torch.promote_types(x.dtype, torch.float32 if unit_offset else weight.dtype)
    return _Norm.apply(x, weight, None, eps, False, unit_offset, not scale_in_fp32, out_dtype)


def layer_norm(x, weight, bias, eps):
    """``F.layer_norm`` over the last dimension, with an optional bias."""
    return _Norm.apply(x, weight, bias, eps, True, False, False, x.dtype)


def rms_norm_module(module, x):
    cfg = module.cfg
    return rms_norm(x, module.weight, cfg.eps, unit_offset=cfg.unit_offset, scale_in_fp32=cfg.scale_in_fp32)


def layer_norm_module(module, x):
    return layer_norm(x, module.weight, module.bias, module.cfg.eps)
