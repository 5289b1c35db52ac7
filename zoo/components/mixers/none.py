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

from zoo.core.kinds import Cost, Mixer
from zoo.core.registry import register
from zoo.core.state import NoState


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

    # -- what this part states about itself ---------------------------------------------------------
    tp_plan: dict = {}  # nothing to shard: zeros shaped like the local sequence slice

    def cost(self, context: int) -> Cost:
        return Cost()

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Nothing: its zeros need no backward."""
        return 0.0

    def facts(self) -> dict:
        return {"token mixing": "none"}
