"""Linear + cross-entropy fused and chunked: the loss from hidden states and the head weight
without ever holding the (tokens x vocab) logits, let alone an fp32 copy of them.

Tokens are processed in chunks. For each chunk the logits are computed by one matmul in the
input dtype (as the reference head does); one Triton program per token then reads its row in
blocks, applies the final-logit soft-cap, finds the log-partition ``lse`` online, and overwrites
the row with the token's gradient of ``CE + z_loss * lse^2`` (soft-cap derivative included).
Two more matmuls, which also apply the mean's 1/n, turn that into the chunk's hidden-state
gradient and its share of the weight gradient, so the backward only scales what the forward
already computed.

The weight gradient is accumulated across chunks in fp32 for bf16/fp16 weights (in the weight's
dtype otherwise; ``accumulate_dtype`` changes that). Ignored labels (``ignore_index``) count
neither in the mean nor in z; any other label outside [0, V) is refused. Nothing waits for the
device: the mean's 1/n stays a tensor.
"""

import math

import torch
import triton
import triton.language as tl

from zoo.components.kernels import on_device

BLOCK_V = 1024


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _ce_rows(LOGITS, stride, LABELS, LOSS, LSE, V, softcap, ce_scale, z_scale, ignore_index,
             HAS_CAP: tl.constexpr, WANT_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
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
    if WANT_GRAD:
        # d/dx (ce_scale * (lse - x_label) + z_scale * lse^2) = (ce_scale + 2 z_scale lse) p - ce_scale [label]
        coef = tl.where(valid, ce_scale + 2.0 * z_scale * lse, 0.0)
        hit = tl.where(valid, ce_scale, 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            raw = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_CAP:
                t = _tanh(raw / softcap)
                x = softcap * t
            else:
                x = raw
            g = coef * tl.exp(x - lse) - tl.where(cols == safe, hit, 0.0)
            if HAS_CAP:
                g = g * (1.0 - t * t)
            tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def _chunk_rows(n: int, d: int, v: int) -> int:
    """Rows per chunk so that a chunk's logits are about the size of the hidden states."""
    return max(1, min(n, triton.next_power_of_2(math.ceil(n * d / v)) if v > d else n))


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, labels, softcap, z_loss, ignore_index, want_grad, acc_dtype):
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
        grad_h = torch.empty_like(h) if want_grad and h.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=h.device) \
            if want_grad and weight.requires_grad else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=h.device) \
            if want_grad and bias is not None and bias.requires_grad else None
        rows = _chunk_rows(n, d, v)
        for start in range(0, n, rows):
            hc = h[start:start + rows]
            logits = hc @ weight.t()
            if bias is not None:
                logits += bias
            logits = logits.contiguous()
            # The rows get the per-token gradient (entries in [-1, 1]); the 1/n of the mean is applied
            # after the matmuls below, so that fp16 rows do not underflow at large n.
            _ce_rows[(hc.shape[0],)](
                logits, logits.stride(0), labels[start:start + rows], loss_rows[start:], lse_rows[start:], v,
                float(softcap or 1.0), 1.0, z_loss, ignore_index,
                HAS_CAP=softcap is not None, WANT_GRAD=want_grad, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(v)),
            )
            if grad_h is not None:
                torch.mm(logits, weight, out=grad_h[start:start + rows])
            if grad_w is not None:
                grad_w.addmm_(logits.t().to(grad_w.dtype), hc.to(grad_w.dtype))
            if grad_b is not None:
                grad_b += logits.float().sum(0)
        for g in (grad_h, grad_w, grad_b):
            if g is not None:
                g.mul_(scale.to(g.dtype))
        ce = loss_rows.sum() * scale
        z = lse_rows.pow(2).sum() * scale
        loss = ce + z_loss * z  # a tensor of its own: ce and z are marked non-differentiable
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(ce, z)
        return loss, ce, z

    @staticmethod
    def backward(ctx, grad_loss, _ce, _z):
        # The gradients were computed in the forward; scale them in place (no second full-size
        # copy under gradient accumulation). A second backward through the same graph
        # (retain_graph) is refused by autograd: the saved tensors have changed.
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes

        def scaled(g, dtype):
            if g is None:
                return None
            g = g.mul_(grad_loss.to(g.dtype))
            return g if dtype is None or g.dtype == dtype else g.to(dtype)

        return scaled(grad_h, None), scaled(grad_w, w_dtype), scaled(grad_b, b_dtype), None, None, None, None, None, None


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
    want_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h2, weight, bias))
    device = h.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast would for the head matmul, then run without it
        dt = torch.get_autocast_dtype(device)
        h2, weight, bias = (t.to(dt) if t is not None else None for t in (h2, weight, bias))
    if accumulate_dtype is None:
        accumulate_dtype = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    with torch.autocast(device, enabled=False), on_device(h2):
        return _FusedLinearCE.apply(h2.contiguous(), weight, bias, labels2.contiguous(), softcap, float(z_loss),
                                    ignore_index, want_grad, accumulate_dtype)


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
