"""The ``ffn_only`` block: a layer with an FFN and no token mixer, ``y = x + FFN(N(x))``.

Nemotron-H interleaves single-part layers (a Mamba-2 mixer, attention, or an MLP, each ``norm ->
part -> residual``): its MLP layers are this block, its mixer layers ``mixer_only``. Such a layer
names the mixer ``none`` (:class:`NoMixer`: no parameters, an empty decode state, no cost, a zero
output), which the block holds in the mixer slot, so the model's decoding and accounting see every
layer alike. Any other mixer setting is not built (as ``mixer_only`` leaves ``ffn``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zoo.interfaces import Cost, Mixer, takes_ctx
from zoo.registry import register


class NoState:
    """The decode state of a layer that mixes no tokens: it holds nothing and serves every decoding
    path (compiled steps, truncation)."""

    def nbytes(self) -> int:
        return 0

    def to_static(self, max_len: int) -> "NoState":
        return self

    def truncate(self, n: int) -> None:
        pass


@register("mixer", "none")
class NoMixer(Mixer):
    """Mixer ``none``: the layer mixes no tokens (no parameters, no state, no cost; its output is
    zero). The mixer of an ``ffn_only`` layer; in another block the layer is its FFN alone."""

    mixes_tokens = False  # the conformance contract checks a zero output and no parameters instead

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg=None, *, d_model=None, layer=None, spec=None, index: int = 0):
        super().__init__()

    def forward(self, x, ctx=None, pos=None):
        return torch.zeros_like(x)

    def new_state(self, batch, max_len, *, dtype, device) -> NoState:
        return NoState()

    def cost(self, context: int) -> Cost:
        return Cost()

    def facts(self) -> dict:
        return {"token mixing": "none"}


@register("block", "ffn_only")
class FFNOnly(nn.Module):
    """``y = x + FFN(N(x))``: one norm, the layer's FFN, the residual. The layer's ``mixer`` setting is
    not built."""

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__()
        self.attention = NoMixer()
        self.ffn = layer.ffn.build(d_model=spec.d_model)
        self._ffn_ctx = takes_ctx(self.ffn)
        self.ffn_norm = layer.norm.build(dim=spec.d_model)
        self.drop = nn.Dropout(spec.dropout)

    @property
    def mixer(self) -> nn.Module:
        return self.attention

    def forward(self, x, ctx, pos):
        h = self.ffn_norm(x)
        return x + self.drop(self.ffn(h, ctx) if self._ffn_ctx else self.ffn(h))
