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

from zoo.components.mixers.scores import chunk_offsets, grid, same_chunk

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


def causal_mask(q_idx, k_idx, window: Optional[int], key_mask=None, documents=None, *, chunk: Optional[int] = None,
                mask_mod=None, shape: tuple = (1, 1)):
    """Boolean (Tq, Tk) or (B, H or 1, Tq, Tk) mask of what each query may see: keys at or before it,
    within ``window`` slots (``q - k < window``), in its own ``chunk`` (counted from the row's first
    real key), allowed by ``mask_mod(b, h, q, k)`` (on the slots; ``shape`` is (B, H) for its ``b``
    and ``h``), not padding, and of its own document (``documents`` (B, T): packed documents, queries
    and keys the same tokens); :class:`zoo.components.mixers.scores.Scores` states the rules. A row
    with nothing visible (a padding query) sees everything, so no row is all -inf."""
    allowed = k_idx[None, :] <= q_idx[:, None]
    if window is not None:
        allowed = allowed & (q_idx[:, None] - k_idx[None, :] < window)
    offsets = chunk_offsets(k_idx, key_mask) if chunk is not None else None
    if chunk is not None and offsets is None:
        allowed = allowed & same_chunk(q_idx[:, None], k_idx[None, :], chunk)
    if key_mask is not None:
        allowed = allowed[None, None] & key_mask[:, None, None, :]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    if offsets is not None:
        allowed = allowed & same_chunk(q_idx.view(1, 1, -1, 1), k_idx.view(1, 1, 1, -1), chunk, offsets.view(-1, 1, 1, 1))
    if mask_mod is not None:
        allowed = allowed & mask_mod(*grid(*shape, q_idx, k_idx))
    return allowed | ~allowed.any(-1, keepdim=True)


def dense_mask(q_idx, k_idx, window: Optional[int], key_mask=None, documents=None, *, chunk: Optional[int] = None,
               mask_mod=None, shape: tuple = (1, 1)):
    """:func:`causal_mask`, built once per forward and window (chunk, mask_mod) and shared by the layers."""
    if chunk is None and mask_mod is None:
        return per_forward((q_idx, k_idx, key_mask, documents), ("dense", window),
                           lambda: causal_mask(q_idx, k_idx, window, key_mask, documents))
    return per_forward((q_idx, k_idx, key_mask, documents), ("dense", window, chunk, mask_mod, shape if mask_mod else None),
                       lambda: causal_mask(q_idx, k_idx, window, key_mask, documents, chunk=chunk, mask_mod=mask_mod,
                                           shape=shape))
