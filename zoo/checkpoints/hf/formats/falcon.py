"""falcon: parallel attention and MLP. Three layouts of the fused QKV, chosen by the config:
multi-query (7B: all query heads, then one k and one v head), the new decoder architecture
(40B/180B: per kv group, its query heads then k then v; two LayerNorms) and plain multi-head
(q, k, v interleaved head by head)."""

from __future__ import annotations

from zoo.checkpoints.hf.common import rope_to_hf
from zoo.checkpoints.hf.fields import Field, FieldTable, TableFormat
from zoo.checkpoints.hf.formats._classic import LAYERNORM_TEMPLATE, aliases, layernorm_eps
from zoo.checkpoints.hf.formats.llama import Ropes, activation_field
from zoo.checkpoints.hf.maps import FUSED_QKV, FUSED_QKV_GROUPED, FUSED_QKV_PER_HEAD, ZOO_LAYER, ZOO_MIXER, linear, rule
from zoo.checkpoints.hf.sizes import ffn_size

H = "transformer.h.{i}."

#: What a falcon config states one-to-one; the layout fields (``new_decoder_architecture``,
#: ``multi_query``, ``parallel_attn``, ``num_kv_heads``, ``num_ln_in_parallel_attn``) decide the
#: heads and the block together, in :meth:`Falcon.complete`.
FIELDS = FieldTable([
    Field("vocab_size", "vocab_size"),
    Field("hidden_size", "d_model"),
    Field("num_hidden_layers", "n_layers"),
    Field("num_attention_heads", "layer.mixer.n_heads"),
    Field("bias", ("layer.mixer.bias", "layer.mixer.out_bias", "layer.ffn.bias"), False),
    Field("ffn_hidden_size", "layer.ffn.d_ff", lambda v: 4 * v["hidden_size"], source=ffn_size),
    Field("max_position_embeddings", "max_seq_len", 2048),
    layernorm_eps("layer_norm_epsilon"),
    activation_field("activation", "gelu"),
    Field("tie_word_embeddings", "head.tied", True),
])
OLD_NAMES = {"n_head": "num_attention_heads", "n_layer": "num_hidden_layers", "n_embed": "hidden_size",
             "n_head_kv": "num_kv_heads"}


class Falcon(TableFormat):
    model_type, architecture = "falcon", "FalconForCausalLM"
    base_prefix = "transformer."
    ignore = ("lm_head.weight", "transformer.h.*.self_attention.rotary_emb.inv_freq")
    tiny = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_kv_heads": 2, "new_decoder_architecture": True, "multi_query": False, "parallel_attn": True,
            "bias": True, "ffn_hidden_size": 96, "max_position_embeddings": 64, "alibi": False}
    fields = FIELDS
    template = {**LAYERNORM_TEMPLATE, "layer": {**LAYERNORM_TEMPLATE["layer"], "mixer": {"name": "attention"},
                                                "ffn": {"name": "mlp"}}}
    ropes = Ropes()

    @staticmethod
    def layout(spec):
        layer = spec.layer(0)
        n_heads = layer.mixer.n_heads
        n_kv = layer.mixer.n_kv_heads or n_heads
        block = layer.block
        if block.name == "parallel" and not block.shared_norm or n_kv not in (1, n_heads):
            return "new"
        return "multi_query" if n_kv == 1 and n_heads > 1 else "per_head"

    def rules(self, spec):
        qkv = {"new": FUSED_QKV_GROUPED, "multi_query": FUSED_QKV, "per_head": FUSED_QKV_PER_HEAD}[self.layout(spec)]
        layer = spec.layer(0)
        if layer.block.name == "parallel" and not layer.block.shared_norm:
            norms = {"ln_attn": "attn_norm", "ln_mlp": "ffn_norm"}
        else:
            norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
        rules = [rule("transformer.word_embeddings.weight", "embed.weight")]
        rules += [rule(f"{H}self_attention.query_key_value.{w}", [f"{ZOO_MIXER}{p}_proj.{w}" for p in "qkv"], qkv)
                  for w in ("weight", "bias")]
        rules += linear(f"{H}self_attention.dense", f"{ZOO_MIXER}o_proj")
        rules += linear(f"{H}mlp.dense_h_to_4h", f"{ZOO_LAYER}ffn.up")
        rules += linear(f"{H}mlp.dense_4h_to_h", f"{ZOO_LAYER}ffn.down")
        for hf, zoo in norms.items():
            rules += linear(f"{H}{hf}", f"{ZOO_LAYER}{zoo}")
        rules += linear("transformer.ln_f", "final_norm")
        return rules + [rule("lm_head.weight", "lm_head.weight")]

    def config_to_spec(self, config, *, strict=False):
        return super().config_to_spec(aliases(config, OLD_NAMES), strict=strict)

    def complete(self, f, data):
        f.expect("alibi", False, "zoo has no ALiBi checkpoint support for falcon (use a RoPE falcon)")
        f.expect("apply_residual_connection_post_layernorm", False, "the residual is taken before the norm")
        layer = data["layer"]
        n_heads = layer["mixer"]["n_heads"]
        new = f.get("new_decoder_architecture", False)
        multi_query = f.get("multi_query", True)
        parallel = f.get("parallel_attn", True)
        if new and not parallel:
            raise f.error("parallel_attn", "false together with new_decoder_architecture is not a working falcon")
        n_ln = f.get("num_ln_in_parallel_attn", 2 if new else 1)
        if new:
            n_kv = f.get("num_kv_heads", n_heads)
        elif multi_query:
            f.get("num_kv_heads", kind=int)  # unused by this layout: one k and one v head
            n_kv = 1
        else:
            n_kv = f.expect("num_kv_heads", (n_heads,), "without multi_query every head has its own k and v")
        layer["mixer"]["n_kv_heads"] = n_kv
        layer["block"] = ({"name": "parallel", "shared_norm": not (new and n_ln == 2)} if parallel
                          else {"name": "serial", "norm_position": "pre"})
        super().complete(f, data)
        data["position"] = self.ropes.read(f, None, data["max_seq_len"])

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att = layer.mixer
        layout = self.layout(spec)
        parallel = layer.block.name == "parallel"
        if layout == "new" and not parallel:
            raise ValueError("falcon's grouped-query layout needs a parallel block")
        cfg = {**super().spec_to_config(spec), "num_kv_heads": att.n_kv_heads or att.n_heads, "alibi": False,
               "new_decoder_architecture": layout == "new", "multi_query": layout == "multi_query",
               "parallel_attn": parallel, "rope_parameters": rope_to_hf(spec.position, spec.d_model // att.n_heads)}
        if layout == "new":
            cfg["num_ln_in_parallel_attn"] = 1 if layer.block.shared_norm else 2
        return cfg


FORMATS = [Falcon()]
