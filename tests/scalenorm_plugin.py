"""A new part of an existing kind, in one file: ScaleNorm (Nguyen & Salazar 2019), the norm of
docs/guides/plugins.md, with its tensor-parallel plan as one dict. tests/train/test_a_new_part.py checks that
it passes the conformance suite and shards at tp = 2 as one process computes."""

from dataclasses import dataclass

import torch
from torch import nn

import zoo
from zoo.core.kinds import Norm


class ScaleNorm(Norm):
    """``g * x / ||x||``, one learned scalar."""

    @dataclass(frozen=True)
    class Config:
        eps: float = 1e-5

    def __init__(self, cfg: Config, *, dim: int):
        super().__init__()
        self.eps, self.dim = cfg.eps, dim
        self.g = nn.Parameter(torch.full((1,), dim ** 0.5))

    def reset_parameters(self):
        nn.init.constant_(self.g, self.dim ** 0.5)

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp(min=self.eps)

    # -- what this part states about itself ---------------------------------------------------------
    tp_plan = {"": "replicated"}  # g whole on every process; each normalises the rows it holds


@zoo.hookimpl
def zoo_register(registry):
    registry.add_norm("scalenorm_example", ScaleNorm)
