"""gptj: a parallel block with one shared LayerNorm, partial rotary on interleaved pairs, and an
LM head with a bias."""

from __future__ import annotations

from zoo.checkpoints.common import activation, activation_name
from zoo.checkpoints.format import CheckpointFormat, Fields
from zoo.checkpoints.formats._classic import layernorm, linear_rules
from zoo.checkpoints.maps import ZOO_LAYER, ZOO_MIXER, rule
from zoo.checkpoints.sizes import ffn_size
from zoo.core.spec import ModelSpec

H = "transformer.h.{i}."


class GPTJ(CheckpointFormat):
    model_type, architecture = "gptj", "GPTJForCausalLM"
    base_prefix = "transformer."
    ignore = ("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "transformer.h.*.attn.embed_positions")
    tiny = {"vocab_size": 128, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64, "rotary_dim": 8,
            "n_inner": 96}

    def rules(self, spec):
        return [
            rule("transformer.wte.weight", "embed.weight"),
            *[rule(f"{H}attn.{p}_proj.weight", f"{ZOO_MIXER}{p}_proj.weight") for p in "qkv"],
            rule(f"{H}attn.out_proj.weight", f"{ZOO_MIXER}o_proj.weight"),
            *linear_rules(f"{H}mlp.fc_in", f"{ZOO_LAYER}ffn.up"),
            *linear_rules(f"{H}mlp.fc_out", f"{ZOO_LAYER}ffn.down"),
            *linear_rules(f"{H}ln_1", f"{ZOO_LAYER}attn_norm"),
            *linear_rules("transformer.ln_f", "final_norm"),
            rule("lm_head.weight", "lm_head.weight"),
            rule("lm_head.bias", "lm_head.bias"),
            rule("lm_head.bias", "head_bias"),  # a tied head keeps its own bias
        ]

    defaults = {"rotary_dim": 64}  # GPTJConfig's, for a config without the field (null: the whole head)

    def config_to_spec(self, config, *, strict=False):
        f = Fields(config, self.model_type, self.defaults)
        d, n_heads = f.require("n_embd"), f.require("n_head")
        head_dim = d // n_heads
        rotary_dim = f.get("rotary_dim", head_dim)
        f.expect("rotary", True, "GPT-J checkpoints use rotary positions")
        f.expect("scale_attn_weights", True, "GPT-J scales scores by head_dim ** -0.5")
        norm = layernorm(f, "layer_norm_epsilon")
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": f.require("n_layer"),
            "max_seq_len": f.get("n_positions", 2048),
            "position": {"name": "rope", "theta": 10000.0, "layout": "interleaved", "rotary_dim": rotary_dim},
            "layers": {"default": {
                "mixer": {"name": "attention", "n_heads": n_heads},
                "ffn": {"name": "mlp", "d_ff": f.get("n_inner", 4 * d), "bias": True,
                        "activation": activation(f, "activation_function", "gelu_new")},
                "norm": norm, "block": {"name": "parallel", "shared_norm": True},
            }},
            "final_norm": norm, "head": {"tied": f.get("tie_word_embeddings", False), "bias": True},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att = layer.mixer
        pos = spec.position
        rd = pos.rotary_dim if pos.rotary_dim is not None else int(spec.d_model // att.n_heads * pos.rotary_fraction)
        return {
            "vocab_size": spec.vocab_size, "n_embd": spec.d_model, "n_layer": spec.n_layers, "n_head": att.n_heads,
            "n_positions": spec.max_seq_len, "rotary_dim": rd, "n_inner": ffn_size(spec),
            "layer_norm_epsilon": layer.norm.eps, "activation_function": activation_name(layer.ffn.activation),
            "tie_word_embeddings": spec.head.tied,
        }


FORMATS = [GPTJ()]
