"""The Hugging Face ``phi`` checkpoint format: config.json <-> spec, and one two-way weight-name map."""

from zoo.checkpoints.files.gguf import GGUFArch
from zoo.checkpoints.hf.common import activation, activation_name, rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.hf.format import CheckpointFormat, Fields
from zoo.checkpoints.hf.maps import ZOO_LAYER as Z, ZOO_MIXER as M, linear, rule
from zoo.checkpoints.hf.sizes import ffn_size
from zoo.core.spec import ModelSpec

H = "model.layers.{i}."


class Phi(CheckpointFormat):
    model_type, architecture = "phi", "PhiForCausalLM"
    ignore = ("model.rotary_emb.*",)
    # llama.cpp's phi2: its keys where they differ from the common ones; RoPE on part of each head.
    gguf = GGUFArch("phi2", "phi", keys={"attention.layer_norm_epsilon": "layer_norm_eps"}, partial_rotary=True)
    # Small enough to test, and reaching every path: QK LayerNorm, partial rotary, head bias.
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "max_position_embeddings": 64, "qk_layernorm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}

    def rules(self, spec):
        return [
            rule("model.embed_tokens.weight", "embed.weight"),
            *[r for p in "qkv" for r in linear(f"{H}self_attn.{p}_proj", f"{M}{p}_proj")],
            *linear(f"{H}self_attn.dense", f"{M}o_proj"),
            *linear(f"{H}self_attn.q_layernorm", f"{M}q_norm"),
            *linear(f"{H}self_attn.k_layernorm", f"{M}k_norm"),
            *linear(f"{H}mlp.fc1", f"{Z}ffn.up"),
            *linear(f"{H}mlp.fc2", f"{Z}ffn.down"),
            *linear(f"{H}input_layernorm", f"{Z}attn_norm"),
            *linear("model.final_layernorm", "final_norm"),
            *linear("lm_head", "lm_head"),
            rule("lm_head.bias", "head_bias"),  # a tied head keeps its own bias
        ]

    def config_to_spec(self, config, *, strict=False):
        f = Fields(config, self.model_type)
        d, n_heads = f.require("hidden_size"), f.require("num_attention_heads")
        norm = {"name": "layernorm", "eps": float(f.get("layer_norm_eps", 1e-5))}
        params = rope_parameters(f)
        params.setdefault("partial_rotary_factor", 0.5)  # PhiConfig's default
        max_pos = f.get("max_position_embeddings", 2048)
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": f.require("num_hidden_layers"),
            "max_seq_len": max_pos, "position": rope_part(f, params, max_pos=max_pos),
            "layers": {"default": {
                "mixer": {"name": "attention", "n_heads": n_heads, "n_kv_heads": f.get("num_key_value_heads", n_heads),
                          "bias": True, "out_bias": True, "qk_norm": "head" if f.get("qk_layernorm", False) else "none"},
                "ffn": {"name": "mlp", "d_ff": f.require("intermediate_size"), "bias": True,
                        "activation": activation(f, "hidden_act", "gelu_new")},
                "norm": norm, "block": {"name": "parallel", "shared_norm": True},
            }},
            "final_norm": norm, "head": {"tied": f.get("tie_word_embeddings", False), "bias": True},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att = layer.mixer
        if layer.block.name != "parallel" or not layer.block.shared_norm or layer.norm.name != "layernorm":
            raise ValueError("phi needs a parallel block with one shared LayerNorm")
        return {
            "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
            "num_attention_heads": att.n_heads, "num_key_value_heads": att.n_kv_heads or att.n_heads,
            "intermediate_size": ffn_size(spec), "max_position_embeddings": spec.max_seq_len,
            "layer_norm_eps": layer.norm.eps, "hidden_act": activation_name(layer.ffn.activation),
            "qk_layernorm": att.qk_norm == "head", "tie_word_embeddings": spec.head.tied,
            "rope_parameters": rope_to_hf(spec.position, spec.d_model // att.n_heads),
        }
