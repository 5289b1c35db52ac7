"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (the ``mla`` mixer) and DeepSeekMoE.

Every layer attends with MLA; its RoPE rotates only the decoupled ``qk_rope_head_dim`` part (V2
rotates interleaved pairs in place, V3 with ``rope_interleave`` rotates the pairs and writes them
half-split, as transformers does), and DeepSeek's YaRN multiplies the softmax scale by
``mscale(factor, mscale_all_dim)^2`` (zoo/components/positions/rope_scaling.py). The first
``first_k_dense_replace`` layers have a dense SwiGLU FFN, the rest an ``moe`` with
``n_shared_experts`` always-active experts (one shared FFN of ``n_shared_experts x
moe_intermediate_size``, ungated):

- V2 routes with ``topk_method``: ``greedy`` (softmax, top-k: ``softmax_topk``) or
  ``group_limited_greedy`` (``greedy_group``); the weights are scaled by ``routed_scaling_factor``
  and never renormalised (transformers' V2 ignores ``norm_topk_prob``);
- V3 routes with ``sigmoid_group``: sigmoid scores, the ``e_score_correction_bias`` buffer added to
  choose, groups scored by their two best, ``norm_topk_prob``, ``routed_scaling_factor``.

``moe_layer_freq`` is in the released files but not read by transformers, which makes every layer
from ``first_k_dense_replace`` on sparse; a value other than 1 would build another model than
DeepSeek's own code, so it is refused by name.
"""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.common import activation, activation_name, pattern, rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.hf.format import CheckpointFormat, Fields
from zoo.checkpoints.hf.maps import ZOO_LAYER, ZOO_MIXER, embed_and_head, gated_mlp, layer_norms, linear, rule, stacked_experts
from zoo.model.mtp import mtp_layer_kind
from zoo.checkpoints.hf.mtp import mtp_rules, read_mtp
from zoo.core.spec import ModelSpec

LAYER = "model.layers.{i}."
ATTENTION = {  # HF self_attn.* -> zoo mixer.*
    "q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b_proj",
    "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj",
}

TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 24,
    "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20, "n_routed_experts": 8,
    "num_experts_per_tok": 3, "n_shared_experts": 2, "first_k_dense_replace": 1, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                        "mscale_all_dim": 0.707, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                        "beta_slow": 1.0},
}


class DeepSeek(CheckpointFormat):
    """What V2 and V3 share; each says how it rotates and routes."""

    ignore = ("model.layers.*.self_attn.rotary_emb.inv_freq", "model.rotary_emb.*", "lm_head.weight")
    extra_fields: tuple[str, ...] = ()

    # -- the weight-name map ------------------------------------------------------------------
    def rules(self, spec):
        rules = [*embed_and_head(), *layer_norms(LAYER, {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"})]
        rules += self.attention_rules(spec)
        rules += gated_mlp(f"{LAYER}mlp.") + gated_mlp(f"{LAYER}mlp.shared_experts.", f"{ZOO_LAYER}ffn.shared.", ("weight",))
        moe = moe_part(spec)
        if moe is not None:
            rules.append(rule(f"{LAYER}mlp.gate.weight", f"{ZOO_LAYER}ffn.router.weight"))
            rules.append(rule(f"{LAYER}mlp.gate.e_score_correction_bias", f"{ZOO_LAYER}ffn.router.bias"))
            rules += stacked_experts(f"{LAYER}mlp.experts.", moe.n_experts)
        # The multi-token prediction modules (V3) as layers n_layers, n_layers + 1, ...
        return mtp_rules(rules, spec) + rules

    def attention_rules(self, spec) -> list:
        """The ``self_attn`` tensors: MLA's projections and norms."""
        return [r for hf, z in ATTENTION.items() for r in linear(f"{LAYER}self_attn.{hf}", f"{ZOO_MIXER}{z}")]

    # -- config -> spec -------------------------------------------------------------------------
    def rope_layout(self, f: Fields) -> str:
        raise NotImplementedError

    def router(self, f: Fields) -> dict[str, Any]:
        raise NotImplementedError

    def norm_topk(self, f: Fields) -> bool:
        raise NotImplementedError

    def config_to_spec(self, config, *, strict=False):
        f = Fields(config, self.model_type, self.defaults)
        d, n_heads, L = f.require("hidden_size"), f.require("num_attention_heads"), f.require("num_hidden_layers")
        max_pos = f.get("max_position_embeddings", 2048)
        mla, position = self.attention(f, d, n_heads, max_pos)
        act = activation(f, "hidden_act", "silu")
        expert = {"name": "swiglu"} if act == {"name": "silu"} else {"name": "glu", "activation": act}
        dense = {**expert, "d_ff": f.require("intermediate_size"), "bias": bool(f.get("mlp_bias", False))}
        f.expect("moe_layer_freq", (1,), "transformers makes every layer from first_k_dense_replace on sparse")
        first_dense = min(f.get("first_k_dense_replace", 0), L)
        shared = f.get("n_shared_experts", 0)
        width = f.require("moe_intermediate_size")
        moe = {"name": "moe", "n_experts": f.require("n_routed_experts"), "top_k": f.require("num_experts_per_tok"),
               "d_ff": width, "expert": expert, "router": self.router(f), "norm_topk_prob": self.norm_topk(f),
               "routed_scaling": float(f.get("routed_scaling_factor", 1.0)),
               "shared_d_ff": width * shared if shared else None}
        f.get("output_router_logits")  # transformers adds no balance loss for these models
        for key in self.extra_fields:
            f.get(key)
        norm = {"name": "rmsnorm", "eps": float(f.get("rms_norm_eps", 1e-6))}
        block = {"name": "serial", "norm_position": "pre"}
        kinds = ["dense"] * first_dense + ["moe"] * (L - first_dense)
        layers = {k: {"mixer": mla, "ffn": dense if k == "dense" else moe, "norm": norm, "block": block}
                  for k in dict.fromkeys(kinds)}
        spec = {"vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": L, "max_seq_len": max_pos,
                "layers": layers, "layer_pattern": list(pattern(kinds)), "position": position, "final_norm": norm,
                "head": {"tied": f.get("tie_word_embeddings", False)}}
        mtp = self.mtp(f, layers)
        if mtp:
            spec["mtp"] = mtp
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def attention(self, f: Fields, d: int, n_heads: int, max_pos: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every layer's mixer (MLA) and the position part."""
        n_kv = f.get("num_key_value_heads", n_heads)
        if n_kv != n_heads:
            raise f.error("num_key_value_heads", f"{n_kv} differs from num_attention_heads {n_heads}: MLA up-projects "
                                                 "a key and a value for every head (transformers fails on it too)")
        f.get("head_dim"), f.get("qk_head_dim")  # transformers derives both from the MLA widths
        mla = {"name": "mla", "n_heads": n_heads, "kv_lora_rank": f.require("kv_lora_rank"),
               "qk_nope_head_dim": f.require("qk_nope_head_dim"), "qk_rope_head_dim": f.require("qk_rope_head_dim"),
               "v_head_dim": f.require("v_head_dim"), "q_lora_rank": f.get("q_lora_rank", kind=int),
               "bias": f.get("attention_bias", False)}
        return mla, rope_part(f, rope_parameters(f), max_pos=max_pos, layout=self.rope_layout(f))

    # -- spec -> config -------------------------------------------------------------------------
    def attention_to_config(self, spec) -> dict[str, Any]:
        """The config fields of every layer's mixer (one MLA) and the position."""
        mixers = {repr(spec.layer(i).mixer) for i in range(spec.n_layers)}
        mla = spec.layer(0).mixer
        if mla.name != "mla" or len(mixers) > 1:
            raise ValueError(f"{self.model_type} has one multi-head latent attention ('mla') in every layer")
        if mla.decode != "absorbed" or mla.latent_norm.to_dict() != {"name": "rmsnorm", "eps": 1e-6,
                                                                      "unit_offset": False, "scale_in_fp32": False}:
            raise ValueError(f"{self.model_type}'s MLA has RMSNorm(eps 1e-6) latents and no other decode setting")
        return {"num_attention_heads": mla.n_heads, "num_key_value_heads": mla.n_heads,
                "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
                "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "attention_bias": mla.bias,
                "rope_parameters": rope_to_hf(spec.position, mla.qk_rope_head_dim)}

    def spec_to_config(self, spec):
        attention = self.attention_to_config(spec)
        sparse = [spec.layer(i).ffn.name == "moe" for i in range(spec.n_layers)]
        first_dense = sparse.index(True) if any(sparse) else spec.n_layers
        if any(not s for s in sparse[first_dense:]):
            raise ValueError(f"{self.model_type} has dense layers only before its first sparse layer")
        moe = moe_part(spec)
        dense = next((spec.layer(i).ffn for i in range(spec.n_layers) if not sparse[i]), None)
        if moe is None:
            raise ValueError(f"{self.model_type} needs sparse layers (ffn 'moe')")
        if len({repr(spec.layer(i).ffn) for i in range(spec.n_layers) if sparse[i]}) > 1:
            raise ValueError(f"{self.model_type} has one MoE configuration for every sparse layer")
        act = activation_name(moe.expert.activation)
        if moe.expert.name not in ("swiglu", "glu") or (dense is not None and (
                dense.name != moe.expert.name or activation_name(dense.activation) != act)):
            raise ValueError(f"{self.model_type}'s experts are the gated FFN of its dense layers")
        if moe.shared_gate or (moe.shared_d_ff is not None and moe.shared_d_ff % moe.d_ff):
            raise ValueError(f"{self.model_type}'s shared experts are ungated, a multiple of moe_intermediate_size wide")
        if any(getattr(moe, k) for k in ("switch_loss", "switch_pooled_loss", "sequence_loss", "device_loss", "z_loss")) \
                or moe.bias_update != "none" or moe.capacity_factor is not None:
            raise ValueError(f"{self.model_type} has no field for balance losses, bias updates or a capacity factor")
        norm = spec.layer(0).norm
        cfg: dict[str, Any] = {
            "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
            **attention,
            "intermediate_size": dense.d_ff if dense is not None else moe.d_ff,
            "moe_intermediate_size": moe.d_ff, "n_routed_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "n_shared_experts": (moe.shared_d_ff or 0) // moe.d_ff,
            "first_k_dense_replace": first_dense, "routed_scaling_factor": moe.routed_scaling,
            "hidden_act": act,
            "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": norm.eps,
            "tie_word_embeddings": spec.head.tied,
        }
        if dense is not None and dense.bias:
            cfg["mlp_bias"] = True
        self.router_to_config(cfg, moe, spec.position)
        return cfg

    def router_to_config(self, cfg, moe, position):
        raise NotImplementedError

    def mtp(self, f: Fields, layers: dict[str, Any]):
        """The spec's ``mtp`` table (V3 has multi-token prediction modules), or None."""
        return None


def moe_part(spec: ModelSpec):
    return next((spec.layer(i).ffn for i in range(spec.n_layers) if spec.layer(i).ffn.name == "moe"), None)


class DeepseekV2(DeepSeek):
    model_type, architecture = "deepseek_v2", "DeepseekV2ForCausalLM"
    # DeepseekV2Config's defaults for absent fields.
    defaults = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1407,
                "topk_method": "greedy", "max_position_embeddings": 2048}
    extra_fields = ("norm_topk_prob",)  # declared by DeepseekV2Config, not read by its model
    tiny = {**TINY, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 1.5}

    def rope_layout(self, f):
        return "interleaved"  # complex multiplication of (2i, 2i+1) pairs

    def router(self, f):
        method = f.get("topk_method", "greedy")
        groups = f.get("n_group", kind=int), f.get("topk_group", kind=int)
        if method == "greedy":
            return {"name": "softmax_topk"}
        if method == "group_limited_greedy":
            if None in groups:
                raise f.error("n_group" if groups[0] is None else "topk_group", "group_limited_greedy needs it")
            return {"name": "greedy_group", "n_groups": groups[0], "topk_group": groups[1]}
        raise f.error("topk_method", f"{method!r} is not supported: transformers' deepseek_v2 routes 'greedy' or "
                                     "'group_limited_greedy'")

    def norm_topk(self, f):
        return False

    def router_to_config(self, cfg, moe, position):
        if position.layout != "interleaved":
            raise ValueError("deepseek_v2 rotates interleaved pairs (RoPE layout 'interleaved')")
        if moe.norm_topk_prob:
            raise ValueError("deepseek_v2 never renormalises the routing weights (norm_topk_prob)")
        r = moe.router
        if r.name == "softmax_topk" and not r.selection_bias:
            cfg["topk_method"] = "greedy"
        elif r.name == "greedy_group" and not r.selection_bias:
            cfg.update(topk_method="group_limited_greedy", n_group=r.n_groups, topk_group=r.topk_group)
        else:
            raise ValueError("deepseek_v2 routes with 'softmax_topk' or 'greedy_group' (no selection bias)")


class DeepseekV3(DeepSeek):
    model_type, architecture = "deepseek_v3", "DeepseekV3ForCausalLM"
    # DeepseekV3Config's defaults for absent fields.
    defaults = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
                "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
                "rope_interleave": True, "num_key_value_heads": 128, "intermediate_size": 18432}
    extra_fields = ("num_nextn_predict_layers", "num_mtp_layers")  # the MTP module, which transformers does not build
    random_buffers = ("e_score_correction_bias",)  # drawn at random in tiny checkpoints (zoo.checkpoints.tiny)
    tiny = {**TINY, "q_lora_rank": 16, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True}

    def rope_layout(self, f):
        return "pairs_to_half" if f.get("rope_interleave", True) else "half"

    def router(self, f):
        return {"name": "sigmoid_group", "n_groups": f.require("n_group"), "topk_group": f.require("topk_group")}

    def norm_topk(self, f):
        return bool(f.get("norm_topk_prob", True))

    def mtp(self, f, layers):
        """num_nextn_predict_layers MTP modules, each an MoE layer (transformers' MTP config sets
        first_k_dense_replace to 0); transformers itself drops their weights."""
        mtp = read_mtp(f)  # of the last layer's kind, MoE (the dense layers come first)
        if mtp and "moe" not in layers:
            raise f.error("num_nextn_predict_layers", "the MTP modules are MoE layers, and this model has none "
                                                       "(first_k_dense_replace >= num_hidden_layers)")
        return mtp

    def router_to_config(self, cfg, moe, position):
        if position.layout == "interleaved":
            raise ValueError("deepseek_v3 rotates with RoPE layout 'pairs_to_half' (rope_interleave) or 'half'")
        r = moe.router
        if r.name != "sigmoid_group" or not r.selection_bias:
            raise ValueError("deepseek_v3 routes with 'sigmoid_group' and its selection bias")
        cfg.update(n_group=r.n_groups, topk_group=r.topk_group, norm_topk_prob=moe.norm_topk_prob,
                   rope_interleave=position.layout == "pairs_to_half")

    def spec_to_config(self, spec):
        cfg = super().spec_to_config(spec)
        cfg["num_nextn_predict_layers"] = spec.mtp.depth if spec.mtp is not None else 0
        if spec.mtp is not None and spec.layers[mtp_layer_kind(spec)].ffn.name != "moe":
            raise ValueError("deepseek_v3's multi-token prediction modules are MoE layers (set mtp.layer to one)")
        return cfg


FORMATS = [DeepseekV2(), DeepseekV3()]
