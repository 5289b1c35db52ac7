"""Rotary embeddings applied to q and k in one pass each, forward and backward.

Each pair ``(a, b)`` of rotated dimensions -- ``(i, i + dim/2)`` in the ``half`` layout,
``(2i, 2i + 1)`` in the ``interleaved`` one -- becomes
``out[a] = x[a] cos[a] - x[b] sin[a]``, ``out[b] = x[b] cos[b] + x[a] sin[b]``, exactly the
reference ``x * cos + rotate(x) * sin``. Dimensions past ``dim`` (partial rotary) are copied.
The backward is the transposed rotation. Inputs are (B, H, T, D) with any strides except along D.
"""

import torch
import triton
import triton.language as tl

from zoo.components.kernels import on_device

BLOCK_T = 16


@triton.jit
def _rope(X, COS, SIN, Y, H, T, D, ROT,
          sxb, sxh, sxt, syb, syh, syt, scb, sct,
          INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_P: tl.constexpr, BLOCK_REST: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = (t < T)[:, None]
    x_row = X + b * sxb + h * sxh + t.to(tl.int64)[:, None] * sxt
    y_row = Y + b * syb + h * syh + t.to(tl.int64)[:, None] * syt
    c_row = COS + b * scb + t.to(tl.int64)[:, None] * sct
    s_row = SIN + b * scb + t.to(tl.int64)[:, None] * sct
    p = tl.arange(0, BLOCK_P)[None, :]
    half = ROT // 2
    if INTERLEAVED:
        ia = 2 * p
        ib = 2 * p + 1
    else:
        ia = p
        ib = p + half
    mask = tmask & (p < half)
    xa = tl.load(x_row + ia, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x_row + ib, mask=mask, other=0.0).to(tl.float32)
    ca = tl.load(c_row + ia, mask=mask, other=0.0).to(tl.float32)
    cb = tl.load(c_row + ib, mask=mask, other=0.0).to(tl.float32)
    sa = tl.load(s_row + ia, mask=mask, other=0.0).to(tl.float32)
    sb = tl.load(s_row + ib, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        ya = xa * ca + xb * sb
        yb = xb * cb - xa * sa
    else:
        ya = xa * ca - xb * sa
        yb = xb * cb + xa * sb
    tl.store(y_row + ia, ya.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + ib, yb.to(Y.dtype.element_ty), mask=mask)
    if BLOCK_REST > 0:
        r = ROT + tl.arange(0, BLOCK_REST)[None, :]
        rmask = tmask & (r < D)
        tl.store(y_row + r, tl.load(x_row + r, mask=rmask, other=0.0), mask=rmask)


def _launch(x, cos, sin, rot, interleaved, backward, dtype):
    B, H, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x, dtype=dtype)
    cos = cos.expand(B, 1, T, cos.shape[-1])
    sin = sin.expand(B, 1, T, sin.shape[-1])
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    rest = D - rot
    with on_device(x):
        _rope[(B * H, triton.cdiv(T, BLOCK_T))](
            x, cos, sin, y, H, T, D, rot,
            x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), cos.stride(0), cos.stride(2),
            INTERLEAVED=interleaved, BACKWARD=backward, BLOCK_T=BLOCK_T,
            BLOCK_P=triton.next_power_of_2(max(rot // 2, 1)), BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, rot, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.args = (rot, interleaved)
        ctx.dtype = x.dtype
        # the reference's x * cos promotes: bf16 q with fp32 cos (under autocast) gives fp32
        return _launch(x, cos, sin, rot, interleaved, False, torch.promote_types(x.dtype, cos.dtype))

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, *ctx.args, True, ctx.dtype), None, None, None, None


def apply_rope(x, cos, sin, rotary_dim: int, interleaved: bool = False):
    """Rotate the first ``rotary_dim`` dims of ``x`` (B, H, T, D) by (B or 1, 1, T, rotary_dim) cos/sin."""
    if x.dim() != 4 or cos.shape[-1] != rotary_dim or rotary_dim > x.shape[-1] or rotary_dim % 2:
        raise ValueError(f"rope: x {tuple(x.shape)} with cos {tuple(cos.shape)} and rotary_dim {rotary_dim} do not fit")
    return _Rope.apply(x, cos.detach(), sin.detach(), rotary_dim, interleaved)


def rope_module(module, q, k, state):
    """``components.positions.RoPE.rotate`` with the rotation fused."""
    cos, sin = state
    inter = module.cfg.layout == "interleaved"
    return apply_rope(q, cos, sin, module.dim, inter), apply_rope(k, cos, sin, module.dim, inter)
