"""A plugin written against zoo 0.2's block API, loaded as a user's plugin is
(``zoo.load_plugin("own_block_plugin")``): its own block stores the token mixer as ``self.attention``,
as zoo 0.2's blocks did (zoo's own blocks now say ``mixer``), so its model's parameters are
``layers.{i}.attention.*``, and its checkpoint format names them so. zoo renames zoo 0.1's
``layers.{i}.attention.*`` to ``layers.{i}.mixer.*`` only where the model has the new name: this
plugin's checkpoints keep loading and saving, with no deprecation warning (it uses no deprecated name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import zoo
from zoo.checkpoints.hf.format import CheckpointFormat, Fields
from zoo.checkpoints.hf.maps import linear, rule
from zoo.core.kinds import Block
from zoo.core.spec import ModelSpec


class GatedResidual(Block):
    """Pre-norm, with a learned per-channel gate on the mixer's branch:
    ``h = x + g * attention(N(x)); y = h + ffn(N(h))``."""

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__()
        d = spec.d_model
        self.attention = layer.mixer.build(d_model=d, layer=layer, spec=spec, index=index)
        self.ffn = layer.ffn.build(d_model=d)
        self.attn_norm = layer.norm.build(dim=d)
        self.ffn_norm = layer.norm.build(dim=d)
        self.gate = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.constant_(self.gate, 0.5)

    def forward(self, x, ctx, pos):
        h = x + self.gate * self.attention(self.attn_norm(x), ctx, pos)
        return h + self.ffn(self.ffn_norm(h), ctx)


H, Z = "model.layers.{i}.", "layers.{i}."


class OwnBlock(CheckpointFormat):
    """``own-block``: Llama-like layers in :class:`GatedResidual` blocks; the zoo side of the map names
    the model's own ``layers.{i}.attention.*``."""

    model_type, architecture = "own-block", "OwnBlockForCausalLM"
    tiny = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 48}

    def rules(self, spec):
        return [
            rule("model.embed_tokens.weight", "embed.weight"),
            *[r for p in "qkvo" for r in linear(f"{H}self_attn.{p}_proj", f"{Z}attention.{p}_proj", weights=("weight",))],
            rule(f"{H}gate", f"{Z}gate"),
            *[rule(f"{H}mlp.{p}_proj.weight", f"{Z}ffn.{p}.weight") for p in ("gate", "up", "down")],
            rule(f"{H}input_layernorm.weight", f"{Z}attn_norm.weight"),
            rule(f"{H}post_attention_layernorm.weight", f"{Z}ffn_norm.weight"),
            rule("model.norm.weight", "final_norm.weight"),
            rule("lm_head.weight", "lm_head.weight"),
        ]

    def config_to_spec(self, config, *, strict=True):
        f = Fields(config, self.model_type)
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": f.require("hidden_size"),
            "n_layers": f.require("num_hidden_layers"), "max_seq_len": 64, "position": "rope", "final_norm": "rmsnorm",
            "layers": {"default": {
                "block": "gated_residual", "norm": "rmsnorm",
                "mixer": {"name": "attention", "n_heads": f.require("num_attention_heads"),
                          "n_kv_heads": f.require("num_key_value_heads")},
                "ffn": {"name": "glu", "d_ff": f.require("intermediate_size"), "activation": "silu"},
            }},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        return {"vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
                "num_attention_heads": layer.mixer.n_heads, "num_key_value_heads": layer.mixer.n_kv_heads,
                "intermediate_size": layer.ffn.d_ff}


@zoo.hookimpl
def zoo_register(registry):
    registry.add_block("gated_residual", GatedResidual)
    registry.add_checkpoint_format("own-block", OwnBlock())

