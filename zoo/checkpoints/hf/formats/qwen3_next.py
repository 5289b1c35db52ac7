"""Qwen3-Next: a hybrid of Gated DeltaNet layers and gated attention, every FFN a MoE with a gated shared expert.

``layer_types`` names each layer ``linear_attention`` (zoo's ``gated_deltanet`` mixer) or
``full_attention`` (zoo's ``attention`` with ``output_gate``: q_proj gives each head its query and
a sigmoid gate; per-head QK-norm; partial RoPE, ``partial_rotary_factor`` 0.25 unless given). A
config without ``layer_types`` takes transformers' rule: every ``full_attention_interval``-th layer
(4) is full attention. The schedule becomes the spec's ``layer_pattern``. Every RMSNorm outside the
DeltaNet is zero-centred (``x * (1 + w)``, in float32); the DeltaNet's own output norm is plain
(``w * x``) and gated.

The FFN is zoo's ``moe`` (softmax, top-k, renormalised when ``norm_topk_prob``) with a shared
expert gated by ``sigmoid(shared_expert_gate(x))``, as Qwen2-MoE; ``mlp_only_layers`` and
``decoder_sparse_step`` make dense layers as there.

Released checkpoints also carry a multi-token-prediction module under ``mtp.*`` (zoo/model/mtp.py's
``QWEN3_NEXT`` layout): ``mtp.fc`` projects ``[pre_fc_norm_embedding(embed(t[i+1]));
pre_fc_norm_hidden(h[i])]``, embedding first as vLLM's ``qwen3_next_mtp`` concatenates them, into
``mtp.layers.0``, a gated-attention MoE layer, then ``mtp.norm``. transformers drops it; zoo loads
and saves it. ``num_nextn_predict_layers`` counts the modules; the released config.json leaves it
out and vLLM then reads 1, as zoo does. A checkpoint without ``mtp.*`` tensors (one transformers
wrote) loads the main model alone (zoo.checkpoints.hf.mtp.without_absent_mtp). The layout stores one ``mtp.fc``,
so a depth above 1 is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.checkpoints.hf.common import pattern
from zoo.checkpoints.hf.fields import merged
from zoo.checkpoints.hf.format import Fields
from zoo.checkpoints.hf.formats.llama import FULL, GEMMA_NORM, LAYER, TINY, LlamaStyle, Ropes
from zoo.checkpoints.hf.formats.moe import MOE_TINY, MoEStyle
from zoo.checkpoints.hf.maps import Transform, ZOO_MIXER, rule
from zoo.checkpoints.hf.mtp import QWEN3_NEXT, mtp_rules, read_mtp
from zoo.model.mtp import mtp_layer_kind
from zoo.core.spec import ModelSpec

LINEAR = "linear_attention"
#: HF config field -> the gated_deltanet setting it gives.
DELTANET_FIELDS = {"linear_num_value_heads": "n_heads", "linear_num_key_heads": "n_key_heads",
                   "linear_key_head_dim": "key_dim", "linear_value_head_dim": "value_dim",
                   "linear_conv_kernel_dim": "conv_kernel"}
DELTANET_TENSORS = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def grouped(name: str, groups: int, sizes: list[int]) -> Transform:
    """Rows stored group by group (per key head: ``sizes`` rows of each part) <-> zoo's rows part by
    part (``[q | k | v | z]``, ``[b | a]``), each part head after head."""

    def to_zoo(ts, h):
        w = ts[0]
        parts = w.view(groups, sum(sizes), w.shape[-1]).split(sizes, 1)
        return [torch.cat([p.reshape(-1, w.shape[-1]) for p in parts], 0)]

    def to_hf(ts, h):
        w = ts[0]
        parts = w.split([groups * s for s in sizes], 0)
        return [torch.cat([p.view(groups, s, w.shape[-1]) for p, s in zip(parts, sizes)], 1).reshape(-1, w.shape[-1])]

    return Transform(name, to_zoo, to_hf)


class Qwen3Next(MoEStyle):
    model_type, architecture = "qwen3_next", "Qwen3NextForCausalLM"
    ignore = LlamaStyle.ignore
    fields = LlamaStyle.fields - "mlp_bias"
    template = merged(LlamaStyle.template, {"layer": {"mixer": {"qk_norm": "head"}, "norm": GEMMA_NORM},
                                            "final_norm": GEMMA_NORM})
    ropes = Ropes(partial_rotary_factor=0.25)  # transformers' default for this model
    sparse_layers = True
    shared = True
    norm_topk_default = True
    moe_fields = MoEStyle.moe_fields + ("layer_types", "full_attention_interval", *DELTANET_FIELDS,
                                        "num_nextn_predict_layers")
    # Qwen3NextConfig's defaults for absent fields.
    defaults = {"num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768, "num_experts": 512,
                "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "norm_topk_prob": True, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25,
                "full_attention_interval": 4, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    tiny = {**MOE_TINY, "num_hidden_layers": 4, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "mlp_only_layers": [2],
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
            "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3, "partial_rotary_factor": 0.5,
            "max_position_embeddings": TINY["max_position_embeddings"]}

    def rules(self, spec):
        rules = super().rules(spec)
        gdn = next((spec.layer(i).mixer for i in range(spec.n_layers) if spec.layer(i).mixer.name == "gated_deltanet"), None)
        if gdn is not None:
            Hk = gdn.n_key_heads or gdn.n_heads
            r = gdn.n_heads // Hk
            hf, z = f"{LAYER}linear_attn.", f"{ZOO_MIXER}"
            rules.append(rule(f"{hf}in_proj_qkvz.weight", f"{z}in_proj_qkvz.weight",
                              grouped("grouped_qkvz", Hk, [gdn.key_dim, gdn.key_dim, r * gdn.value_dim, r * gdn.value_dim])))
            rules.append(rule(f"{hf}in_proj_ba.weight", f"{z}in_proj_ba.weight", grouped("grouped_ba", Hk, [r, r])))
            rules += [rule(f"{hf}{t}", f"{z}{t}") for t in DELTANET_TENSORS]
        # The multi-token prediction module under mtp.*: its block named as a main layer's.
        return mtp_rules(rules, spec, QWEN3_NEXT) + rules

    # -- config -> spec -------------------------------------------------------------------------
    def mixer_types(self, f: Fields, n_layers: int) -> list[str]:
        interval = f.get("full_attention_interval", kind=int)
        types = f.get("layer_types", kind=list)
        if types is None:
            interval = f.positive("full_attention_interval")  # every interval-th layer is full attention
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if len(types) != n_layers:
            raise f.error("layer_types", f"has {len(types)} entries for {n_layers} layers")
        bad = [t for t in types if t not in (LINEAR, FULL)]
        if bad:
            raise f.error("layer_types", f"layer type {bad[0]!r} is not supported; expected {LINEAR!r} or {FULL!r}")
        return list(types)

    def config_to_spec(self, config, *, strict=False):
        spec = super().config_to_spec(config, strict=strict)  # every layer attention, FFNs as read
        f = Fields(config, self.model_type, self.defaults)
        deltanet = {"name": "gated_deltanet", "norm_eps": float(f.get("rms_norm_eps", 1e-6)),
                    **{z: f.get(hf, kind=int) for hf, z in DELTANET_FIELDS.items()}}
        types = self.mixer_types(f, spec.n_layers)
        data = spec.to_dict()
        layers, names = {}, []
        for i, t in enumerate(types):
            base = spec.layer_kind(i)
            name = ("linear" if t == LINEAR else "full") + ("" if base == "default" else f"_{base}")
            if name not in layers:
                layer = dict(data["layers"][base])
                attention = layer.pop("attention", None) or layer.pop("mixer")
                layer["mixer"] = deltanet if t == LINEAR else {**attention, "output_gate": True}
                layers[name] = layer
            names.append(name)
        data["layers"], data["layer_pattern"] = layers, list(pattern(names))
        mtp = self.mtp(config, names, layers)
        if mtp:
            data["mtp"] = mtp
        return ModelSpec.from_dict(data)

    def mtp(self, config, names: list[str], layers: dict[str, Any]):
        """The spec's ``mtp`` table: ``num_nextn_predict_layers`` modules (1 when absent, as vLLM
        reads the released config), each block a gated-attention MoE layer (vLLM builds it as a
        ``full_attention`` layer), of the last such kind of the main model (``mtp.layer``, left out when
        it is the last layer's kind, as in the released model)."""
        f = Fields(config, self.model_type, {"num_nextn_predict_layers": 1})
        mtp = read_mtp(f)
        if not mtp:
            return None
        if mtp["depth"] > 1:
            raise f.error("num_nextn_predict_layers", f"is {mtp['depth']}; a qwen3_next checkpoint stores one MTP "
                                                       "module (one mtp.fc), so zoo reads at most 1")
        kind = next((k for k in reversed(names) if layers[k]["mixer"]["name"] == "attention"
                     and layers[k]["ffn"]["name"] == "moe"), None)
        if kind is None:
            if "num_nextn_predict_layers" not in config:
                return None  # no layer of the MTP block's kind: the config declares no MTP either
            raise f.error("num_nextn_predict_layers", "the MTP module is a gated-attention MoE layer, and this "
                                                       "model has none (every attention layer is in mlp_only_layers)")
        return mtp if kind == names[-1] else {**mtp, "layer": kind}  # (None: the last layer's kind)

    # -- spec -> config -------------------------------------------------------------------------
    def spec_to_config(self, spec):
        kinds = [spec.layer(i).mixer.name for i in range(spec.n_layers)]
        full = next((spec.layer(i).mixer for i, k in enumerate(kinds) if k == "attention"), None)
        deltanet = next((spec.layer(i).mixer for i, k in enumerate(kinds) if k == "gated_deltanet"), None)
        if set(kinds) - {"attention", "gated_deltanet"} or full is None:
            raise ValueError("qwen3_next layers are 'gated_deltanet' or 'attention' mixers, with at least one "
                             f"attention layer; got {sorted(set(kinds))}")
        if not full.output_gate or len({repr(spec.layer(i).mixer) for i, k in enumerate(kinds) if k == "attention"}) > 1:
            raise ValueError("qwen3_next's attention layers share one gated attention (output_gate = true)")
        # The attention-only view of the model gives the fields of the Llama-style layers.
        data = spec.to_dict()
        for name, layer in data["layers"].items():
            layer.pop("attention", None)
            layer["mixer"] = full.to_dict()
        cfg = super().spec_to_config(ModelSpec.from_dict(data))
        cfg["layer_types"] = [FULL if k == "attention" else LINEAR for k in kinds]
        if deltanet is not None:
            if len({repr(spec.layer(i).mixer) for i, k in enumerate(kinds) if k == "gated_deltanet"}) > 1:
                raise ValueError("qwen3_next has one Gated DeltaNet configuration for every linear-attention layer")
            cfg.update({hf: getattr(deltanet, z) for hf, z in DELTANET_FIELDS.items()})
            cfg["linear_num_key_heads"] = deltanet.n_key_heads or deltanet.n_heads
        cfg["num_nextn_predict_layers"] = spec.mtp.depth if spec.mtp is not None else 0
        if spec.mtp is not None:
            block = spec.layers[mtp_layer_kind(spec)]
            if spec.mtp.depth > 1 or block.mixer.name != "attention" or block.ffn.name != "moe":
                raise ValueError("qwen3_next stores one multi-token prediction module, a gated-attention MoE layer "
                                 "(mtp.depth 1, mtp.layer an 'attention' + 'moe' layer kind)")
        return cfg


FORMATS = [Qwen3Next()]
