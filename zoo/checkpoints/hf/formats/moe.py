"""Mixture-of-Experts decoders in the Llama layout: mixtral, qwen2_moe, qwen3_moe, olmoe.

Their attention, norms and RoPE are the Llama-style formats' (Mistral, Qwen 2, Qwen 3, OLMo 2's
QK-norm over the projection); the FFN of a sparse layer is zoo's ``moe``. Hub checkpoints store one
tensor per expert (``experts.{j}.gate_proj.weight``); the ``stack`` transform loads them into zoo's
stacked experts and saves them back per key. Dense layers (Qwen's ``mlp_only_layers`` and
``decoder_sparse_step``) become a second layer kind in a full-length ``layer_pattern``.

``router_aux_loss_coef`` is the weight of the balance loss pooled over layers (``switch_pooled_loss``)
when ``output_router_logits`` is set, as transformers adds it to its loss; otherwise it is off.
"""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.common import pattern
from zoo.checkpoints.hf.fields import merged
from zoo.checkpoints.hf.format import Fields
from zoo.checkpoints.hf.formats.llama import TINY, LAYER, FULL, LlamaStyle, Mistral, NoWindows, Qwen3
from zoo.checkpoints.hf.maps import EXPERT_PROJECTIONS, ZOO_LAYER, gated_mlp, rule, stacked_experts
from zoo.core.spec import ModelSpec

MOE_TINY = {**TINY, "num_hidden_layers": 3, "output_router_logits": True, "router_aux_loss_coef": 0.02}


