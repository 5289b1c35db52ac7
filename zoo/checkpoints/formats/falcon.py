"""falcon: parallel attention and MLP. Three layouts of the fused QKV, chosen by the config:
multi-query (7B: all query heads, then one k and one v head), the new decoder architecture
(40B/180B: per kv group, its query heads then k then v; two LayerNorms) and plain multi-head
(q, k, v interleaved head by head)."""

from __future__ import annotations

from zoo.checkpoints.common import activation, activation_name, rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.format import CheckpointFormat, Fields
from zoo.checkpoints.formats._classic import aliases, layernorm
from zoo.checkpoints.maps import FUSED_QKV, FUSED_QKV_GROUPED, FUSED_QKV_PER_HEAD, ZOO_LAYER, ZOO_MIXER, linear, rule
from zoo.checkpoints.sizes import ffn_size
from zoo.core.spec import ModelSpec

H = "transformer.h.{i}."


class Falcon(CheckpointFormat):
    model_type, architecture = "falcon", "FalconForCausalLM"
    base_prefix = "transformer."
    ignore = ("lm_head.weight", "transformer.h.*.self_attention.rotary_emb.inv_freq")
    tiny = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_kv_heads": 2, "new_decoder_architecture": True, "multi_query": False, "parallel_attn": True,
            "bias": True, "ffn_hidden_size": 96, "max_position_embeddings": 64, "alibi": False}

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
        f = Fields(aliases(config, {"n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
                                    "n_embed": "hidden_size", "n_head_kv": "num_kv_heads"}), self.model_type)
        d, n_heads = f.require("hidden_size"), f.require("num_attention_heads")
        f.expect("alibi", False, "zoo has no ALiBi checkpoint support for falcon (use a RoPE falcon)")
        f.expect("apply_residual_connection_post_layernorm", False, "the residual is taken before the norm")
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
        if not parallel:
            block = {"name": "serial", "norm_position": "pre"}
        else:
            block = {"name": "parallel", "shared_norm": not (new and n_ln == 2)}
        norm = layernorm(f, "layer_norm_epsilon")
        bias = f.get("bias", False)
        max_pos = f.get("max_position_embeddings", 2048)
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": f.require("num_hidden_layers"),
            "max_seq_len": max_pos, "position": rope_part(f, rope_parameters(f), max_pos=max_pos),
            "layers": {"default": {
                "mixer": {"name": "attention", "n_heads": n_heads, "n_kv_heads": n_kv, "bias": bias,
                              "out_bias": bias},
                "ffn": {"name": "mlp", "d_ff": f.get("ffn_hidden_size", 4 * d), "bias": bias,
                        "activation": activation(f, "activation", "gelu")},
                "norm": norm, "block": block,
            }},
            "final_norm": norm, "head": {"tied": f.get("tie_word_embeddings", True)},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att = layer.mixer
        n_kv = att.n_kv_heads or att.n_heads
        layout = self.layout(spec)
        parallel = layer.block.name == "parallel"
        cfg = {
            "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
            "num_attention_heads": att.n_heads, "num_kv_heads": n_kv, "alibi": False,
            "new_decoder_architecture": layout == "new", "multi_query": layout == "multi_query",
            "parallel_attn": parallel, "bias": att.bias, "ffn_hidden_size": ffn_size(spec),
            "max_position_embeddings": spec.max_seq_len, "layer_norm_epsilon": layer.norm.eps,
            "activation": activation_name(layer.ffn.activation), "tie_word_embeddings": spec.head.tied,
            "rope_parameters": rope_to_hf(spec.position, spec.d_model // att.n_heads),
        }
        if layout == "new":
            cfg["num_ln_in_parallel_attn"] = 1 if layer.block.shared_norm else 2
        if layout == "new" and not parallel:
            raise ValueError("falcon's grouped-query layout needs a parallel block")
        return cfg


FORMATS = [Falcon()]
