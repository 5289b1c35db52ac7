"""Attention on FlexAttention (``torch.nn.attention.flex_attention``) for what SDPA cannot do
fused: tanh soft-capping of the scores (Gemma 2) as a ``score_mod`` and the causal sliding
window as a block-sparse ``mask_mod``, with GQA (no repeated K/V). Same semantics as the eager
reference in ``components/attention.py``; on CUDA the kernel is compiled once and reused.
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

_compiled = None
_masks: dict = {}


def _flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def _block_mask(q_idx, k_idx, window, allowed, batch, device):
    """A block mask for slots ``q_idx`` x ``k_idx``; ``allowed`` (B, 1, Tq, Tk) when padding
    makes it data-dependent (then it is not cached). Otherwise it is built once per forward and
    window: every layer of a forward gets the same slot tensors, recognised by identity (no sync)."""
    Tq, Tk = len(q_idx), len(k_idx)
    if allowed is not None:
        def mask_mod(b, h, qi, ki):
            return allowed[b, 0, qi, ki]
        return create_block_mask(mask_mod, batch, None, Tq, Tk, device=device)
    key = (id(q_idx), id(k_idx), window)
    hit = _masks.get(key)
    if hit is not None and hit[0] is q_idx and hit[1] is k_idx:
        return hit[2]

    def mask_mod(b, h, qi, ki):
        q, k = q_idx[qi], k_idx[ki]
        ok = k <= q
        if window is not None:
            ok = ok & (q - k < window)
        return ok

    mask = create_block_mask(mask_mod, None, None, Tq, Tk, device=device)
    if len(_masks) >= 8:
        _masks.clear()
    _masks[key] = (q_idx, k_idx, mask)  # holding the tensors keeps their ids from being reused
    return mask


def flex_attend(module, q, k, v, q_idx, k_idx, key_mask=None, bias=None):
    """``Attention.attend`` on FlexAttention: (B, H, Tq, D) x (B, Hkv, Tk, D) -> (B, H, Tq, D)."""
    if bias is not None or (module.training and module.dropout):
        # Score biases and attention dropout stay on the reference path.
        return module._eager(q, k, v, q_idx, k_idx, key_mask, bias)
    allowed = None
    if key_mask is not None:
        from zoo.components.attention import causal_mask

        allowed = causal_mask(q_idx, k_idx, module.window, key_mask)
    block_mask = _block_mask(q_idx, k_idx, module.window, allowed, q.shape[0], q.device)
    cap = module.cfg.softcap
    score_mod = None
    if cap is not None:
        from zoo.components.stability import softcap

        def score_mod(score, b, h, qi, ki):
            return softcap(score, cap)
    fn = _flex() if q.device.type == "cuda" else flex_attention
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=module.scale,
              enable_gqa=module.n_kv_heads != module.n_heads)
