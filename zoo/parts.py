"""The interfaces that registered parts implement, and the context the builder hands them.

These are deliberately thin: a norm is any ``nn.Module`` built as ``cls(config, dim=...)``;
an attention is built as ``cls(config, d_model=..., layer=..., spec=...)`` and called as
``attn(x, ctx, layer_idx, rotary)``. Fast kernels (SDPA, flex attention, Triton) live behind
these calls, so a registered part never has to know which one runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from zoo.spec import Part


class PositionEncoding(nn.Module):
    """Base for position encodings. Absolute ones add to the embeddings; rotary ones rotate q and k;
    bias ones (ALiBi) add to the attention scores. Override what applies."""

    #: "embedding" (added to token embeddings), "qk" (rotates queries and keys), "bias", or "none".
    applies_to: ClassVar[str] = "none"

    @classmethod
    def max_positions(cls, config: Any, spec: Any) -> Optional[int]:
        """The most positions this encoding can represent in a model of ``spec`` (a learned table
        has ``max_seq_len`` rows); None when it has no hard limit (RoPE and ALiBi extrapolate)."""
        return None

    def embed(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        return None

    def prepare(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-forward state shared by every layer using this encoding (RoPE's cos and sin)."""
        return position_ids

    def rotate(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def score_bias(self, state: Any, q_idx: torch.Tensor, k_idx: torch.Tensor, n_heads: int) -> Optional[torch.Tensor]:
        """An additive (1 or B, H, Tq, Tk) bias on attention scores, or None."""
        return None


@dataclass
class Rotary:
    """A layer's view of its position encoding during one forward."""

    module: PositionEncoding
    state: Any

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.rotate(q, k, self.state)

    def score_bias(self, q_idx: torch.Tensor, k_idx: torch.Tensor, n_heads: int) -> Optional[torch.Tensor]:
        return self.module.score_bias(self.state, q_idx, k_idx, n_heads)


@dataclass
class ForwardContext:
    """What every layer needs to know about the current forward pass.

    ``q_idx`` are the absolute slots of the current tokens in the sequence (including left
    padding), which causal and sliding-window masks are computed on; ``position_ids`` are the
    positions the position encoding sees (they skip padding). ``key_mask`` (B, past + T) marks
    real tokens, ``None`` when there is no padding.
    """

    position_ids: torch.Tensor
    q_idx: torch.Tensor
    key_mask: Optional[torch.Tensor] = None
    cache: Any = None
    dropout: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)


def build_part(part: Part | str, kind: str, **context: Any) -> nn.Module:
    """Build a part given as a :class:`Part` or a bare registered name (default config)."""
    if isinstance(part, str):
        from zoo.spec import parse_part

        part = parse_part(kind, part, kind)
    return part.build(**context)