class MoEStyle(LlamaStyle):
    """What the four formats share; each names its config fields and tensor names."""

    mlp = "mlp"  # the HF module holding router and experts
    experts_key = "num_experts"
    width_key = "moe_intermediate_size"  # None: the experts' width is intermediate_size
    projections = EXPERT_PROJECTIONS
    router = "softmax_topk"
    norm_topk_default: Any = False  # None: the format always renormalises (its router does)
    shared = False  # a gated shared expert in every sparse layer (Qwen2-MoE)
    sparse_layers = False  # decoder_sparse_step and mlp_only_layers
    moe_fields = ("num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")

    # -- the weight-name map --------------------------------------------------------------------
    def rules(self, spec):
        rules = super().rules(spec)
        moe = self.moe_part(spec)
        if moe is None:
            return rules
        m = f"{LAYER}{self.mlp}."
        rules.append(rule(f"{m}gate.weight", f"{ZOO_LAYER}ffn.router.weight"))
        rules += stacked_experts(f"{m}experts.", moe.n_experts, self.projections)
        rules += gated_mlp(f"{m}shared_expert.", f"{ZOO_LAYER}ffn.shared.", weights=("weight",))
        rules.append(rule(f"{m}shared_expert_gate.weight", f"{ZOO_LAYER}ffn.shared_gate.weight"))
        return rules

    @staticmethod
    def moe_part(spec: ModelSpec):
        return next((spec.layer(i).ffn for i in range(spec.n_layers) if spec.layer(i).ffn.name == "moe"), None)

    # -- config -> spec -------------------------------------------------------------------------
    def is_sparse(self, f: Fields, i: int) -> bool:
        if not self.sparse_layers:
            return True
        step = f.positive("decoder_sparse_step", 1)  # every step-th layer is sparse
        return i not in (f.get("mlp_only_layers") or []) and self.n_experts(f) > 0 and (i + 1) % step == 0

    def n_experts(self, f: Fields) -> int:
        """The expert count (transformers writes Qwen3-MoE's as ``num_local_experts``; releases say
        ``num_experts``)."""
        keys = (self.experts_key, "num_local_experts")
        given = {k: f.get(k) for k in keys if f.config.get(k) is not None}
        if len(set(given.values())) > 1:
            raise f.error("num_local_experts", f"{given['num_local_experts']} disagrees with {self.experts_key} = "
                                               f"{given[self.experts_key]}")
        if given:
            return next(iter(given.values()))
        n = next((f.get(k) for k in keys if f.get(k) is not None), None)  # absent: the config class's default
        if n is None:
            raise f.error(self.experts_key, "is required and missing")
        return n

    def moe_ffn(self, f: Fields) -> dict[str, Any]:
        expert = {"name": "glu", "activation": self.read_activation(f)}
        width = f.require(self.width_key) if self.width_key else f.require("intermediate_size")
        ffn: dict[str, Any] = {
            "name": "moe", "n_experts": self.n_experts(f), "top_k": f.require("num_experts_per_tok"),
            "d_ff": width, "router": self.router,
            "expert": expert if expert["activation"] != {"name": "silu"} else {"name": "swiglu"},
            "norm_topk_prob": bool(f.get("norm_topk_prob", self.norm_topk_default)) if self.norm_topk_default is not None
            else False,
        }
        if self.shared:
            ffn.update(shared_d_ff=f.require("shared_expert_intermediate_size"), shared_gate=True)
        if f.get("output_router_logits", False):
            ffn["switch_pooled_loss"] = float(f.get("router_aux_loss_coef", 0.001))
        return ffn

    def complete(self, f, data):
        """Llama's layer kinds, then the sparse layers' FFN (``is_sparse``), in the same reading."""
        super().complete(f, data)
        moe = self.moe_ffn(f)
        L, period = data["n_layers"], data["layer_pattern"]
        kinds = [period[i % len(period)] for i in range(L)]
        sparse = [self.is_sparse(f, i) for i in range(L)]
        mixed = len(set(sparse)) > 1
        layers, names = {}, []
        for base, is_moe in zip(kinds, sparse):
            suffix = "moe" if is_moe else "dense"
            name = base if not mixed else (suffix if base == "default" else f"{base}_{suffix}")
            if name not in layers:
                layers[name] = {**data["layers"][base], **({"ffn": moe} if is_moe else {})}
            names.append(name)
        data["layers"], data["layer_pattern"] = layers, list(pattern(names))

    @property
    def extra_fields(self) -> tuple[str, ...]:  # interpreted by complete() (or a subclass's own reader)
        keys = [self.experts_key, "num_local_experts", "norm_topk_prob", *self.moe_fields]
        keys += [self.width_key] if self.width_key else []
        keys += ["shared_expert_intermediate_size"] if self.shared else []
        keys += ["decoder_sparse_step", "mlp_only_layers"] if self.sparse_layers else []
        return tuple(keys)

    # -- spec -> config -------------------------------------------------------------------------
    def spec_to_config(self, spec):
        moe = self.moe_part(spec)
        if moe is None:
            raise ValueError(f"{self.model_type} needs at least one layer whose ffn is 'moe'")
        sparse = [spec.layer(i).ffn.name == "moe" for i in range(spec.n_layers)]
        if not self.sparse_layers and not all(sparse):
            raise ValueError(f"{self.model_type} makes every layer sparse (no dense layers)")
        if len({repr(spec.layer(i).ffn) for i in range(spec.n_layers) if sparse[i]}) > 1:
            raise ValueError(f"{self.model_type} has one MoE configuration for every sparse layer")
        if moe.expert.name not in ("glu", "swiglu", "geglu", "reglu") or moe.expert.bias:
            raise ValueError(f"{self.model_type} experts are gated FFNs without biases")
        if moe.router.name != self.router or moe.router.config != moe.router.cls.Config():
            raise ValueError(f"{self.model_type} routes with a plain {self.router!r} router")
        dense = next((spec.layer(i).ffn for i in range(spec.n_layers) if not sparse[i]), None)
        data = spec.to_dict()
        view = dense.to_dict() if dense is not None else {**moe.expert.to_dict(), "d_ff": moe.d_ff}
        for kind, layer in spec.layers.items():
            if layer.ffn.name == "moe":
                data["layers"][kind]["ffn"] = view
        cfg = super().spec_to_config(ModelSpec.from_dict(data))
        cfg.update({self.experts_key: moe.n_experts, "num_experts_per_tok": moe.top_k,
                    "output_router_logits": moe.switch_pooled_loss > 0})
        if moe.switch_pooled_loss > 0:
            cfg["router_aux_loss_coef"] = moe.switch_pooled_loss
        if self.width_key:
            cfg[self.width_key] = moe.d_ff
        elif dense is not None:
            raise ValueError(f"{self.model_type} has no dense layers")
        if self.norm_topk_default is not None:
            cfg["norm_topk_prob"] = moe.norm_topk_prob
        elif moe.norm_topk_prob:
            raise ValueError(f"{self.model_type}'s router already sums to one: norm_topk_prob does not apply")
        if self.shared:
            if moe.shared_d_ff is None or not moe.shared_gate:
                raise ValueError(f"{self.model_type} has a gated shared expert in every sparse layer")
            cfg["shared_expert_intermediate_size"] = moe.shared_d_ff
        elif moe.shared_d_ff is not None:
            raise ValueError(f"{self.model_type} has no shared expert")
        if moe.routed_scaling != 1.0 or any(getattr(moe, k) for k in ("switch_loss", "sequence_loss", "device_loss",
                                                                      "z_loss")) or moe.bias_update != "none" or moe.capacity_factor is not None:
            raise ValueError(f"{self.model_type} has no field for the routed scaling, other balance losses, "
                             "bias updates or a capacity factor")
        if self.sparse_layers:
            cfg.update(decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(sparse) if not s])
        return cfg


