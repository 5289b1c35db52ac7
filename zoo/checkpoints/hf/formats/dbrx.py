"""DBRX (``dbrx``): a pre-norm decoder whose every FFN is a mixture of fine-grained GLU experts.

Its twists, each a field of the spec:

- the config nests the attention's fields under ``attn_config`` and the experts' under
  ``ffn_config``; the field table names them by their dotted path (``attn_config.clip_qkv``), so an
  error names the nested field;
- ``attn_config.clip_qkv`` clamps the fused QKV projection's output to ``[-clip, clip]``
  (the attention's ``clip_qkv``);
- LayerNorms without biases (eps 1e-5, torch's default), on the blocks and at the end;
- the router's softmax is taken over all experts, the top-k kept and divided by their
  ``moe_normalize_expert_weights``-norm: with the default p = 1 the weights are the softmax of the
  top-k logits (zoo's ``topk_softmax``); null keeps the probabilities (``softmax_topk``); any other
  p is refused by name;
- the checkpoint stores each layer's experts as three tensors over all experts
  (``ffn.experts.mlp.w1`` / ``v1`` / ``w2``, each ``(n_experts * d_ff, d_model)``, ``w2`` holding the
  down projections transposed) and the attention as one ``Wqkv`` (q, k, v one after the other).

transformers adds ``ffn_config.moe_loss_weight`` times the pooled Switch loss to its loss when
``output_router_logits`` is set (``switch_pooled_loss``); otherwise the term is off.

The RoPE base: transformers 5 rotates by a top-level ``rope_parameters`` (which its own saves
write) and no longer reads the release's ``attn_config.rope_theta``; a config without
``rope_parameters`` (the released files) is read by its ``attn_config.rope_theta``, the base the
model was trained with and transformers 4 used. zoo writes both.
"""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.common import activation_name, hf_activation, rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.hf.fields import Field, FieldTable, TableFormat, expect, known, write_fields
from zoo.checkpoints.hf.format import GENERIC_FIELDS, _is_dropout
from zoo.checkpoints.hf.maps import FUSED_QKV, ZOO_LAYER, ZOO_MIXER, embed_and_head, fused_experts, layer_norms, rule

