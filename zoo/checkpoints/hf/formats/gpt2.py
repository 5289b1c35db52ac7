"""gpt2: the GPT-2/3 block (pre-norm LayerNorm, GeLU MLP, learned positions, tied head). Its
projections are Conv1D, stored (in, out): the map transposes them, and splits the fused c_attn."""

from __future__ import annotations

from zoo.checkpoints.hf.fields import Field, FieldTable, TableFormat, expect
from zoo.checkpoints.hf.formats._classic import LAYERNORM_TEMPLATE, layernorm_eps
from zoo.checkpoints.hf.formats.llama import activation_field
from zoo.checkpoints.hf.maps import FUSED_QKV, TRANSPOSE, ZOO_LAYER, ZOO_MIXER, compose, linear, rule
from zoo.checkpoints.hf.sizes import ffn_size

H = "transformer.h.{i}."

FIELDS = FieldTable([
    Field("n_embd", "d_model"),
    Field("n_head", "layer.mixer.n_heads"),
    expect("add_cross_attention", False, "zoo builds decoder-only models"),
    expect("scale_attn_by_inverse_layer_idx", False, "zoo's attention has no per-layer score scale"),
    Field("reorder_and_upcast_attn", None, None, bool),  # numerics only: zoo computes softmax in fp32 anyway
    Field("n_ctx", None, None, int),  # an old name of n_positions
    # unscaled scores are a scale_dim of 1; scaled ones the default (head_dim)
    Field("scale_attn_weights", "layer.mixer.scale_dim", True, to_spec=lambda scaled: None if scaled else 1.0,
          to_hf=lambda scale_dim: scale_dim is None),
    layernorm_eps("layer_norm_epsilon"),
    Field("vocab_size", "vocab_size"),
    Field("n_layer", "n_layers"),
    Field("n_positions", "max_seq_len", 1024),
    Field("n_inner", "layer.ffn.d_ff", lambda v: 4 * v["n_embd"], source=ffn_size),
    activation_field("activation_function", "gelu_new"),
    Field("tie_word_embeddings", "head.tied", True),
])


class GPT2(TableFormat):
    model_type, architecture = "gpt2", "GPT2LMHeadModel"
    base_prefix = "transformer."
    ignore = ("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "lm_head.weight")
    tiny = {"vocab_size": 128, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64, "n_inner": 96}
    fields = FIELDS
    template = {**LAYERNORM_TEMPLATE, "position": {"name": "learned"},
                "layer": {**LAYERNORM_TEMPLATE["layer"], "mixer": {"name": "attention", "bias": True, "out_bias": True},
                          "ffn": {"name": "mlp", "bias": True}, "block": {"name": "serial", "norm_position": "pre"}}}

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
            *linear(f"{H}ln_1", f"{ZOO_LAYER}attn_norm"),
            *linear(f"{H}ln_2", f"{ZOO_LAYER}ffn_norm"),
            *linear("transformer.ln_f", "final_norm"),
            rule("lm_head.weight", "lm_head.weight"),
        ]

    def spec_to_config(self, spec):
        att = spec.layer(0).mixer
        if att.scale_dim not in (None, 1.0) or att.head_dim not in (None, spec.d_model // att.n_heads):
            raise ValueError("gpt2's heads are d_model / n_heads wide and scaled by their width (or not at all)")
        return super().spec_to_config(spec)


FORMATS = [GPT2()]
