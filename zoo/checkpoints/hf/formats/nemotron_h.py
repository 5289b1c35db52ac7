"""Nemotron-H (``nemotron_h``, NVIDIA 2025): a hybrid whose every layer is ``x + part(RMSNorm(x))`` with
one part, as ``layers_block_type`` (or the older ``hybrid_override_pattern``) lists them:

- ``linear_attention`` (``M``): a Mamba-2 mixer, zoo's ``mamba2`` in a ``mixer_only`` block;
- ``full_attention`` (``*``): GQA softmax attention with no position encoding and no biases, in a
  ``mixer_only`` block;
- ``mlp`` (``-``): ``down(relu2(up(x)))``, zoo's ``mlp`` in an ``ffn_only`` block;
- ``moe`` (``E``, Nemotron 3): ``n_routed_experts`` non-gated ``mlp_hidden_act`` experts, top
  ``num_experts_per_tok`` of sigmoid scores with a selection bias (DeepSeek-V3's group-limited
  routing, ``n_group`` / ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``), plus one
  shared expert of ``moe_shared_expert_intermediate_size`` (``n_shared_experts`` is not read); with
  ``moe_latent_size`` a *latent* MoE, whose routed experts run on the token projected down to that
  width and back up after them (``fc1_latent_proj`` / ``fc2_latent_proj``): zoo's ``moe`` with
  ``latent_dim``, in an ``ffn_only`` block.

The schedule becomes the spec's ``layer_pattern`` (its shortest period, or the whole list). Tensor
names (transformers writes the ``backbone.`` prefix it reads)::

    backbone.embeddings.weight, backbone.norm_f.weight, lm_head.weight
    backbone.layers.{i}.norm.weight
    backbone.layers.{i}.mixer.{in_proj, conv1d, out_proj, norm}.weight, .conv1d.bias, .dt_bias, .A_log, .D
    backbone.layers.{i}.mixer.{q,k,v,o}_proj.weight
    backbone.layers.{i}.mixer.{up,down}_proj.weight
    backbone.layers.{i}.mixer.gate.{weight, e_score_correction_bias}, .experts.{j}.{up,down}_proj.weight
    backbone.layers.{i}.mixer.shared_experts.{up,down}_proj.weight, .{fc1,fc2}_latent_proj.weight

What transformers 5.23 builds, read as it reads it:

- the Mamba-2 layers clamp the step to ``[time_step_min, inf)`` (``time_step_limit`` is not read by
  the mixer); in_proj/out_proj take ``use_bias`` (``mamba_proj_bias`` is not read); the gated norm
  has ``n_groups`` groups and ``layer_norm_epsilon``; their width is ``mamba_num_heads *
  mamba_head_dim`` (``expand`` is not read);
- attention projections never have biases (``attention_bias`` is not read), and no sliding window
  applies (``sliding_window`` is not read by its mask);
- ``residual_in_fp32``, ``rescale_prenorm_residual``, ``use_mamba_kernels``, ``num_logits_to_keep``,
  ``mamba_ssm_cache_dtype`` and the time-step initialisation fields change nothing zoo computes;
- the legacy names ``mamba_n_groups``, ``mamba_d_conv``, ``mamba_expand``, ``mamba_dt_min``, ...
  stand for the new ones, and the layer types ``mamba`` / ``attention`` for ``linear_attention`` /
  ``full_attention``, as transformers maps them.

Multi-token prediction (Nemotron 3 Super and Ultra; transformers 5.23 declares the fields, builds
nothing and drops the ``mtp.*`` tensors): ``num_nextn_predict_layers`` modules (at most 1, as vLLM's
``nemotron_h_mtp`` reads; Megatron-Bridge repeats that one module for further depths, with shared
weights), each a run of ``mtp_layers_block_type`` layers (default ``[full_attention, moe]``; the legacy
``mtp_hybrid_override_pattern`` string, ``*E``, as transformers maps it), of the main model's layer
kinds: zoo's ``spec.mtp`` with ``layer`` the list of those kinds. Its tensors, as vLLM names them
(zoo.checkpoints.hf.mtp.NEMOTRON_H)::

    mtp.layers.0.{enorm, hnorm, eh_proj}.weight        the fusion, in the first layer
    mtp.layers.{j}.norm.weight, mtp.layers.{j}.mixer.*  layer j of the module, as a main layer's
    mtp.layers.{last}.final_layernorm.weight           the head's norm, in the last layer

and the main model's embedding and head (no copies). ``mlp_bias`` with MoE layers is refused by name
(zoo's stacked experts and their shared expert have no biases).
"""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.common import activation, activation_name, pattern
from zoo.checkpoints.hf.format import CheckpointFormat, Fields
from zoo.checkpoints.hf.formats.mamba2 import MIXER_TENSORS, Mamba2Format
from zoo.checkpoints.hf.maps import ZOO_LAYER, ZOO_MIXER, rule, stacked_experts
from zoo.checkpoints.hf.mtp import NEMOTRON_H, mtp_rules, read_mtp
from zoo.core.spec import ModelSpec, SpecError
from zoo.model.mtp import mtp_layer_kinds

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY_TYPES = {"mamba": MAMBA, "attention": ATTENTION}
#: Older field names transformers still reads, and the field each stands for.
LEGACY_FIELDS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                 "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
                 "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                 "mamba_chunk_size": "chunk_size"}
