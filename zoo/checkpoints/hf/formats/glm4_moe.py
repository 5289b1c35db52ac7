"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``): DeepSeek-V3's MoE layers under Llama's grouped-query attention.

The FFNs are DeepSeek-V3's (zoo/checkpoints/hf/formats/deepseek.py): the first
``first_k_dense_replace`` layers dense, then routed experts chosen by sigmoid scores with the
``e_score_correction_bias`` selection bias (``sigmoid_group``, ``n_group`` groups), renormalised by
``norm_topk_prob``, scaled by ``routed_scaling_factor``, beside ``n_shared_experts`` ungated shared
experts; the same tensor names. The attention is GQA with biases on q, k and v (``attention_bias``;
none on o), an optional per-head RMSNorm of queries and keys (``use_qk_norm``), and RoPE on the first
``partial_rotary_factor`` of each head (0.5 unless given), half-split. ``head_dim`` is read where the
config gives it (GLM-4.5: 128 of a 5120-wide model with 96 heads).

Released checkpoints carry ``num_nextn_predict_layers`` multi-token prediction modules as layers
``num_hidden_layers`` onward, in DeepSeek-V3's layout; transformers drops them (its ``num_mtp_layers``
counts them when the release's field is absent), zoo loads and saves them, and a checkpoint without
their tensors (one transformers wrote) loads the main model alone.
"""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.common import rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.hf.formats.deepseek import LAYER, TINY, DeepseekV3
from zoo.checkpoints.hf.maps import ZOO_MIXER, llama_attention
from zoo.checkpoints.hf.mtp import read_mtp


class Glm4Moe(DeepseekV3):
    model_type, architecture = "glm4_moe", "Glm4MoeForCausalLM"
    # Glm4MoeConfig's defaults for absent fields.
    defaults = {"n_routed_experts": 128, "n_shared_experts": 1, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                "routed_scaling_factor": 1.0, "max_position_embeddings": 131072, "num_key_value_heads": 8,
                "intermediate_size": 10944, "rms_norm_eps": 1e-5, "num_mtp_layers": 1}
    extra_fields = ("num_nextn_predict_layers", "num_mtp_layers")
    tiny = {**{k: v for k, v in TINY.items() if k not in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                         "v_head_dim")},
            "num_key_value_heads": 2, "head_dim": 24, "attention_bias": True, "use_qk_norm": True,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}

    def attention_rules(self, spec):
        return llama_attention(f"{LAYER}self_attn.", ZOO_MIXER)

    def rope_layout(self, f):
        return "half"

    def attention(self, f, d, n_heads, max_pos):
        params = rope_parameters(f)
        params.setdefault("partial_rotary_factor", 0.5)  # Glm4MoeConfig's default
        bias = f.get("attention_bias", False)
        attention = {"name": "attention", "n_heads": n_heads, "n_kv_heads": f.get("num_key_value_heads", n_heads),
                     "head_dim": f.get("head_dim", d // n_heads), "bias": bias, "out_bias": False,
                     "qk_norm": "head" if f.get("use_qk_norm", False) else "none"}
        return attention, rope_part(f, params, max_pos=max_pos, layout="half")

    def attention_to_config(self, spec) -> dict[str, Any]:
        att = spec.layer(0).mixer
        if att.name != "attention" or len({repr(spec.layer(i).mixer) for i in range(spec.n_layers)}) > 1:
            raise ValueError("glm4_moe has one grouped-query attention ('attention') in every layer")
        if att.out_bias or att.qk_norm == "proj" or att.window is not None or att.softcap is not None \
                or att.output_gate or att.clip_qkv is not None or att.scale_dim is not None:
            raise ValueError("glm4_moe's attention has q/k/v biases (none on o), an optional per-head QK-norm "
                             "and nothing else")
        head_dim = att.cls.head_dim_for(att.config, spec.d_model)
        rope = rope_to_hf(spec.position, head_dim)
        rope.setdefault("partial_rotary_factor", 1.0)  # (absent would read as Glm4MoeConfig's 0.5)
        return {"num_attention_heads": att.n_heads, "num_key_value_heads": att.n_kv_heads or att.n_heads,
                "head_dim": head_dim, "attention_bias": att.bias, "use_qk_norm": att.qk_norm == "head",
                "rope_parameters": rope}

    def router_to_config(self, cfg, moe, position):
        super().router_to_config(cfg, moe, position)
        if position.layout != "half":
            raise ValueError("glm4_moe rotates half-split pairs (RoPE layout 'half')")
        cfg.pop("rope_interleave")

    def mtp(self, f, layers):
        key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in f.config else "num_mtp_layers"
        f.get("num_mtp_layers"), f.get("num_nextn_predict_layers")
        mtp = read_mtp(f, key)
        if mtp and "moe" not in layers:
            raise f.error(key, "the MTP modules are MoE layers, and this model has none "
                               "(first_k_dense_replace >= num_hidden_layers)")
        return mtp

    def spec_to_config(self, spec):
        cfg = super().spec_to_config(spec)
        cfg["num_mtp_layers"] = cfg["num_nextn_predict_layers"]
        return cfg


FORMATS = [Glm4Moe()]
