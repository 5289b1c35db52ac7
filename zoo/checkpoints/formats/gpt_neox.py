"""gpt_neox (Pythia, GPT-NeoX-20B): parallel residual with two LayerNorms (or serial), partial
rotary, and a fused QKV interleaved head by head."""

from __future__ import annotations

from zoo.checkpoints.common import activation, activation_name, rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.format import CheckpointFormat, Fields
from zoo.checkpoints.formats._classic import aliases, layernorm, linear_rules
from zoo.checkpoints.maps import FUSED_QKV_PER_HEAD, ZOO_LAYER, ZOO_MIXER, rule
from zoo.checkpoints.sizes import ffn_size
from zoo.core.spec import ModelSpec

H = "gpt_neox.layers.{i}."


class GPTNeoX(CheckpointFormat):
    model_type, architecture = "gpt_neox", "GPTNeoXForCausalLM"
    base_prefix = "gpt_neox."
    ignore = ("gpt_neox.layers.*.attention.bias", "gpt_neox.layers.*.attention.masked_bias",
              "gpt_neox.layers.*.attention.rotary_emb.inv_freq", "gpt_neox.rotary_emb.*")
    tiny = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "intermediate_size": 96, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}

    def rules(self, spec):
        return [
            rule("gpt_neox.embed_in.weight", "embed.weight"),
            *[rule(f"{H}attention.query_key_value.{w}", [f"{ZOO_MIXER}{p}_proj.{w}" for p in "qkv"],
                   FUSED_QKV_PER_HEAD) for w in ("weight", "bias")],
            *linear_rules(f"{H}attention.dense", f"{ZOO_MIXER}o_proj"),
            *linear_rules(f"{H}mlp.dense_h_to_4h", f"{ZOO_LAYER}ffn.up"),
            *linear_rules(f"{H}mlp.dense_4h_to_h", f"{ZOO_LAYER}ffn.down"),
            *linear_rules(f"{H}input_layernorm", f"{ZOO_LAYER}attn_norm"),
            *linear_rules(f"{H}post_attention_layernorm", f"{ZOO_LAYER}ffn_norm"),
            *linear_rules("gpt_neox.final_layer_norm", "final_norm"),
            rule("embed_out.weight", "lm_head.weight"),
        ]

    def config_to_spec(self, config, *, strict=False):
        f = Fields(aliases(config, {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}),
                   self.model_type)
        d, n_heads = f.require("hidden_size"), f.require("num_attention_heads")
        f.get("is_decoder", kind=bool)
        norm = layernorm(f, "layer_norm_eps")
        bias = f.get("attention_bias", True)
        params = rope_parameters(f)
        params.setdefault("partial_rotary_factor", 0.25)  # GPT-NeoX's default
        max_pos = f.get("max_position_embeddings", 2048)
        block = ({"name": "parallel", "shared_norm": False} if f.get("use_parallel_residual", True)
                 else {"name": "serial", "norm_position": "pre"})
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": f.require("num_hidden_layers"),
            "max_seq_len": max_pos, "position": rope_part(f, params, max_pos=max_pos),
            "layers": {"default": {
                "mixer": {"name": "attention", "n_heads": n_heads, "bias": bias, "out_bias": bias},
                "ffn": {"name": "mlp", "d_ff": f.require("intermediate_size"), "bias": True,
                        "activation": activation(f, "hidden_act", "gelu")},
                "norm": norm, "block": block,
            }},
            "final_norm": norm, "head": {"tied": f.get("tie_word_embeddings", False)},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att = layer.mixer
        return {
            "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
            "num_attention_heads": att.n_heads, "intermediate_size": ffn_size(spec),
            "max_position_embeddings": spec.max_seq_len, "layer_norm_eps": layer.norm.eps,
            "hidden_act": activation_name(layer.ffn.activation), "attention_bias": att.bias,
            "use_parallel_residual": layer.block.name == "parallel", "tie_word_embeddings": spec.head.tied,
            "rope_parameters": rope_to_hf(spec.position, spec.d_model // att.n_heads),
        }


FORMATS = [GPTNeoX()]
