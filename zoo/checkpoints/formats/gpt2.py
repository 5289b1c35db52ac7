"""gpt2: the GPT-2/3 block (pre-norm LayerNorm, GeLU MLP, learned positions, tied head). Its
projections are Conv1D, stored (in, out): the map transposes them, and splits the fused c_attn."""

from __future__ import annotations

from zoo.checkpoints.common import activation, activation_name
from zoo.checkpoints.format import CheckpointFormat, Fields
from zoo.checkpoints.formats._classic import layernorm, linear_rules
from zoo.checkpoints.maps import FUSED_QKV, TRANSPOSE, ZOO_LAYER, ZOO_MIXER, compose, rule
from zoo.checkpoints.sizes import ffn_size
from zoo.core.spec import ModelSpec

H = "transformer.h.{i}."


class GPT2(CheckpointFormat):
    model_type, architecture = "gpt2", "GPT2LMHeadModel"
    base_prefix = "transformer."
    ignore = ("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "lm_head.weight")
    tiny = {"vocab_size": 128, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64, "n_inner": 96}

    def rules(self, spec):
        return [
            rule("transformer.wte.weight", "embed.weight"),
            rule("transformer.wpe.weight", "positions.0.table.weight"),
            rule(f"{H}attn.c_attn.weight", [f"{ZOO_MIXER}{p}_proj.weight" for p in "qkv"], compose(TRANSPOSE, FUSED_QKV)),
            rule(f"{H}attn.c_attn.bias", [f"{ZOO_MIXER}{p}_proj.bias" for p in "qkv"], FUSED_QKV),
            rule(f"{H}attn.c_proj.weight", f"{ZOO_MIXER}o_proj.weight", TRANSPOSE),
            rule(f"{H}attn.c_proj.bias", f"{ZOO_MIXER}o_proj.bias"),
            rule(f"{H}mlp.c_fc.weight", f"{ZOO_LAYER}ffn.up.weight", TRANSPOSE),
            rule(f"{H}mlp.c_fc.bias", f"{ZOO_LAYER}ffn.up.bias"),
            rule(f"{H}mlp.c_proj.weight", f"{ZOO_LAYER}ffn.down.weight", TRANSPOSE),
            rule(f"{H}mlp.c_proj.bias", f"{ZOO_LAYER}ffn.down.bias"),
            *linear_rules(f"{H}ln_1", f"{ZOO_LAYER}attn_norm"),
            *linear_rules(f"{H}ln_2", f"{ZOO_LAYER}ffn_norm"),
            *linear_rules("transformer.ln_f", "final_norm"),
            rule("lm_head.weight", "lm_head.weight"),
        ]

    def config_to_spec(self, config, *, strict=False):
        f = Fields(config, self.model_type)
        d, n_heads = f.require("n_embd"), f.require("n_head")
        f.expect("add_cross_attention", False, "zoo builds decoder-only models")
        f.expect("scale_attn_by_inverse_layer_idx", False, "zoo's attention has no per-layer score scale")
        f.get("reorder_and_upcast_attn", kind=bool)  # numerics only: zoo computes softmax in fp32 anyway
        f.get("n_ctx", kind=int)  # an old name of n_positions
        scaled = f.get("scale_attn_weights", True)
        norm = layernorm(f, "layer_norm_epsilon")
        attention = {"name": "attention", "n_heads": n_heads, "bias": True, "out_bias": True}
        if not scaled:
            attention["scale_dim"] = 1.0
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": f.require("n_layer"),
            "max_seq_len": f.get("n_positions", 1024), "position": {"name": "learned"},
            "layers": {"default": {
                "attention": attention,
                "ffn": {"name": "mlp", "d_ff": f.get("n_inner", 4 * d), "bias": True,
                        "activation": activation(f, "activation_function", "gelu_new")},
                "norm": norm, "block": {"name": "serial", "norm_position": "pre"},
            }},
            "final_norm": norm, "head": {"tied": f.get("tie_word_embeddings", True)},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att = layer.mixer
        if att.scale_dim not in (None, 1.0) or att.head_dim not in (None, spec.d_model // att.n_heads):
            raise ValueError("gpt2's heads are d_model / n_heads wide and scaled by their width (or not at all)")
        return {
            "vocab_size": spec.vocab_size, "n_embd": spec.d_model, "n_layer": spec.n_layers, "n_head": att.n_heads,
            "n_positions": spec.max_seq_len, "n_inner": ffn_size(spec), "layer_norm_epsilon": layer.norm.eps,
            "activation_function": activation_name(layer.ffn.activation), "scale_attn_weights": att.scale_dim is None,
            "tie_word_embeddings": spec.head.tied,
        }


FORMATS = [GPT2()]
