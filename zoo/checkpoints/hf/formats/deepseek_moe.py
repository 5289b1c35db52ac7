"""DeepSeekMoE (``deepseek``, "DeepSeek V1"): the layout deepseek-ai/deepseek-moe-16b-* are released in,
with remote code (``DeepseekForCausalLM``, ``modeling_deepseek.py``) that transformers does not
implement. zoo reads it as it reads ``mamba_ssm``'s layout: every field its configuration class
declares is interpreted, and a value zoo cannot express is refused by the field's name.

The model is Llama's decoder (multi-head or grouped attention, half-split RoPE, RMSNorm, SwiGLU)
with DeepSeekMoE FFNs: layer ``i`` is sparse when ``i >= first_k_dense_replace`` and
``i % moe_layer_freq == 0`` (the rest keep the dense ``intermediate_size`` MLP). A sparse layer
routes each token to ``num_experts_per_tok`` of ``n_routed_experts`` fine-grained experts
(``moe_intermediate_size`` wide) by a softmax over the gate's logits, top-k, the weights
renormalised only when ``norm_topk_prob``; ``n_shared_experts`` always-active experts are one
ungated SwiGLU of ``n_shared_experts x moe_intermediate_size``. Tensor names::

    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight            (biases with attention_bias)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight             (a dense layer)
    model.layers.{i}.mlp.gate.weight                            (E x d_model, the router)
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight (stacked by zoo)
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight

Training: the released code adds ``aux_loss_alpha`` times a balance loss, sequence-wise when
``seq_aux`` (its default): per sequence, ``sum_i f_i P_i`` with ``f_i`` expert i's share of the
sequence's token copies times ``E / k`` and ``P_i`` its mean probability, averaged over the batch.
That is zoo's ``sequence_loss``. The batch-wide form (``seq_aux: false``) is ``1/k`` of zoo's
``switch_loss`` and is refused by name. The device-level loss of the DeepSeekMoE paper (zoo's
``device_loss`` over ``n_devices`` groups of experts) has no field in this layout: the 16B release
trains without it.

transformers has no reference for this layout: ``tests/formats/test_deepseek_moe.py`` checks zoo against an
independent implementation of the release's equations, on tiny random weights.
"""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.common import pattern, rope_parameters, rope_part
from zoo.checkpoints.hf.format import Fields
from zoo.checkpoints.hf.formats.llama import LAYER, TINY, LlamaStyle
from zoo.checkpoints.hf.formats.moe import MoEStyle
from zoo.checkpoints.hf.maps import ZOO_LAYER, gated_mlp, rule, stacked_experts
from zoo.core.spec import ModelSpec

