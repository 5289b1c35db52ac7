"""Linear + cross-entropy fused and chunked: the loss from hidden states and the head weight
without ever holding the (tokens x vocab) logits, let alone an fp32 copy of them.

Every product with the head takes the matmul dtype's operands (bf16 under bf16 autocast or with
bf16 weights) and accumulates in fp32 inside the GEMM, as the reference head does; a sum across
chunks is kept in ``accumulate_dtype`` by adding each chunk's product to it, never by casting the
operands up (a float32 GEMM runs on CUDA cores at a fifteenth of the tensor cores' rate).

One pass, when gradients are wanted (the default): token chunk by chunk, the chunk's logits over
the whole vocabulary are computed by one matmul; one Triton program per token finds its row's
log-partition ``lse`` online (final-logit soft-cap applied), a second overwrites the row with the
gradient of ``CE + z_loss * lse^2`` (soft-cap derivative included; entries in [-1, 1]; ignored
rows are zero, whatever their logits). Two matmuls turn the rows into the chunk's hidden-state
gradient and its share of the weight gradient: three head products in all, as Liger-Kernel does.
The forward returns the gradients, scaled by the mean's 1/n, and the backward only multiplies
them by the incoming gradient. Memory: one chunk's logits (about the size of the hidden states),
the gradients themselves (held from the forward to the backward, which comes straight after), and,
for bf16/fp16 weights, the weight gradient's float32 sum (``4 * V * d`` bytes, 2.1 GB for
Llama-3-8B's head). With fp32 weights (master weights under autocast) the sum is the gradient itself.

Two passes, when that float32 sum would exceed ``FORWARD_SUM_BYTES`` (Llama-3-70B's 4.2 GB): the
forward keeps only ``lse`` (one float per token); the backward, block by block of the vocabulary
(about a sixteenth of it) and token chunk by chunk, computes the logits again, overwrites them with
their gradient, and sums the block's weight gradient in float32 before rounding it once into the
gradient returned, so the float32 sum held is one block's. Four head products instead of three.
With several blocks the hidden-state gradient is summed across them in ``accumulate_dtype``.

Ignored labels (``ignore_index``) count neither in the mean nor in z and get zero gradient; any
other label outside [0, V) is refused. The mean's 1/n and the incoming gradient are applied after
the matmuls, so fp16 rows do not underflow. Nothing waits for the device: the 1/n stays a tensor.

Forward and backward are custom operators (``zoo::fused_linear_ce`` and its backward), so
``torch.compile`` calls them as they are, one node each, and the compiled loss never holds the logits.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from zoo.components.kernels import on_device

BLOCK_V = 1024
# The one-pass path is taken when the weight gradient's float32 sum, beyond the gradient itself,
# takes at most this many bytes (Llama-3-8B's head: 2.1 GB); else the two-pass, block-bounded path.
FORWARD_SUM_BYTES = 2 ** 31


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _ce_rows(LOGITS, stride, LABELS, LOSS, LSE, V, softcap, ignore_index,
             HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per token: the log-partition ``lse`` (found online over blocks of its row) and ``lse - x_label``."""
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    label = tl.load(LABELS + row)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            x = softcap * _tanh(x / softcap)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = label != ignore_index
    safe = tl.where(valid, label, 0).to(tl.int64)
    target = tl.load(ptr + safe).to(tl.float32)
    if HAS_CAP:
        target = softcap * _tanh(target / softcap)
    tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))
    tl.store(LSE + row, tl.where(valid, lse, 0.0))