class Mixtral(MoEStyle, Mistral):
    model_type, architecture = "mixtral", "MixtralForCausalLM"
    fields = Mistral.fields
    mlp = "block_sparse_moe"
    experts_key = "num_local_experts"
    width_key = None
    projections = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
    router = "topk_softmax"
    norm_topk_default = None
    moe_fields = MoEStyle.moe_fields + ("router_jitter_noise",)
    # MixtralConfig's defaults for absent fields (unlike Mistral's, no sliding window).
    defaults = {"sliding_window": None, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6}
    tiny = {**MOE_TINY, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}

    def config_to_spec(self, config, *, strict=False):
        Fields(config, self.model_type).expect("router_jitter_noise", (0.0, 0), "zoo's routers add no noise")
        return super().config_to_spec(config, strict=strict)


class NoSliding(NoWindows):
    """Qwen's MoE checkpoints: ``use_sliding_window`` must be false, every ``layer_types`` entry full."""

    def types(self, f, n_layers):
        f.expect("use_sliding_window", (False,), "zoo reads Qwen-MoE checkpoints without sliding windows")
        types = f.get("layer_types") or [FULL] * n_layers
        if any(t != FULL for t in types) or len(types) != n_layers:
            raise f.error("layer_types", f"expected {n_layers} full_attention layers, got {types}")
        return [FULL] * n_layers


class QwenMoE(MoEStyle):
    """Qwen's sparse layers: no sliding windows (``use_sliding_window`` must be false)."""

    sparse_layers = True
    moe_fields = MoEStyle.moe_fields + ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    windows = NoSliding()
    fields = LlamaStyle.fields - "mlp_bias"

    def spec_to_config(self, spec):
        return {**super().spec_to_config(spec), "use_sliding_window": False}


class Qwen2MoE(QwenMoE):
    model_type, architecture = "qwen2_moe", "Qwen2MoeForCausalLM"
    shared = True
    moe_fields = QwenMoE.moe_fields + ("qkv_bias",)
    defaults = {"num_key_value_heads": 16, "max_position_embeddings": 32768, "num_experts": 60, "num_experts_per_tok": 4,
                "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "rms_norm_eps": 1e-6}
    tiny = {**MOE_TINY, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 80, "mlp_only_layers": [0], "norm_topk_prob": False}

    def config_to_spec(self, config, *, strict=False):
        spec = super().config_to_spec(config, strict=strict)
        bias = bool(config.get("qkv_bias", True))
        return spec.with_overrides({"layers.*.mixer.bias": bias, "layers.*.mixer.out_bias": False})

    def spec_to_config(self, spec):
        att = spec.layer(0).mixer
        if att.out_bias:
            raise ValueError("qwen2_moe has no output-projection bias")
        cfg = super().spec_to_config(spec)
        cfg.pop("attention_bias", None)
        return {**cfg, "qkv_bias": att.bias}


class Qwen3MoE(QwenMoE):
    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"
    template = merged(QwenMoE.template, {"layer": {"mixer": {"qk_norm": Qwen3.template["layer"]["mixer"]["qk_norm"]}}})
    defaults = {"num_key_value_heads": 4, "max_position_embeddings": 32768, "num_local_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "rms_norm_eps": 1e-6}
    tiny = {**MOE_TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "decoder_sparse_step": 2, "norm_topk_prob": True, "attention_bias": True}


class Olmoe(MoEStyle):
    model_type, architecture = "olmoe", "OlmoeForCausalLM"
    fields = LlamaStyle.fields - "mlp_bias"
    template = merged(LlamaStyle.template, {"layer": {"mixer": {"qk_norm": "proj"}}})
    width_key = None
    moe_fields = MoEStyle.moe_fields + ("clip_qkv",)
    defaults = {"num_key_value_heads": 16, "max_position_embeddings": 4096, "num_experts": 64, "num_experts_per_tok": 8,
                "rms_norm_eps": 1e-5}
    tiny = {**{k: v for k, v in MOE_TINY.items() if k != "head_dim"}, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
            "attention_bias": True}

    def config_to_spec(self, config, *, strict=False):
        Fields(config, self.model_type).expect("clip_qkv", (None,), "zoo does not clip q, k and v")
        return super().config_to_spec(config, strict=strict)

    def spec_to_config(self, spec):
        cfg = super().spec_to_config(spec)
        cfg.pop("head_dim", None)  # OLMoE's k-norm width assumes head_dim = hidden_size / heads
        return cfg


FORMATS = [Mixtral(), Qwen2MoE(), Qwen3MoE(), Olmoe()]