#: DeepseekConfig's defaults (configuration_deepseek.py of the release) for absent fields.
DEFAULTS = {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "moe_intermediate_size": 1407,
            "num_hidden_layers": 30, "num_attention_heads": 32, "n_shared_experts": None, "n_routed_experts": None,
            "num_experts_per_tok": None, "moe_layer_freq": 1, "first_k_dense_replace": 0, "norm_topk_prob": False,
            "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


class Ropes:
    """The release's RoPE: ``rope_theta`` and ``rope_scaling`` (``linear`` or ``dynamic``, with a factor)."""

    def read(self, f: Fields, layer_type: str, max_pos: int) -> dict[str, Any]:
        params = rope_parameters(f)
        if params["rope_type"] not in ("default", "linear", "dynamic"):
            raise f.error("rope_scaling", f"type {params['rope_type']!r} is not one the release implements "
                                          "('linear' or 'dynamic')")
        return rope_part(f, params, max_pos=max_pos, where="rope_scaling")

    def write(self, model_type, ropes):
        (rope,) = {repr(r): r for r in ropes.values()}.values()
        return rope


class DeepseekMoE(MoEStyle):
    model_type, architecture = "deepseek", "DeepseekForCausalLM"
    #: transformers implements no ``deepseek``: tiny checkpoints of it are not made by transformers, and
    #: ``zoo verify --tiny`` leaves it out (zoo.checkpoints.tiny).
    transformers_reference = False
    defaults = DEFAULTS
    fields = LlamaStyle.fields - ("mlp_bias", "head_dim")  # head_dim is hidden_size / num_attention_heads
    ropes = Ropes()
    experts_key = "n_routed_experts"
    sparse_layers = True  # dense layers (is_sparse) become a layer kind of their own
    norm_topk_default = False
    moe_fields = ("num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq",
                  "scoring_func", "aux_loss_alpha", "seq_aux")
    # Three layers: the first dense, then two sparse; 8 experts of 24, top-3, two shared; GQA.
    tiny = {**{k: v for k, v in TINY.items() if k != "head_dim"}, "num_hidden_layers": 3,
            "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 2, "moe_intermediate_size": 24,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": False, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6}

    # -- the weight-name map --------------------------------------------------------------------
    def rules(self, spec):
        rules = LlamaStyle.rules(self, spec)
        moe = self.moe_part(spec)
        if moe is None:
            return rules
        m = f"{LAYER}mlp."
        return rules + [rule(f"{m}gate.weight", f"{ZOO_LAYER}ffn.router.weight"),
                        *stacked_experts(f"{m}experts.", moe.n_experts),
                        *gated_mlp(f"{m}shared_experts.", f"{ZOO_LAYER}ffn.shared.", weights=("weight",))]

    # -- config -> spec -------------------------------------------------------------------------
    def n_experts(self, f):
        return f.require("n_routed_experts")

    def is_sparse(self, f, i):
        freq = f.get("moe_layer_freq", 1)
        if freq < 1:
            raise f.error("moe_layer_freq", f"must be at least 1, got {freq}")
        return i >= f.get("first_k_dense_replace", 0) and i % freq == 0

    def moe_ffn(self, f):
        f.expect("scoring_func", ("softmax",), "the release scores experts by a softmax (its code raises otherwise)")
        ffn = super().moe_ffn(f)
        shared = f.get("n_shared_experts", kind=int)
        if shared is not None and shared < 1:
            raise f.error("n_shared_experts", f"must be at least 1 (or null: none), got {shared}")
        if shared:
            ffn["shared_d_ff"] = shared * ffn["d_ff"]
        alpha = float(f.get("aux_loss_alpha", 0.001))
        if alpha and not f.get("seq_aux", True):
            raise f.error("seq_aux", "false is the batch-wide balance loss, which is 1/top_k of zoo's switch_loss; "
                                     "zoo reads the sequence-wise one (seq_aux: true) as sequence_loss")
        if alpha < 0:
            raise f.error("aux_loss_alpha", f"a loss weight must be >= 0, got {alpha}")
        ffn["sequence_loss"] = alpha
        return ffn

    def complete(self, f, data):
        super().complete(f, data)
        if len(data["layers"]) == 2:  # MoEStyle's names: a dense first layer is "dense", the rest "moe"
            return
        (name,) = data["layers"]
        if data["layers"][name]["ffn"]["name"] != "moe":
            raise f.error("first_k_dense_replace", "leaves no sparse layer: read the checkpoint as a dense model")

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return ("n_routed_experts", "norm_topk_prob", "moe_intermediate_size", *self.moe_fields)

    # -- spec -> config -------------------------------------------------------------------------
    def spec_to_config(self, spec):
        moe = self.moe_part(spec)
        if moe is None:
            raise ValueError("deepseek needs at least one layer whose ffn is 'moe'")
        sparse = [spec.layer(i).ffn.name == "moe" for i in range(spec.n_layers)]
        first = sparse.index(True)
        later = [i for i in range(first, spec.n_layers) if sparse[i]]
        freq = later[1] - later[0] if len(later) > 1 else 1
        if sparse != [i >= first and i % freq == 0 for i in range(spec.n_layers)] or (freq > 1 and first % freq):
            raise ValueError("deepseek's sparse layers are those from first_k_dense_replace on whose index is a "
                             f"multiple of moe_layer_freq; the spec's are {[i for i, s in enumerate(sparse) if s]}")
        if moe.shared_gate or (moe.shared_d_ff is not None and moe.shared_d_ff % moe.d_ff):
            raise ValueError("deepseek's shared experts are ungated, a multiple of moe_intermediate_size wide")
        if any(getattr(moe, k) for k in ("switch_loss", "switch_pooled_loss", "device_loss", "z_loss")):
            raise ValueError("deepseek's one balance loss is the sequence-wise aux_loss_alpha (sequence_loss)")
        # MoEStyle writes the attention, the dense layers and the routed experts; the shared experts, the
        # layer schedule and the loss are written here.
        data = spec.to_dict()
        for kind, layer in spec.layers.items():
            if layer.ffn.name == "moe":
                data["layers"][kind]["ffn"].update(shared_d_ff=None, sequence_loss=0.0)
        cfg = super().spec_to_config(ModelSpec.from_dict(data))
        for key in ("output_router_logits", "decoder_sparse_step", "mlp_only_layers", "rope_parameters"):
            cfg.pop(key, None)
        cfg["rope_theta"], cfg["rope_scaling"] = _legacy_rope(spec.position)
        cfg.update(n_shared_experts=moe.shared_d_ff // moe.d_ff if moe.shared_d_ff else None,
                   first_k_dense_replace=first, moe_layer_freq=freq, scoring_func="softmax",
                   aux_loss_alpha=moe.sequence_loss, seq_aux=True)
        return cfg


def _legacy_rope(position) -> tuple[float, Any]:
    """``rope_theta`` and ``rope_scaling`` as the release's config names them."""
    if position.layout != "half" or position.rotary_dim is not None or position.rotary_fraction != 1.0:
        raise ValueError("deepseek rotates the whole head, half-split (RoPE layout 'half')")
    s = position.scaling
    if s is None:
        return position.theta, None
    if s.name not in ("linear", "dynamic_ntk"):
        raise ValueError(f"deepseek's rope_scaling is 'linear' or 'dynamic', not {s.name!r}")
    return position.theta, {"type": "linear" if s.name == "linear" else "dynamic", "factor": s.factor}


FORMATS = [DeepseekMoE()]
