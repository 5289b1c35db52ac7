"""Key/value cache for incremental decoding.

Sized by kv heads (GQA and MQA store fewer heads). A layer with a sliding window keeps only
the last ``window`` keys (a ring buffer in effect): its memory is bounded however long the
sequence grows. Each entry remembers the absolute slot of every key so masks stay exact.
"""

from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    def __init__(self, windows: list[Optional[int]]):
        self.windows = list(windows)
        self.k: list[Optional[torch.Tensor]] = [None] * len(windows)
        self.v: list[Optional[torch.Tensor]] = [None] * len(windows)
        self.idx: list[Optional[torch.Tensor]] = [None] * len(windows)
        self.key_mask: Optional[torch.Tensor] = None  # (B, seen) real tokens, None if no padding
        self.seen = 0  # tokens seen so far (slots 0..seen-1)

    @classmethod
    def for_model(cls, model) -> "KVCache":
        return cls([layer.attention.window for layer in model.layers])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor):
        """Append (B, Hkv, T, D) keys and values; return everything the layer may attend to."""
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
            k_idx = torch.cat([self.idx[layer], k_idx])
        full_k, full_v, full_idx = k, v, k_idx
        window = self.windows[layer]
        if window is not None and k.shape[2] > window - 1:
            # The next query (slot s) sees keys s-window+1 .. s: keep the last window-1.
            keep = window - 1
            k, v, k_idx = k[:, :, -keep:], v[:, :, -keep:], k_idx[-keep:]
        self.k[layer], self.v[layer], self.idx[layer] = k, v, k_idx
        return full_k, full_v, full_idx

    def key_mask_for(self, idx: torch.Tensor) -> Optional[torch.Tensor]:
        if self.key_mask is None:
            return None
        return self.key_mask[:, idx]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
