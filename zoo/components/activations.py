"""Pointwise activations: ReLU, squared ReLU, GeLU (exact or tanh), SiLU (Swish).

An activation names itself in Hugging Face configs with ``hf_names`` (HF name -> its config here),
which the checkpoint formats read through ``zoo.checkpoints.hf.common.activation``."""

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import nn

from zoo.core.kinds import Activation
from zoo.core.registry import register


@register("activation", "relu")
class ReLU(Activation):
    """``max(x, 0)`` (the original Transformer's FFN)."""

    @dataclass(frozen=True)
    class Config:
        pass

    fused_name = "relu"  # the gated product's fused kernel (zoo.components.kernels.glu)

    def __init__(self, cfg: Config = Config()):
        super().__init__()

    def forward(self, x):
        return F.relu(x)


@register("activation", "relu2")
class ReLU2(Activation):
    """Squared ReLU, ``relu(x) ** 2`` (So et al. 2021, Primer; Nemotron). transformers calls it ``relu2``."""

    @dataclass(frozen=True)
    class Config:
        pass

    hf_names = {"relu2": {}}

    def __init__(self, cfg: Config = Config()):
        super().__init__()

    def forward(self, x):
        return F.relu(x).square()


@register("activation", "gelu")
class GeLU(Activation):
    """GeLU, exact (``x * Phi(x)``) or with the tanh approximation (GPT-2, Gemma)."""

    @dataclass(frozen=True)
    class Config:
        approximate: Literal["none", "tanh"] = "none"

    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.approximate = cfg.approximate
        self.fused_name = "gelu_tanh" if cfg.approximate == "tanh" else "gelu"

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)


@register("activation", "silu")
class SiLU(Activation):
    """``x * sigmoid(x)`` (Swish with beta 1)."""

    @dataclass(frozen=True)
    class Config:
        pass

    fused_name = "silu"

    def __init__(self, cfg: Config = Config()):
        super().__init__()

    def forward(self, x):
        return F.silu(x)
