"""gpt_neox (Pythia, GPT-NeoX-20B): parallel residual with two LayerNorms (or serial), partial
rotary, and a fused QKV interleaved head by head."""

from __future__ import annotations

from zoo.checkpoints.hf.common import rope_to_hf
from zoo.checkpoints.hf.fields import Field, FieldTable, TableFormat
from zoo.checkpoints.hf.formats._classic import LAYERNORM_TEMPLATE, aliases, layernorm_eps
from zoo.checkpoints.hf.formats.llama import Ropes, activation_field
from zoo.checkpoints.hf.maps import FUSED_QKV_PER_HEAD, ZOO_LAYER, ZOO_MIXER, linear, rule
from zoo.checkpoints.hf.sizes import ffn_size

H = "gpt_neox.layers.{i}."
PARALLEL, SERIAL = {"name": "parallel", "shared_norm": False}, {"name": "serial", "norm_position": "pre"}

FIELDS = FieldTable([
    Field("hidden_size", "d_model"),
    Field("num_attention_heads", "layer.mixer.n_heads"),
    Field("is_decoder", None, None, bool),
    layernorm_eps("layer_norm_eps"),
    Field("attention_bias", ("layer.mixer.bias", "layer.mixer.out_bias"), True),
    Field("max_position_embeddings", "max_seq_len", 2048),
    Field("use_parallel_residual", "layer.block", True, to_spec=lambda p: dict(PARALLEL if p else SERIAL),
          to_hf=lambda block: block.name == "parallel"),
    Field("vocab_size", "vocab_size"),
    Field("num_hidden_layers", "n_layers"),
    Field("intermediate_size", "layer.ffn.d_ff", source=ffn_size),
    activation_field("hidden_act", "gelu"),
    Field("tie_word_embeddings", "head.tied", False),
])


class GPTNeoX(TableFormat):
    model_type, architecture = "gpt_neox", "GPTNeoXForCausalLM"
    base_prefix = "gpt_neox."
    ignore = ("gpt_neox.layers.*.attention.bias", "gpt_neox.layers.*.attention.masked_bias",
              "gpt_neox.layers.*.attention.rotary_emb.inv_freq", "gpt_neox.rotary_emb.*")
    tiny = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "intermediate_size": 96, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    fields = FIELDS
    template = {**LAYERNORM_TEMPLATE, "layer": {**LAYERNORM_TEMPLATE["layer"], "mixer": {"name": "attention"},
                                                "ffn": {"name": "mlp", "bias": True}}}
    ropes = Ropes(partial_rotary_factor=0.25)  # GPT-NeoX's default

    def rules(self, spec):
        return [
            rule("gpt_neox.embed_in.weight", "embed.weight"),
            *[rule(f"{H}attention.query_key_value.{w}", [f"{ZOO_MIXER}{p}_proj.{w}" for p in "qkv"],
                   FUSED_QKV_PER_HEAD) for w in ("weight", "bias")],
            *linear(f"{H}attention.dense", f"{ZOO_MIXER}o_proj"),
            *linear(f"{H}mlp.dense_h_to_4h", f"{ZOO_LAYER}ffn.up"),
            *linear(f"{H}mlp.dense_4h_to_h", f"{ZOO_LAYER}ffn.down"),
            *linear(f"{H}input_layernorm", f"{ZOO_LAYER}attn_norm"),
            *linear(f"{H}post_attention_layernorm", f"{ZOO_LAYER}ffn_norm"),
            *linear("gpt_neox.final_layer_norm", "final_norm"),
            rule("embed_out.weight", "lm_head.weight"),
        ]

    def config_to_spec(self, config, *, strict=False):
        return super().config_to_spec(aliases(config, {"rotary_pct": "partial_rotary_factor",
                                                       "rotary_emb_base": "rope_theta"}), strict=strict)

    def complete(self, f, data):
        super().complete(f, data)
        data["position"] = self.ropes.read(f, None, data["max_seq_len"])

    def spec_to_config(self, spec):
        cfg = super().spec_to_config(spec)
        cfg["rope_parameters"] = rope_to_hf(spec.position, spec.d_model // spec.layer(0).mixer.n_heads)
        return cfg


FORMATS = [GPTNeoX()]