#: Declared by NemotronHConfig, read by nothing zoo builds (see the module docstring), or belonging
#: to the MoE layers where there are none.
UNUSED = ("expand", "time_step_limit", "mamba_proj_bias", "attention_bias", "sliding_window", "residual_in_fp32",
          "rescale_prenorm_residual", "use_mamba_kernels", "num_logits_to_keep", "mamba_ssm_cache_dtype",
          "output_router_logits", "n_shared_experts", "moe_shared_expert_overlap", "num_hidden_layers")
#: NemotronHConfig's MTP layers when mtp_layers_block_type is not given.
MTP_DEFAULT = [ATTENTION, MOE]
KINDS = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}
#: Spec paths (under ``layers.``, or within any layer kind) -> the config field they are read from.
SPEC_FIELDS = {
    **{f"mamba.mixer.{k}": v for k, v in {
        "n_heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state_size": "ssm_state_size",
        "n_groups": "n_groups", "conv_kernel": "conv_kernel", "chunk_size": "chunk_size",
        "norm_eps": "layer_norm_epsilon", "dt_min": "time_step_min", "dt_limit_min": "time_step_min",
        "dt_max": "time_step_max", "dt_floor": "time_step_floor"}.items()},
    "attention.mixer.n_heads": "num_attention_heads", "attention.mixer.n_kv_heads": "num_key_value_heads",
    "attention.mixer.head_dim": "head_dim", "mlp.ffn.d_ff": "intermediate_size",
    "moe.ffn.n_experts": "n_routed_experts", "moe.ffn.top_k": "num_experts_per_tok", "moe.ffn.d_ff": "moe_intermediate_size",
    "moe.ffn.shared_d_ff": "moe_shared_expert_intermediate_size", "moe.ffn.latent_dim": "moe_latent_size",
    "vocab_size": "vocab_size", "d_model": "hidden_size", "max_seq_len": "max_position_embeddings",
}
#: The MoE layers' fields (read, and changing nothing, where there are none).
MOE_FIELDS = ("n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
              "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")
H = "backbone.layers.{i}."


