"""A plugin written when zoo shipped no ``relu2``: it registers its own squared ReLU (a little
different from zoo's, so that a test can tell them apart), a family that uses it, and a checkpoint
format for a model_type zoo also reads. Loaded as a user's plugin is (``zoo.load_plugin``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import zoo
import zoo.testing
from zoo.core.spec import Family


class PluginReLU2(nn.Module):
    """``relu(x) ** 2 / 2``: the plugin's own squared ReLU, as it was written before zoo had one."""

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg=Config()):
        super().__init__()

    def forward(self, x):
        return torch.relu(x) ** 2 / 2


FAMILY = Family(
    name="relu2-plugin",
    base={**zoo.testing.TINY,
          "layers": {"default": {"mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2},
                                 "ffn": {"name": "mlp", "d_ff": 64, "activation": "relu2"}}}},
    presets={"relu2-plugin-tiny": {}},
)


@zoo.hookimpl
def zoo_register(registry):
    registry.add_activation("relu2", PluginReLU2)
    registry.add_family(FAMILY)
    llama = type(zoo.get("checkpoint_format", "llama"))
    registry.add_checkpoint_format("llama", type("PluginLlama", (llama,), {})())  # its own copy of a llama format
