"""Attention masks shared by the attention mixers (attention, MLA, DSA).

Masks that depend on the data (padding, cached slots) are the same for every layer of
a forward: build each once per forward and share it.

:func:`per_forward` keys a mask on the identity of the tensors it is built from (the forward's
slot and key-mask tensors, which every layer receives as the same objects) and forgets it when
any of them is freed, so nothing outlives its forward and an id is never reused while cached.
Under ``torch.compile`` it builds every time: the compiler sees one traced build per layer and
shares or fuses them itself.
"""

import weakref
from typing import Callable, Optional

import torch

_memo: dict = {}


def per_forward(tensors: tuple, extra, build: Callable):
    """``build()`` once for these tensors (``None`` entries allowed) and ``extra`` (hashable)."""
    if torch.compiler.is_compiling():
        return build()
    key = tuple(id(t) for t in tensors) + (extra,)
    hit = _memo.get(key)
    if hit is None:
        hit = _memo[key] = build()
        for t in tensors:
            if t is not None:
                weakref.finalize(t, _memo.pop, key, None)
    return hit


def causal_mask(q_idx, k_idx, window: Optional[int], key_mask=None, documents=None):
    """Boolean (Tq, Tk) or (B, 1, Tq, Tk) mask of what each query may see: keys at or before it,
    within ``window`` slots (``q - k < window``), not padding, and of its own document (``documents``
    (B, T): packed documents, queries and keys the same tokens). A row with nothing visible (a padding
    query) sees everything, so no row is all -inf."""
    allowed = k_idx[None, :] <= q_idx[:, None]
    if window is not None:
        allowed = allowed & (q_idx[:, None] - k_idx[None, :] < window)
    if key_mask is not None:
        allowed = allowed[None, None] & key_mask[:, None, None, :]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    return allowed | ~allowed.any(-1, keepdim=True)


def dense_mask(q_idx, k_idx, window: Optional[int], key_mask=None, documents=None):
    """:func:`causal_mask`, built once per forward and window and shared by the layers."""
    return per_forward((q_idx, k_idx, key_mask, documents), ("dense", window),
                       lambda: causal_mask(q_idx, k_idx, window, key_mask, documents))
