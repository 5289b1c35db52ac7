"""An opt-in compiled decode path: a static cache and one ``torch.compile``d single-token step.

The prompt is prefilled eagerly into the ordinary :class:`~zoo.cache.KVCache`, then copied into a
:class:`StaticKVCache`: buffers preallocated once (a full-attention layer holds every slot up to
``max_len``, a sliding-window layer a ring of ``window`` slots), with the key padding mask
preallocated too. Each decode step has the same shapes and no data-dependent Python branch (the
slot and the positions are tensors; the mask is always built from fixed-size tensors), so the one
compiled step is reused for every token. Unfilled slots are masked by the causal rule: a full
buffer's slot ``s`` is labelled ``s`` (after the query), an empty ring slot ``-window`` (out of the
window).
"""

from __future__ import annotations

import torch

from zoo.cache import KVCache
from zoo.parts import ForwardContext

_STEP = None  # the compiled step, made on first use (importing the compiler costs seconds)
ROUND = 64  # max_len is rounded up to a multiple of this, so nearby lengths share one compilation


class StaticKVCache:
    """Fixed-size per-layer buffers (B, kv_heads, capacity, head_dim) for one-token steps."""

    def __init__(self, model, batch: int, max_len: int, dtype: torch.dtype, device):
        self.max_len = max_len
        self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.k, self.v, self.idx = [], [], []
        for layer in model.layers:
            att = layer.attention
            window = att.window
            cap = min(window or max_len, max_len)
            self.k.append(torch.zeros(batch, att.n_kv_heads, cap, att.head_dim, dtype=dtype, device=device))
            self.v.append(torch.zeros(batch, att.n_kv_heads, cap, att.head_dim, dtype=dtype, device=device))
            empty = torch.arange(cap, device=device) if cap == max_len else torch.full((cap,), -window, device=device)
            self.idx.append(empty)

    @classmethod
    def from_cache(cls, model, cache: KVCache, max_len: int) -> "StaticKVCache":
        """A static cache holding what an eager prefill left in ``cache`` (same slot layout)."""
        first = next(s for s in cache.layers if s is not None)
        B = first.k.shape[0]
        static = cls(model, B, max_len, first.k.dtype, first.k.device)
        for i, store in enumerate(cache.layers):
            n = store.filled
            static.k[i][:, :, :n], static.v[i][:, :, :n], static.idx[i][:n] = store.k[:, :, :n], store.v[:, :, :n], store.idx[:n]
        if cache.key_mask is not None:
            static.key_mask[:, : cache.seen] = cache.key_mask
        return static

    def update(self, layer: int, k, v, k_idx):
        """Store one token's keys and values at slot ``k_idx % capacity``; return the whole buffers."""
        slot = k_idx % self.idx[layer].shape[0]
        self.k[layer].index_copy_(2, slot, k)
        self.v[layer].index_copy_(2, slot, v)
        self.idx[layer].index_copy_(0, slot, k_idx)
        return self.k[layer], self.v[layer], self.idx[layer]


def _step(model, cache: StaticKVCache, ids, q_idx, position_ids):
    ctx = ForwardContext(position_ids=position_ids, q_idx=q_idx, key_mask=cache.key_mask, cache=cache)
    return model.logits_from_hidden(model.hidden_states_in(ids, ctx)[:, -1])


def compiled_step():
    """The single-token decode step, compiled once per process (recompiled for a new model or shape)."""
    global _STEP
    if _STEP is None:
        _STEP = torch.compile(_step, dynamic=False)
    return _STEP


class CompiledDecoder:
    """``decoder(step_ids, attention_mask) -> (B, vocab)`` logits of the last position: the first
    call prefills eagerly, every later (one-token) call runs the compiled step."""

    def __init__(self, model, prompt_len: int, max_new_tokens: int):
        self.model = model
        self.max_len = -(-(prompt_len + max_new_tokens) // ROUND) * ROUND
        self.static = None

    def __call__(self, ids, attention_mask=None):
        if self.static is None:
            cache = KVCache.for_model(self.model, max_len=ids.shape[1])
            hidden = self.model.hidden_states(ids, attention_mask=attention_mask, cache=cache)
            self.static = StaticKVCache.from_cache(self.model, cache, self.max_len)
            self.seen = cache.seen
            real = cache.key_mask.sum(-1) if cache.key_mask is not None else torch.full((ids.shape[0],), cache.seen)
            self.position = real.to(ids.device)[:, None]
            return self.model.logits_from_hidden(hidden[:, -1])
        if self.seen >= self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} slots; it is full")
        q_idx = torch.tensor([self.seen], device=ids.device)
        logits = compiled_step()(self.model, self.static, ids, q_idx, self.position)
        self.seen += 1
        self.position = self.position + 1
        return logits
