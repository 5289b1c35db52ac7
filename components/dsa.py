"""DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer picks, for each query, the
``topk`` keys that attention then reads; everything else is masked out.

The indexer has its own small heads. Its queries come from MLA's query latent (``q_lora_rank``
wide), its single key per token from the hidden state through a LayerNorm; the leading
``rope_dim`` dimensions of both are rotated (half-split pairs, whatever layout the main attention
uses), and the score of key ``s`` for query ``t`` is

    I[t, s] = sum_h  w_h(x_t) * relu(q_{t,h} . k_s / sqrt(head_dim)),   w(x) = W_w x / sqrt(n_heads)

computed in float32. Selection is the top ``topk`` of ``I[t, :]`` among the keys the query may see
(causal, not padding); ties at the cut (ReLU makes exact zeros common) may go either way.

Its decode state, :class:`IndexKeys`, holds one ``head_dim``-wide key per token per layer beside
the attention's own cache.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.spec import SpecError


def check_topk(topk: int, field: str = "index_topk") -> None:
    if not isinstance(topk, int) or isinstance(topk, bool) or topk <= 0:
        raise SpecError(field, f"must be a positive number of keys per query, got {topk!r}")


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x`` as half-split pairs (i, i + d/2) by
    the per-pair angles whose cosines and sines are given; the rest passes through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class LightningIndexer(nn.Module):
    """The indexer of one layer: ``n_heads`` heads of ``head_dim``, a key per token, top-``topk``.

    Weights (DeepSeek's names): ``wq_b`` (q latent -> heads), ``wk`` (hidden -> key), ``k_norm``
    (a LayerNorm with bias, eps 1e-6), ``weights_proj`` (hidden -> one weight per head).
    """

    def __init__(self, *, d_model: int, q_dim: int, n_heads: int, head_dim: int, rope_dim: int, topk: int):
        super().__init__()
        check_topk(topk)
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise SpecError("index_head_dim", f"{head_dim} must hold the rotated part of {rope_dim} dims (even)")
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def reset_parameters(self):
        self.k_norm.reset_parameters()

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> the keys (B, T, head_dim); ``cos``/``sin`` per pair, (B, T, rope_dim/2)."""
        return rotate_half_pairs(self.k_norm(self.wk(x)), cos, sin)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index scores (B, Tq, Tk) in float32 of the queries at ``x``/``q_latent`` against ``keys``
        (B, Tk, head_dim), before any mask."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        q = rotate_half_pairs(q, cos[:, :, None], sin[:, :, None])
        logits = torch.einsum("bthd,bsd->bths", q.float(), keys.float()) * self.head_dim ** -0.5
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5  # (B, T, H)
        return torch.einsum("bth,bths->bts", w, F.relu(logits))

    def select(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Boolean (B, Tq, Tk): the top ``topk`` keys of each query among those ``allowed``
        (broadcastable to ``scores``); every allowed key when there are at most ``topk``."""
        allowed = allowed.expand_as(scores)
        if scores.shape[-1] <= self.topk:
            return allowed
        idx = scores.masked_fill(~allowed, float("-inf")).topk(self.topk, dim=-1).indices
        return torch.zeros_like(allowed).scatter_(-1, idx, True) & allowed


class IndexKeys:
    """The indexer's decode state for one layer: a ``head_dim``-wide key per slot, (B, capacity, D).

    ``update(k, slots)`` stores (B, T, D) keys at their slots and returns every key so far. The
    buffer grows by doubling (or is sized once from ``max_len``); :meth:`to_static` gives a copy of
    fixed size that a compiled step updates in place (unfilled slots lie after the query and are
    masked by causality).
    """

    def __init__(self, max_len: Optional[int] = None, *, static: bool = False):
        self.max_len, self.static = max_len, static
        self.k: Optional[torch.Tensor] = None
        self.filled = 0

    def update(self, k: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.static:
            self.k.index_copy_(1, slots, k.to(self.k.dtype))
            return self.k
        end = int(slots[-1]) + 1
        if self.k is None or end > self.k.shape[1]:
            held = 0 if self.k is None else self.k.shape[1]
            grown = k.new_empty(k.shape[0], max(end, self.max_len or 0, 2 * held), k.shape[-1])
            if self.k is not None:
                grown[:, : self.filled] = self.k[:, : self.filled]
            self.k = grown
        self.k[:, int(slots[0]) : end] = k
        self.filled = end
        return self.k[:, :end]

    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.numel() * self.k.element_size()

    def to_static(self, max_len: int) -> "IndexKeys":
        if self.k is None:
            raise ValueError("to_static needs a state that has been filled (prefill the prompt first)")
        out = IndexKeys(max_len, static=True)
        out.k = self.k.new_zeros(self.k.shape[0], max_len, self.k.shape[-1])
        out.k[:, : self.filled] = self.k[:, : self.filled]
        out.filled = self.filled
        return out