class NemotronH(CheckpointFormat):
    model_type, architecture = "nemotron_h", "NemotronHForCausalLM"
    base_prefix = "backbone."
    # NemotronHConfig's defaults for absent fields.
    defaults = {"vocab_size": 131072, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "max_position_embeddings": 4096, "intermediate_size": 21504, "mlp_hidden_act": "relu2",
                "mlp_bias": False, "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64,
                "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
                "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "use_conv_bias": True,
                "use_bias": False, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
                "num_nextn_predict_layers": 0, "n_routed_experts": 8, "moe_intermediate_size": 7688,
                "moe_shared_expert_intermediate_size": 7688, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
                "n_group": 1, "topk_group": 1, "norm_topk_prob": True}
    random_buffers = ("e_score_correction_bias",)  # the MoE routers' selection bias
    # Every kind of layer, attention after Mamba state and between MLPs; two groups of two heads, chunks
    # shorter than the test sequences, GQA with head_dim != hidden_size / heads. The step's lower clamp
    # (time_step_min) is put out of reach: transformers' one-token step ignores it, so its decoding departs
    # from its own forward where it binds (tests/formats/test_nemotron_h.py checks zoo there).
    tiny = {"vocab_size": 128, "hidden_size": 32, "layers_block_type": [MAMBA, MLP, ATTENTION, MAMBA, MLP, MAMBA],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "intermediate_size": 48,
            "mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8,
            "max_position_embeddings": 64, "tie_word_embeddings": False, "time_step_min": 1e-8}

    # A Mamba-2 tensor whose shape contradicts the config names the field (as the mamba2 format does).
    heads_field, state_field = "mamba_num_heads", "ssm_state_size"
    shape_hint = Mamba2Format.shape_hint

    # -- the weight-name map ----------------------------------------------------------------------
    def rules(self, spec):
        rules = self.main_rules(spec)
        return mtp_rules(rules, spec, NEMOTRON_H, hf_layer=H) + rules

    def main_rules(self, spec):
        m = f"{H}mixer."
        return [
            rule("backbone.embeddings.weight", "embed.weight"),
            rule("backbone.norm_f.weight", "final_norm.weight"),
            rule("lm_head.weight", "lm_head.weight"),
            # one norm per layer: the mixer's in mixer_only, the FFN's in ffn_only
            rule(f"{H}norm.weight", f"{ZOO_LAYER}attn_norm.weight"),
            rule(f"{H}norm.weight", f"{ZOO_LAYER}ffn_norm.weight"),
            *[rule(f"{m}{t}", f"{ZOO_MIXER}{t}") for t in MIXER_TENSORS],
            *[rule(f"{m}{p}_proj.weight", f"{ZOO_MIXER}{p}_proj.weight") for p in "qkvo"],
            rule(f"{m}up_proj.weight", f"{ZOO_LAYER}ffn.up.weight"), rule(f"{m}up_proj.bias", f"{ZOO_LAYER}ffn.up.bias"),
            rule(f"{m}down_proj.weight", f"{ZOO_LAYER}ffn.down.weight"), rule(f"{m}down_proj.bias", f"{ZOO_LAYER}ffn.down.bias"),
            rule(f"{m}gate.weight", f"{ZOO_LAYER}ffn.router.weight"),
            rule(f"{m}gate.e_score_correction_bias", f"{ZOO_LAYER}ffn.router.bias"),
            *(stacked_experts(f"{m}experts.", spec.layers["moe"].ffn.n_experts, {"w_up": "up_proj", "w_down": "down_proj"})
              if "moe" in spec.layers else []),
            *[rule(f"{m}shared_experts.{p}_proj.weight", f"{ZOO_LAYER}ffn.shared.{p}.weight") for p in ("up", "down")],
            *[rule(f"{m}fc{n}_latent_proj.{w}", f"{ZOO_LAYER}ffn.latent_{z}.{w}")
              for n, z in ((1, "down"), (2, "up")) for w in ("weight", "bias")],
        ]

    # -- config -> spec ---------------------------------------------------------------------------
    def layer_types(self, f: Fields) -> list[str]:
        listed = next((k for k in ("layers_block_type", "layer_types") if k in f), None)  # (an alias in transformers)
        if listed is not None:
            types, key = f.get(listed, kind=list), listed
            f.get("hybrid_override_pattern")  # transformers takes the list when both are given
        elif "hybrid_override_pattern" in f:
            key, text = "hybrid_override_pattern", f.get("hybrid_override_pattern", kind=str)
            bad = sorted(set(text) - set(PATTERN))
            if bad:
                raise f.error(key, f"has {bad[0]!r}; expected M (Mamba-2), * (attention), - (MLP) or E (MoE)")
            types = [PATTERN[c] for c in text]
        else:  # NemotronHConfig's default schedule
            types, key = [MAMBA, MOE, ATTENTION, MLP], "layers_block_type"
        types = [LEGACY_TYPES.get(t, t) for t in types]
        for t in types:
            if t not in KINDS:
                raise f.error(key, f"layer type {t!r} is not one of {sorted(KINDS)}")
        return types

    def mtp(self, f: Fields, types: list[str]):
        """The spec's ``mtp`` table (None without MTP): ``num_nextn_predict_layers`` modules of the
        ``mtp_layers_block_type`` layers, read as transformers reads them."""
        key = "mtp_layers_block_type"
        listed = f.get(key, kind=list)
        if listed is not None and not all(isinstance(t, str) for t in listed):
            raise f.error(key, f"must list layer type names, got {listed!r}")
        text = f.get("mtp_hybrid_override_pattern", kind=str)
        mtp = read_mtp(f)
        if listed is None or [LEGACY_TYPES.get(t, t) for t in listed] == MTP_DEFAULT:
            if text is not None:  # transformers takes the pattern where the list is its default
                bad = sorted(set(text) - set(PATTERN))
                if bad:
                    raise f.error("mtp_hybrid_override_pattern", f"has {bad[0]!r}; expected M (Mamba-2), * (attention), "
                                                                 "- (MLP) or E (MoE)")
                listed, key = [PATTERN[c] for c in text], "mtp_hybrid_override_pattern"
        listed = [LEGACY_TYPES.get(t, t) for t in (MTP_DEFAULT if listed is None else listed)]
        if not mtp:
            return None
        if mtp["depth"] > 1:
            raise f.error("num_nextn_predict_layers", f"is {mtp['depth']}; a nemotron_h checkpoint stores one MTP module "
                                                      "(vLLM reads one; Megatron repeats it, sharing its weights), so "
                                                      "zoo reads at most 1")
        if not listed:
            raise f.error(key, "lists no layers; an MTP module needs at least one")
        for t in listed:
            if t not in KINDS:
                raise f.error(key, f"layer type {t!r} is not one of {sorted(KINDS)}")
            if t not in types:
                raise f.error(key, f"layer type {t!r} is not a layer of the main model (layers_block_type); zoo builds "
                                   "the MTP layers as the main model's layers of their type")
        return {**mtp, "layer": [KINDS[t] for t in listed]}

    def config_to_spec(self, config, *, strict=False):
        config = dict(config)
        for old, new in LEGACY_FIELDS.items():  # transformers lets the old name win, as here
            if old in config:
                config[new] = config.pop(old)
        f = Fields(config, self.model_type, self.defaults)
        types = self.layer_types(f)
        d, eps = f.require("hidden_size"), float(f.get("layer_norm_epsilon"))
        f.expect("mamba_hidden_act", ("silu",), "Mamba-2's convolution and gate use SiLU")
        mtp = self.mtp(f, types)
        for key in UNUSED:
            f.get(key)
        norm = {"name": "rmsnorm", "eps": eps, "scale_in_fp32": True}  # weight times the fp32 normed x
        layers: dict[str, Any] = {}
        if MAMBA in types:
            layers["mamba"] = {"mixer": {
                "name": "mamba2", "n_heads": f.require("mamba_num_heads"), "head_dim": f.require("mamba_head_dim"),
                "state_size": f.require("ssm_state_size"), "n_groups": f.require("n_groups"),
                "conv_kernel": f.require("conv_kernel"), "chunk_size": f.require("chunk_size"),
                "bias": f.get("use_bias", False), "conv_bias": f.get("use_conv_bias", True), "norm_eps": eps,
                "dt_limit_min": float(f.get("time_step_min", 0.001)), "dt_limit_max": None,
                "dt_min": float(f.get("time_step_min", 0.001)), "dt_max": float(f.get("time_step_max", 0.1)),
                "dt_floor": float(f.get("time_step_floor", 1e-4)),
            }, "norm": norm, "block": "mixer_only"}
        if ATTENTION in types:
            layers["attention"] = {"mixer": {
                "name": "attention", "n_heads": f.require("num_attention_heads"),
                "n_kv_heads": f.require("num_key_value_heads"), "head_dim": f.require("head_dim"),
            }, "norm": norm, "block": "mixer_only"}
        if MOE in types:
            if f.get("mlp_bias", False):
                raise f.error("mlp_bias", "zoo's stacked experts and their shared expert have no biases")
            latent = f.get("moe_latent_size", kind=int)
            d_model = f.require("hidden_size")
            if latent is not None and not 0 < latent < d_model:
                raise f.error("moe_latent_size", f"{latent} does not fit: the latent projects the token down, so it "
                                                 f"is narrower than hidden_size {d_model}")
            expert = {"name": "mlp", "activation": activation(f, "mlp_hidden_act", "relu2"), "bias": False}
            moe = {"name": "moe", "n_experts": f.require("n_routed_experts"), "top_k": f.require("num_experts_per_tok"),
                   "d_ff": f.require("moe_intermediate_size"), "expert": expert,
                   "router": {"name": "sigmoid_group", "n_groups": f.require("n_group"),
                              "topk_group": f.require("topk_group")},
                   "norm_topk_prob": f.get("norm_topk_prob", True),
                   "routed_scaling": float(f.get("routed_scaling_factor", 1.0)),
                   "shared_d_ff": f.require("moe_shared_expert_intermediate_size"), "latent_dim": latent}
            layers["moe"] = {"mixer": "none", "ffn": moe, "norm": norm, "block": "ffn_only"}
        for key in MOE_FIELDS:
            f.get(key)
        if MLP in types:
            layers["mlp"] = {"mixer": "none", "ffn": {"name": "mlp", "d_ff": f.require("intermediate_size"),
                                     "activation": activation(f, "mlp_hidden_act", "relu2"),
                                     "bias": f.get("mlp_bias", False)},
                             "norm": norm, "block": "ffn_only"}
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": len(types),
            "max_seq_len": f.require("max_position_embeddings"), "position": "nope", "final_norm": norm,
            "layers": layers, "layer_pattern": list(pattern([KINDS[t] for t in types])),
            "head": {"tied": f.get("tie_word_embeddings", False)},
            **({"mtp": mtp} if mtp else {}),
        }
        f.finish(strict)
        try:
            return ModelSpec.from_dict(spec)
        except SpecError as exc:  # a value out of range: name the config field behind it
            field = "mtp_layers_block_type" if exc.path.startswith("mtp.") else \
                SPEC_FIELDS.get(exc.path.removeprefix("layers."), "config")
            raise f.error(field, str(exc)) from None

    # -- spec -> config ---------------------------------------------------------------------------
    @staticmethod
    def layer_type(layer, where: str):
        """A layer's nemotron_h type and the part that configures it."""
        if layer.block.name == "ffn_only" and layer.ffn.name == "mlp":
            return MLP, layer.ffn
        if layer.block.name == "ffn_only" and layer.ffn.name == "moe":
            return MOE, layer.ffn
        if layer.block.name == "mixer_only" and layer.mixer.name == "mamba2":
            return MAMBA, layer.mixer
        if layer.block.name == "mixer_only" and layer.mixer.name == "attention":
            return ATTENTION, layer.mixer
        raise ValueError(f"nemotron_h's layers are a mamba2 or attention mixer in a mixer_only block, or an "
                         f"mlp in an ffn_only block; {where} is {layer.mixer.name!r} / {layer.ffn.name!r} "
                         f"in {layer.block.name!r}")

    def spec_to_config(self, spec):
        if spec.position.name != "nope":
            raise ValueError("nemotron_h has no position encoding")
        types, parts = [], {}
        for i in range(spec.n_layers):
            layer = spec.layer(i)
            kind, part = self.layer_type(layer, f"layer {i}")
            if repr(parts.setdefault(kind, part)) != repr(part):
                raise ValueError(f"nemotron_h has one configuration per kind of layer; layer {i}'s {kind} differs")
            types.append(kind)
        norms = {repr(spec.layer(i).norm) for i in range(spec.n_layers)} | {repr(spec.final_norm)}
        norm = spec.layer(0).norm
        if len(norms) > 1 or norm.name != "rmsnorm" or not norm.scale_in_fp32:
            raise ValueError("nemotron_h uses one RMSNorm (weight applied in float32) for every layer and the final norm")
        cfg: dict[str, Any] = {
            "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "layers_block_type": types,
            "max_position_embeddings": spec.max_seq_len, "layer_norm_epsilon": norm.eps,
            "tie_word_embeddings": spec.head.tied, "num_nextn_predict_layers": 0,
        }
        if spec.mtp is not None:
            if spec.mtp.depth > 1:
                raise ValueError(f"nemotron_h stores one MTP module; this spec has mtp.depth = {spec.mtp.depth}")
            cfg["num_nextn_predict_layers"] = 1
            cfg["mtp_layers_block_type"] = [self.layer_type(spec.layers[k], f"MTP layer kind {k!r}")[0]
                                            for k in mtp_layer_kinds(spec)]
        if MAMBA in parts:
            m = parts[MAMBA]
            if m.dt_limit_max is not None or m.norm_eps != norm.eps or m.dt_limit_min != m.dt_min:
                raise ValueError("nemotron_h's Mamba-2 layers clamp the step to [time_step_min, inf) and share the "
                                 "layers' RMSNorm epsilon")
            cfg.update({"mamba_num_heads": m.n_heads, "mamba_head_dim": m.head_dim, "ssm_state_size": m.state_size,
                        "n_groups": m.n_groups, "conv_kernel": m.conv_kernel, "chunk_size": m.chunk_size,
                        "use_bias": m.bias, "use_conv_bias": m.conv_bias, "mamba_hidden_act": "silu",
                        "time_step_min": m.dt_min, "time_step_max": m.dt_max, "time_step_floor": m.dt_floor})
        if ATTENTION in parts:
            a = parts[ATTENTION]
            if a.bias or a.out_bias or a.window or a.softcap or a.qk_norm != "none" or a.output_gate or a.scale_dim:
                raise ValueError("nemotron_h's attention has no biases, window, soft-cap, QK-norm, gate or scale")
            cfg.update({"num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads or a.n_heads,
                        "head_dim": a.head_dim or spec.d_model // a.n_heads})
        if MLP in parts:
            p = parts[MLP]
            cfg.update({"intermediate_size": p.d_ff, "mlp_hidden_act": activation_name(p.activation),
                        "mlp_bias": p.bias})
        if MOE in parts:
            m = parts[MOE]
            act = activation_name(m.expert.activation)
            if m.expert.name != "mlp" or (MLP in parts and act != cfg["mlp_hidden_act"]) or cfg.get("mlp_bias"):
                raise ValueError("nemotron_h's experts are non-gated MLPs without biases, of the MLP layers' activation")
            r = m.router
            if r.name != "sigmoid_group" or not r.selection_bias or m.shared_d_ff is None or m.shared_gate \
                    or m.latent_bias or any(getattr(m, k) for k in ("switch_loss", "switch_pooled_loss",
                                                                    "sequence_loss", "device_loss", "z_loss")) \
                    or m.bias_update != "none" or m.capacity_factor is not None:
                raise ValueError("nemotron_h's MoE routes with 'sigmoid_group' and its selection bias, has an ungated "
                                 "shared expert and no latent biases, balance losses, bias updates or capacity factor")
            cfg.update({"n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.d_ff,
                        "moe_shared_expert_intermediate_size": m.shared_d_ff, "moe_latent_size": m.latent_dim,
                        "n_group": r.n_groups, "topk_group": r.topk_group, "norm_topk_prob": m.norm_topk_prob,
                        "routed_scaling_factor": m.routed_scaling, "mlp_hidden_act": act,
                        "mlp_bias": cfg.get("mlp_bias", False)})
        return cfg


FORMATS = [NemotronH()]