@triton.jit
def _ce_grad(TILE, stride, LABELS, LSE, col0, C, softcap, z_scale, ignore_index,
             HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite a tile of logits (vocabulary columns ``col0 .. col0 + C``) with each token's gradient
    of ``(lse - x_label) + z_scale * lse^2``, from the ``lse`` the forward found: (1 + 2 z lse) p - [label]."""
    row = tl.program_id(0).to(tl.int64)
    ptr = TILE + row * stride
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    lse = tl.load(LSE + row)
    coef = 1.0 + 2.0 * z_scale * lse
    for start in range(0, C, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < C
        raw = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            t = _tanh(raw / softcap)
            x = softcap * t
        else:
            x = raw
        # An ignored row's lse is 0: exp(x - 0) overflows past x = 88.7, and 0 * inf is NaN, so
        # the row is zeroed by selection, never by multiplying.
        g = tl.where(valid, coef * tl.exp(x - lse) - tl.where(col0 + cols == label, 1.0, 0.0), 0.0)
        if HAS_CAP:
            g = g * (1.0 - t * t)
        tl.store(ptr + cols, g.to(TILE.dtype.element_ty), mask=mask)


def _chunk_rows(n: int, d: int, v: int) -> int:
    """Rows per chunk so that a chunk's logits (over ``v`` columns) are about the size of the hidden states."""
    return max(1, min(n, triton.next_power_of_2(math.ceil(n * d / v)) if v > d else n))


def _vocab_cols(v: int, d: int) -> int:
    """Vocabulary rows of the head per backward block: about a sixteenth of the vocabulary (at least
    one kernel block), so the block's float32 weight-gradient sum is a sixteenth of the head's."""
    return min(v, max(BLOCK_V, triton.next_power_of_2(math.ceil(v / 16))))


def _logits(h, weight, bias, dtype):
    out = h @ weight.to(dtype).t()
    if bias is not None:
        out += bias.to(dtype)
    return out.contiguous()


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``a`` and ``b`` as they are (bf16 operands, fp32 accumulation in the
    GEMM): in place when ``acc`` has their dtype; into a float32 sum on CUDA, the GEMM's float32
    result is added (``out_dtype``, torch >= 2.8); elsewhere the product, rounded once, is."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and acc.dtype == torch.float32:
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc.add_(a @ b)


def _scaled(x: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * factor`` in ``dtype``, multiplied in float32 (in place when ``x`` is float32 already)."""
    return (x.mul_(factor) if x.dtype == torch.float32 else x.float().mul_(factor)).to(dtype)


def _grad_rows(tile, labels, lse, col0, softcap, z_loss, ignore_index):
    """Overwrite ``tile`` (logits of vocabulary columns ``col0 ..``) with the rows' gradients."""
    _ce_grad[(tile.shape[0],)](
        tile, tile.stride(0), labels, lse, col0, tile.shape[1], float(softcap or 1.0), z_loss, ignore_index,
        HAS_CAP=softcap is not None, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(tile.shape[1])),
    )


def one_pass(weight: torch.Tensor, acc_dtype: torch.dtype, need_w: bool) -> bool:
    """Whether the forward computes the gradients: when the weight gradient's float32 sum beyond
    the gradient itself (none with fp32 weights, or no weight gradient) fits ``FORWARD_SUM_BYTES``."""
    extra = weight.numel() * torch.finfo(acc_dtype).bits // 8 if need_w and acc_dtype != weight.dtype else 0
    return extra <= FORWARD_SUM_BYTES


# The loss is two custom operators, so that ``torch.compile`` calls them as they are (one opaque node
# each, forward and backward) instead of tracing into the Triton launches and the Python loops.

def _forward(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
             softcap: Optional[float], z_loss: float, ignore_index: int, dtype: torch.dtype,
             acc_dtype: torch.dtype, need_h: bool, need_w: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, ce, z, lse, scale, grad_h, grad_w, grad_b)``: the loss and its parts, the
    log-partition of each token and the mean's 1/n, and the gradients asked for by ``need_*``
    (each empty when not asked for), for an incoming gradient of 1."""
    n, d = h.shape
    v = weight.shape[0]
    valid = labels != ignore_index
    # The kernel reads each label's logit: one outside [0, V) would read out of bounds. Checked
    # on the device, without a sync (on CUDA a failure is a device-side assert).
    torch._assert_async(((labels >= 0) & (labels < v) | ~valid).all(),
                        f"labels must lie in [0, {v}) (the vocabulary) or equal ignore_index {ignore_index}")
    scale = 1.0 / valid.sum().clamp(min=1).float()  # a tensor: no host sync for the mean's 1/n
    loss_rows = torch.empty(n, dtype=torch.float32, device=h.device)
    lse_rows = torch.empty(n, dtype=torch.float32, device=h.device)
    w = weight.to(dtype)  # autocast's cast of the head, for the forward only
    grad_h = torch.empty(n, d, dtype=dtype, device=h.device) if need_h else h.new_empty(0)
    acc_w = grad_w = h.new_empty(0)
    if need_w:
        grad_w = torch.zeros_like(weight)
        acc_w = grad_w if acc_dtype == weight.dtype else torch.zeros(weight.shape, dtype=acc_dtype, device=h.device)
    acc_b = torch.zeros(v, dtype=torch.float32, device=h.device) if need_b else h.new_empty(0)
    rows = _chunk_rows(n, d, v)
    with on_device(h):
        for start in range(0, n, rows):
            hc = h[start:start + rows].to(dtype)
            lc = labels[start:start + rows]
            logits = _logits(hc, w, bias, dtype)
            _ce_rows[(hc.shape[0],)](
                logits, logits.stride(0), lc, loss_rows[start:], lse_rows[start:], v,
                float(softcap or 1.0), ignore_index,
                HAS_CAP=softcap is not None, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(v)),
            )
            if need_h or need_w or need_b:
                _grad_rows(logits, lc, lse_rows[start:start + rows], 0, softcap, z_loss, ignore_index)
                if need_h:
                    torch.mm(logits, w, out=grad_h[start:start + rows])
                if need_w:
                    _add_product(acc_w, logits.t(), hc)
                if need_b:
                    acc_b += logits.float().sum(0)
            del logits
    ce = loss_rows.sum() * scale
    z = lse_rows.pow(2).sum() * scale
    # The mean's 1/n after the products (fp16 rows would underflow), multiplied in float32: rounded
    # to bf16 first, the factor alone would be off by up to 2^-9.
    if need_h:
        grad_h = _scaled(grad_h, scale, h.dtype)
    if need_w:
        grad_w.copy_(_scaled(acc_w, scale, acc_w.dtype))
    grad_b = _scaled(acc_b, scale, bias.dtype) if need_b else h.new_empty(0)
    return ce + z_loss * z, ce, z, lse_rows, scale, grad_h, grad_w, grad_b


_forward_op = torch.library.custom_op("zoo::fused_linear_ce", _forward, mutates_args=())


@_forward_op.register_fake
def _(h, weight, bias, labels, softcap, z_loss, ignore_index, dtype, acc_dtype, need_h, need_w, need_b):
    loss, ce, z, scale = (h.new_empty((), dtype=torch.float32) for _ in range(4))
    return (loss, ce, z, h.new_empty(h.shape[0], dtype=torch.float32), scale,
            torch.empty_like(h) if need_h else h.new_empty(0), torch.empty_like(weight) if need_w else h.new_empty(0),
            torch.empty_like(bias) if need_b else h.new_empty(0))


def _backward(grad_loss: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, softcap: Optional[float], z_loss: float,
              ignore_index: int, dtype: torch.dtype, acc_dtype: torch.dtype, need_h: bool, need_w: bool,
              need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-pass backward. Block by block of the vocabulary, the logits are computed again and
    overwritten with their gradient rows: the block's weight gradient is summed over the token
    chunks in ``acc_dtype`` and rounded once into the gradient returned, and the hidden-state
    gradient is summed over the blocks (in ``acc_dtype`` when there are several). Beyond the
    gradients returned, the backward holds one block's float32 sums and one chunk's logits. A
    gradient not asked for is returned empty."""
    n, d = h.shape
    v = weight.shape[0]
    factor = grad_loss.float() * scale  # the mean's 1/n and the incoming gradient
    cols = _vocab_cols(v, d)
    rows = _chunk_rows(n, d, cols)
    single = cols >= v  # one block: the hidden-state gradient needs no sum across blocks
    grad_h = h.new_empty(0)
    if need_h:  # in one block, written once in the matmuls' dtype; over several, summed in acc_dtype
        grad_h = torch.empty(n, d, dtype=dtype, device=h.device) if single else \
            torch.zeros(n, d, dtype=acc_dtype, device=h.device)
    grad_w = torch.empty_like(weight) if need_w else h.new_empty(0)
    grad_b = torch.empty_like(bias) if need_b else h.new_empty(0)
    with on_device(h):
        for c0 in range(0, v, cols):
            wc = weight[c0:c0 + cols].to(dtype)
            bc = bias[c0:c0 + cols] if bias is not None else None
            acc_w = torch.zeros(wc.shape, dtype=acc_dtype, device=h.device) if need_w else None
            acc_b = torch.zeros(wc.shape[0], dtype=torch.float32, device=h.device) if need_b else None
            for r0 in range(0, n, rows):
                hc = h[r0:r0 + rows].to(dtype)
                tile = _logits(hc, wc, bc, dtype)
                _grad_rows(tile, labels[r0:r0 + rows], lse[r0:r0 + rows], c0, softcap, z_loss, ignore_index)
                if need_h and single:
                    torch.mm(tile, wc, out=grad_h[r0:r0 + rows])
                elif need_h:
                    _add_product(grad_h[r0:r0 + rows], tile, wc)
                if need_w:
                    _add_product(acc_w, tile.t(), hc)
                if need_b:
                    acc_b += tile.float().sum(0)
                del tile
            if need_w:
                grad_w[c0:c0 + cols] = _scaled(acc_w, factor, acc_dtype)
            if need_b:
                grad_b[c0:c0 + cols] = _scaled(acc_b, factor, torch.float32)
            del wc, acc_w, acc_b
    if need_h:
        grad_h = _scaled(grad_h, factor, h.dtype)
    return grad_h, grad_w, grad_b


_backward_op = torch.library.custom_op("zoo::fused_linear_ce_backward", _backward, mutates_args=())


@_backward_op.register_fake
def _(grad_loss, h, weight, bias, labels, lse, scale, softcap, z_loss, ignore_index, dtype, acc_dtype,
      need_h, need_w, need_b):
    return (torch.empty_like(h) if need_h else h.new_empty(0), torch.empty_like(weight) if need_w else h.new_empty(0),
            torch.empty_like(bias) if need_b else h.new_empty(0))


def _setup_context(ctx, inputs, output):
    h, weight, bias, labels, softcap, z_loss, ignore_index, dtype, acc_dtype, *early = inputs
    _, ce, z, lse, scale, *grads = output
    ctx.early = any(early)
    if ctx.early:  # the gradients, computed in the forward: the backward scales them
        ctx.save_for_backward(*grads)
    else:  # the inputs themselves and one float per token (no gradient-sized tensor)
        ctx.save_for_backward(h, weight, bias, labels, lse, scale)
    ctx.settings = (softcap, z_loss, ignore_index, dtype, acc_dtype)
    ctx.mark_non_differentiable(ce, z, lse, scale, *grads)
    ctx.set_materialize_grads(False)  # no zeros for the outputs that take no gradient (head-sized ones too)


def _grads(ctx, grad_loss, _ce, _z, _lse, _scale, *_grads):
    need = ctx.needs_input_grad[:3]
    if grad_loss is None:  # only the non-differentiable outputs were used
        return (None,) * 12
    if ctx.early:
        grads = [g * grad_loss.to(g.dtype) if g.numel() else g for g in ctx.saved_tensors]
    else:
        h, weight, bias, labels, lse, scale = ctx.saved_tensors
        grads = _backward_op(grad_loss, h, weight, bias, labels, lse, scale, *ctx.settings, *need)
    return (*(g if wanted else None for g, wanted in zip(grads, need)), *[None] * 9)


_forward_op.register_autograd(_grads, setup_context=_setup_context)


def fused_linear_cross_entropy(h, weight, labels, *, bias=None, softcap=None, z_loss=0.0, ignore_index=-100,
                               accumulate_dtype=None):
    """``lm_loss(softcap(h @ weight.T + bias), labels, z_loss)`` without materialising the logits.

    ``h`` is (..., d), ``labels`` the matching (...) targets in [0, V) or ``ignore_index``.
    Returns ``(loss, ce, z)``; only ``loss`` carries gradients. The weight gradient is summed
    over chunks in ``accumulate_dtype``: by default fp32 for bf16 and fp16 weights (summing
    chunk by chunk in bf16 loses several times a single matmul's precision), else the weight's.
    """
    d = h.shape[-1]
    h2, labels2 = h.reshape(-1, d), labels.reshape(-1)
    if h2.shape[0] != labels2.shape[0]:
        raise ValueError(f"hidden states {tuple(h.shape)} and labels {tuple(labels.shape)} do not match")
    device = h.device.type
    # Under autocast the head's matmuls take autocast's dtype, as they would in the reference; the
    # casts happen inside, block by block, so that no cast copy of the head is kept for the backward.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if accumulate_dtype is None:
        accumulate_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    need = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (h, weight, bias)]
    if not any(need) or not one_pass(weight, accumulate_dtype, need[1]):
        need = [False] * 3  # the two-pass path: the backward computes what autograd asks for
    with torch.autocast(device, enabled=False):
        return _forward_op(h2.contiguous(), weight, bias, labels2.contiguous(), None if softcap is None else float(softcap),
                           float(z_loss), ignore_index, dtype, accumulate_dtype, *need)[:3]


def decoder_loss(model, hidden, labels, *, z_loss, ignore_index=-100):
    """The fused loss for a ``zoo.Decoder``: its head weight/bias, padded vocab, logit scale and soft-cap."""
    weight, bias = model.head()
    vocab = model.spec.vocab_size
    if weight.shape[0] != vocab:
        weight = weight[:vocab]
        bias = bias[:vocab] if bias is not None else None
    scale = model.spec.head.scale
    if scale is not None:  # scale * (h W^T + b) = (scale h) W^T + scale b
        hidden = hidden * scale
        bias = bias * scale if bias is not None else None
    return fused_linear_cross_entropy(hidden, weight, labels, bias=bias, softcap=model.spec.head.softcap,
                                      z_loss=z_loss, ignore_index=ignore_index)
