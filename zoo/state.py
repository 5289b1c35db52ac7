"""Key/value cache for incremental decoding.

Each layer stores keys and values as (batch, kv_heads, capacity, head_dim): sized by the number
of *kv* heads, so GQA and MQA really store fewer bytes. A layer with a sliding window keeps a ring
buffer of ``window`` slots (slot ``s`` lives at ``s % window``): its memory is bounded however
long the sequence grows. A layer without one stores every slot in place, in a buffer that grows
by doubling (or is sized once from ``max_len``), so a decode step copies nothing.

The protocol the attention part uses: ``update(layer, k, v, k_idx) -> (k_all, v_all, idx_all)``
stores the new keys and returns every key the new queries may need, with the absolute slot of
each (ring buffers return them out of order; masks are computed from slots, so order does not
matter). The model keeps ``seen`` (slots so far, including left padding) and ``key_mask``.
"""

from __future__ import annotations

from typing import Optional

import torch


class _Layer:
    """One layer's buffers: keys, values and the absolute slot each entry holds."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, capacity: int):
        B, H, _, D = k.shape
        self.k = k.new_empty(B, H, capacity, D)
        self.v = v.new_empty(B, H, capacity, v.shape[-1])
        self.idx = torch.full((capacity,), -1, dtype=torch.long, device=k.device)
        self.filled = 0  # entries in use (a ring, once full, stays full)

    def grow(self, capacity: int) -> None:
        n = self.filled
        k, v, idx = self.k, self.v, self.idx
        self.k = k.new_empty(*k.shape[:2], capacity, k.shape[-1])
        self.v = v.new_empty(*v.shape[:2], capacity, v.shape[-1])
        self.idx = torch.full((capacity,), -1, dtype=torch.long, device=idx.device)
        self.k[:, :, :n], self.v[:, :, :n], self.idx[:n] = k[:, :, :n], v[:, :, :n], idx[:n]


class KVCache:
    """A dynamic cache. ``windows[i]`` is layer i's sliding window (None: full attention).
    ``max_len`` (prompt + new tokens, when known) sizes the full-attention buffers once."""

    def __init__(self, windows: list[Optional[int]], max_len: Optional[int] = None):
        self.windows = list(windows)
        self.max_len = max_len
        self.layers: list[Optional[_Layer]] = [None] * len(windows)
        self.key_mask: Optional[torch.Tensor] = None  # (B, seen) real tokens, None if no padding
        self.seen = 0  # tokens seen so far (slots 0..seen-1)

    @classmethod
    def for_model(cls, model, max_len: Optional[int] = None) -> "KVCache":
        return cls([layer.attention.window for layer in model.layers], max_len=max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor):
        """Store (B, Hkv, T, D) keys and values at slots ``k_idx``; return every key the layer's
        new queries may attend to, with their slots."""
        window = self.windows[layer]
        T = k.shape[2]
        store = self.layers[layer]
        if window is None:
            end = int(k_idx[-1]) + 1
            if store is None:
                store = self.layers[layer] = _Layer(k, v, max(end, self.max_len or 0))
            elif end > store.k.shape[2]:
                store.grow(max(end, 2 * store.k.shape[2]))
            start = int(k_idx[0])
            store.k[:, :, start:end], store.v[:, :, start:end], store.idx[start:end] = k, v, k_idx
            store.filled = end
            return store.k[:, :, :end], store.v[:, :, :end], store.idx[:end]

        if store is None:
            store = self.layers[layer] = _Layer(k, v, window)
        n = store.filled
        if T == 1:
            # Write, then read: the slot overwritten (s - window) is exactly the one that left the window.
            self._write(store, k, v, k_idx, window)
            n = store.filled
            return store.k[:, :, :n], store.v[:, :, :n], store.idx[:n]
        # Several new queries (prefill, possibly longer than the window): the earliest of them still
        # needs keys the write would overwrite, so read first.
        k_all = torch.cat([store.k[:, :, :n], k], dim=2)
        v_all = torch.cat([store.v[:, :, :n], v], dim=2)
        idx_all = torch.cat([store.idx[:n], k_idx])
        self._write(store, k, v, k_idx, window)
        return k_all, v_all, idx_all

    @staticmethod
    def _write(store: _Layer, k, v, k_idx, window: int) -> None:
        keep = min(k.shape[2], window)
        slots = k_idx[-keep:] % window
        store.k[:, :, slots], store.v[:, :, slots], store.idx[slots] = k[:, :, -keep:], v[:, :, -keep:], k_idx[-keep:]
        store.filled = min(window, max(store.filled, int(k_idx[-1]) + 1))

    def nbytes(self) -> int:
        """Bytes held by keys and values (what the accounting's per-token figure predicts)."""
        return sum(s.k.numel() * s.k.element_size() + s.v.numel() * s.v.element_size()
                   for s in self.layers if s is not None)
