"""gptj: a parallel block with one shared LayerNorm, partial rotary on interleaved pairs, and an
LM head with a bias."""

from __future__ import annotations

from zoo.checkpoints.hf.fields import Field, FieldTable, TableFormat, expect
from zoo.checkpoints.hf.formats._classic import LAYERNORM_TEMPLATE, layernorm_eps
from zoo.checkpoints.hf.formats.llama import activation_field
from zoo.checkpoints.hf.maps import ZOO_LAYER, ZOO_MIXER, linear, rule
from zoo.checkpoints.hf.sizes import ffn_size

H = "transformer.h.{i}."


def _rotary_dim(spec):
    pos, att = spec.position, spec.layer(0).mixer
    return pos.rotary_dim if pos.rotary_dim is not None else int(spec.d_model // att.n_heads * pos.rotary_fraction)


FIELDS = FieldTable([
    Field("n_embd", "d_model"),
    Field("n_head", "layer.mixer.n_heads"),
    # null: the whole head (GPTJConfig's default for an absent field is 64, in ``defaults``)
    Field("rotary_dim", "position.rotary_dim", lambda v: v["n_embd"] // v["n_head"], source=_rotary_dim),
    expect("rotary", True, "GPT-J checkpoints use rotary positions"),
    expect("scale_attn_weights", True, "GPT-J scales scores by head_dim ** -0.5"),
    layernorm_eps("layer_norm_epsilon"),
    Field("vocab_size", "vocab_size"),
    Field("n_layer", "n_layers"),
    Field("n_positions", "max_seq_len", 2048),
    Field("n_inner", "layer.ffn.d_ff", lambda v: 4 * v["n_embd"], source=ffn_size),
    activation_field("activation_function", "gelu_new"),
    Field("tie_word_embeddings", "head.tied", False),
])


class GPTJ(TableFormat):
    model_type, architecture = "gptj", "GPTJForCausalLM"
    base_prefix = "transformer."
    ignore = ("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "transformer.h.*.attn.embed_positions")
    tiny = {"vocab_size": 128, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64, "rotary_dim": 8,
            "n_inner": 96}
    defaults = {"rotary_dim": 64}  # GPTJConfig's, for a config without the field
    fields = FIELDS
    template = {**LAYERNORM_TEMPLATE, "position": {"name": "rope", "theta": 10000.0, "layout": "interleaved"},
                "layer": {**LAYERNORM_TEMPLATE["layer"], "mixer": {"name": "attention"},
                          "ffn": {"name": "mlp", "bias": True}, "block": {"name": "parallel", "shared_norm": True}},
                "head": {"bias": True}}

    def rules(self, spec):
        return [
            rule("transformer.wte.weight", "embed.weight"),
            *[rule(f"{H}attn.{p}_proj.weight", f"{ZOO_MIXER}{p}_proj.weight") for p in "qkv"],
            rule(f"{H}attn.out_proj.weight", f"{ZOO_MIXER}o_proj.weight"),
            *linear(f"{H}mlp.fc_in", f"{ZOO_LAYER}ffn.up"),
            *linear(f"{H}mlp.fc_out", f"{ZOO_LAYER}ffn.down"),
            *linear(f"{H}ln_1", f"{ZOO_LAYER}attn_norm"),
            *linear("transformer.ln_f", "final_norm"),
            rule("lm_head.weight", "lm_head.weight"),
            rule("lm_head.bias", "lm_head.bias"),
            rule("lm_head.bias", "head_bias"),  # a tied head keeps its own bias
        ]


FORMATS = [GPTJ()]