LAYER = "transformer.blocks.{i}."
NESTED = ("attn_config", "ffn_config")


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """The config with ``attn_config`` and ``ffn_config`` spread into dotted keys
    (``attn_config.clip_qkv``). What transformers' sub-configs drop (their ``model_type``, which the
    released files write as ``""``, and dropout rates) is left out."""
    out = {k: v for k, v in config.items() if k not in NESTED or not isinstance(v, dict)}
    for sub in NESTED:
        for key, value in (config.get(sub) or {}).items() if isinstance(config.get(sub), dict) else ():
            if key not in GENERIC_FIELDS and not _is_dropout(key):
                out[f"{sub}.{key}"] = value
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten`: dotted keys back under their sub-config."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        sub, _, rest = key.partition(".")
        if rest and sub in NESTED:
            out.setdefault(sub, {})[rest] = value
        else:
            out[key] = value
    return out


def _activation(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"must be an object such as {{\"name\": \"silu\"}}, got {value!r}")
    return hf_activation(value.get("name", "silu"))


def _expert(activation: dict[str, Any]) -> dict[str, Any]:
    return {"name": "swiglu"} if activation == {"name": "silu"} else {"name": "glu", "activation": activation}


#: p of the expert weights' normalisation -> zoo's router.
ROUTERS = {1: "topk_softmax", None: "softmax_topk"}


def _router(p: Any) -> str:
    if (1 if p == 1 else p) not in ROUTERS:
        raise ValueError(f"value {p!r} is not supported: zoo's routers renormalise the top-k weights to sum to "
                         "one (p = 1) or keep them (null)")
    return ROUTERS[1 if p == 1 else p]


DBRX_FIELDS = FieldTable([
    Field("d_model", "d_model", 2048),
    Field("n_heads", "layer.mixer.n_heads", 16),
    Field("n_layers", "n_layers", 24),
    Field("max_seq_len", "max_seq_len", 2048),
    Field("vocab_size", "vocab_size", 32000),
    Field("attn_config.kv_n_heads", "layer.mixer.n_kv_heads", 1,
          source=lambda s: s.layer(0).mixer.n_kv_heads or s.layer(0).mixer.n_heads),
    Field("attn_config.clip_qkv", "layer.mixer.clip_qkv", None, float,
          to_spec=lambda v: None if v is None else float(v)),
    Field("attn_config.rope_theta", "position.theta", 10000.0, to_spec=float),
    Field("ffn_config.ffn_hidden_size", "layer.ffn.d_ff", 3584),
    Field("ffn_config.moe_num_experts", "layer.ffn.n_experts", 4),
    Field("ffn_config.moe_top_k", "layer.ffn.top_k", 1),
    Field("ffn_config.ffn_act_fn", "layer.ffn.expert", {"name": "silu"},
          to_spec=lambda v: _expert(_activation(v)),
          source=lambda s: {"name": activation_name(s.layer(0).ffn.expert.config.activation)}),
    # Absent: transformers' 1.0 (Dbrx.defaults); null: no normalisation.
    Field("ffn_config.moe_normalize_expert_weights", "layer.ffn.router", None, float,
          to_spec=_router,
          source=lambda s: 1.0 if s.layer(0).ffn.router.name == "topk_softmax" else None),
    # Router noise in training only (transformers' DbrxRouter: ``if self.training``): typed, and
    # nothing at inference.
    Field("ffn_config.moe_jitter_eps", None, None, float),
    expect("tie_word_embeddings", (False,), "transformers refuses tied DBRX embeddings"),
    # Read by the loss reader (switch_pooled_loss) below.
    Field("output_router_logits", None, False, bool),
    Field("ffn_config.moe_loss_weight", None, 0.01, float),
    # What transformers derives from other fields and writes: kv_n_heads again, d_model again.
    *known("num_key_value_heads", "ffn_config.hidden_size", "rope_parameters"),
])

DBRX_TEMPLATE: dict[str, Any] = {
    "layer": {"mixer": {"name": "attention"},
              "ffn": {"name": "moe", "norm_topk_prob": False},
              "norm": {"name": "layernorm", "bias": False, "eps": 1e-5},
              "block": {"name": "serial", "norm_position": "pre"}},
    "position": {"name": "rope"},
    "final_norm": {"name": "layernorm", "bias": False, "eps": 1e-5},
    "head": {"tied": False},
}


class Dbrx(TableFormat):
    model_type, architecture = "dbrx", "DbrxForCausalLM"
    base_prefix = "transformer."
    ignore = ("transformer.rotary_emb.*",)
    fields = DBRX_FIELDS
    template = DBRX_TEMPLATE
    defaults = {"ffn_config.moe_normalize_expert_weights": 1.0}
    # d_model 64 of 4 heads (16 wide), 2 KV heads; 4 experts of 24, top-2; the clamp at 0.5 binds on
    # most of the tiny model's q, k and v (their entries reach about 2).
    tiny = {"vocab_size": 128, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
            "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2}}

    def rules(self, spec):
        a, m = f"{LAYER}norm_attn_norm.", f"{LAYER}ffn."
        n = spec.layer(0).ffn.n_experts
        return [
            *embed_and_head("transformer.wte.weight", "transformer.norm_f.weight"),
            *layer_norms(a, {"norm_1": "attn_norm", "norm_2": "ffn_norm"}),
            rule(f"{a}attn.Wqkv.weight", [f"{ZOO_MIXER}{p}_proj.weight" for p in "qkv"], FUSED_QKV),
            rule(f"{a}attn.out_proj.weight", f"{ZOO_MIXER}o_proj.weight"),
            rule(f"{m}router.layer.weight", f"{ZOO_LAYER}ffn.router.weight"),
            rule(f"{m}experts.mlp.w1", f"{ZOO_LAYER}ffn.experts.w_gate", fused_experts(n)),
            rule(f"{m}experts.mlp.v1", f"{ZOO_LAYER}ffn.experts.w_up", fused_experts(n)),
            rule(f"{m}experts.mlp.w2", f"{ZOO_LAYER}ffn.experts.w_down", fused_experts(n, transposed=True)),
        ]

    def config_to_spec(self, config, *, strict=False):
        for sub in NESTED:
            if config.get(sub) is not None and not isinstance(config[sub], dict):
                from zoo.checkpoints.hf.format import ConfigError

                raise ConfigError(sub, f"must be a JSON object, got {config[sub]!r}", self.model_type)
        return super().config_to_spec(flatten(config), strict=strict)

    def complete(self, f, data):
        if "rope_parameters" in f:  # what transformers 5 rotates by (see the module's docstring)
            data["position"] = rope_part(f, rope_parameters(f), max_pos=data["max_seq_len"])
        layer = data.pop("layer")
        if f.values["output_router_logits"]:
            layer["ffn"]["switch_pooled_loss"] = float(f.values["ffn_config.moe_loss_weight"])
        data["layers"] = {"default": layer}

    def spec_to_config(self, spec):
        moe = spec.layer(0).ffn
        if moe.name != "moe":
            raise ValueError("dbrx's FFN is a mixture of experts in every layer ('moe')")
        if not moe.expert.cls.gated:
            raise ValueError("dbrx's experts are gated FFNs (w1 gates, v1 goes up)")
        cfg = write_fields(spec, self.fields)
        cfg["output_router_logits"] = moe.switch_pooled_loss > 0
        cfg["ffn_config.moe_loss_weight"] = moe.switch_pooled_loss if moe.switch_pooled_loss > 0 else 0.01
        cfg["tie_word_embeddings"] = False
        att = spec.layer(0).mixer
        cfg["rope_parameters"] = rope_to_hf(spec.position, att.cls.head_dim_for(att.config, spec.d_model))
        return nest(cfg)


FORMATS = [Dbrx()]
