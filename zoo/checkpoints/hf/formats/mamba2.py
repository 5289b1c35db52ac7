"""Mamba-2 checkpoints: transformers' ``mamba2`` (Mamba-Codestral) and the original ``mamba_ssm``
layout that ``state-spaces/mamba2-*`` are released in.

Every layer is ``x + mixer(RMSNorm(x))`` with the ``mamba2`` mixer and no FFN (block ``mixer_only``),
no position encoding, a final RMSNorm, and a head tied or not. Tensor names::

    backbone.embeddings.weight                    (mamba_ssm: backbone.embedding.weight)
    backbone.layers.{i}.norm.weight
    backbone.layers.{i}.mixer.{in_proj, conv1d, out_proj}.{weight, bias}, .dt_bias, .A_log, .D, .norm.weight
    backbone.norm_f.weight, lm_head.weight

``residual_in_fp32`` is read and needs nothing: zoo's residual stream is in the model's dtype, which
is float32 wherever parity is checked (in bfloat16 transformers adds the residual in float32).
``time_step_min``/``max``/``floor`` and ``rescale_prenorm_residual`` only initialise weights;
``time_step_rank`` is computed by transformers and used by nothing.

A ``mamba_ssm`` config.json has no ``model_type``: it is recognised by its ``d_model``, ``n_layer``
and ``ssm_cfg``, and read as transformers' conversion script reads it (the vocabulary padded up to
``pad_vocab_size_multiple``, the mixer's settings from ``ssm_cfg`` with ``mamba_ssm``'s defaults).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from zoo.checkpoints.hf.format import CheckpointFormat, ConfigError, Fields
from zoo.checkpoints.hf.maps import ZOO_LAYER, ZOO_MIXER, rule
from zoo.core.spec import ModelSpec

H = "backbone.layers.{i}."
MIXER_TENSORS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                 "norm.weight", "out_proj.weight", "out_proj.bias")
#: Infinity as transformers writes it in config.json (plain JSON has no infinity); it also reads a bare
#: ``Infinity``, as Python's json module writes it (Mamba-Codestral's config has that).
INFINITY = {"__float__": "Infinity"}


def _special_float(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return {"Infinity": math.inf, "-Infinity": -math.inf}.get(value["__float__"], value)
    return value


#: No positions of its own: generation and verification take any length.
MAX_SEQ_LEN = 1 << 20


class Mamba2Format(CheckpointFormat):
    model_type, architecture = "mamba2", "Mamba2ForCausalLM"
    hidden_states_skip_embeddings = True  # transformers' output_hidden_states (zoo verify lines them up)
    base_prefix = "backbone."
    ignore = ("lm_head.weight",)  # a tied head's stored copy
    # Mamba2Config's defaults for absent fields.
    defaults = {"num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
                "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 8,
                "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "residual_in_fp32": True,
                "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
                "time_step_limit": [0.0, math.inf], "chunk_size": 256, "tie_word_embeddings": False}
    # Two groups of two heads, a chunk shorter than test sequences, biases everywhere, a dt limit reached.
    # Two groups of two heads, chunks shorter than the test sequences. (Biases and a dt limit that is
    # reached are checked in tests/parts/test_mamba2.py: transformers' padding leaks in_proj's bias into the
    # convolution, and its one-token step ignores the limit.)
    tiny = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 8,
            "expand": 2, "state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8,
            "tie_word_embeddings": False}

    @staticmethod
    def recognises(config: dict[str, Any]) -> bool:
        """A ``mamba_ssm`` config.json: no ``model_type``, but ``d_model``, ``n_layer`` and ``ssm_cfg``."""
        return not config.get("model_type") and {"d_model", "n_layer", "ssm_cfg"} <= set(config)

    def unwrap(self, config):
        if not self.recognises(config):
            return config, {}
        return ssm_layout_to_config(config), {"backbone.embedding.": "backbone.embeddings."}

    def rules(self, spec):
        return [
            rule("backbone.embeddings.weight", "embed.weight"),
            rule(f"{H}norm.weight", f"{ZOO_LAYER}attn_norm.weight"),
            *[rule(f"{H}mixer.{t}", f"{ZOO_MIXER}{t}") for t in MIXER_TENSORS],
            rule("backbone.norm_f.weight", "final_norm.weight"),
            rule("lm_head.weight", "lm_head.weight"),
        ]

    # The config fields of the mixer's heads and state width (named by shape_hint).
    heads_field, state_field = "num_heads", "state_size"

    def shape_hint(self, spec, zoo_name: str, shape: tuple) -> Optional[str]:
        """The config field a Mamba-2 mixer tensor's shape contradicts: in_proj's rows are 2 H P + 2 G N + H,
        the convolution's channels H P + 2 G N, A_log, D and dt_bias have H entries."""
        i = int(zoo_name.split(".")[1]) if zoo_name.startswith("layers.") else None
        if i is None or spec.layer(i).mixer.name != "mamba2":
            return None
        m = spec.layer(i).mixer
        H, P, G, N = m.n_heads, m.head_dim, m.n_groups, m.state_size
        if zoo_name.endswith(("A_log", "D", "dt_bias")):
            return f"the weights have {self.heads_field} = {shape[0]}, config.json says {H}"
        rows = {"in_proj.weight": 2 * H * P + H, "conv1d.weight": H * P}
        for name, rest in rows.items():
            if zoo_name.endswith(name) and (shape[0] - rest) % (2 * G) == 0:
                n = (shape[0] - rest) // (2 * G)
                if n != N:
                    return f"the weights have {self.state_field} = {n} (with n_groups = {G}), config.json says {N}"
        return None

    def config_to_spec(self, config, *, strict=False):
        config = self.unwrap(config)[0]
        f = Fields(config, self.model_type, self.defaults)
        d, heads, head_dim = f.positive("hidden_size"), f.positive("num_heads"), f.positive("head_dim")
        expand = f.positive("expand")
        if heads * head_dim != expand * d:
            raise f.error("num_heads", f"num_heads * head_dim = {heads} * {head_dim} must equal expand * hidden_size "
                                       f"= {expand} * {d} (transformers refuses it too)")
        f.expect("hidden_act", ("silu",), "Mamba-2's convolution and gate use SiLU")
        limit = [_special_float(v) for v in f.get("time_step_limit", kind=list)]
        if len(limit) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit):
            raise f.error("time_step_limit", f"must be two numbers [min, max], got {limit!r}")
        eps = float(f.get("layer_norm_epsilon", 1e-5))
        for key in ("residual_in_fp32", "rescale_prenorm_residual", "time_step_rank"):
            f.get(key)  # see the module docstring: nothing to build
        mixer = {
            "name": "mamba2", "n_heads": heads, "head_dim": head_dim, "state_size": f.require("state_size"),
            "n_groups": f.require("n_groups"), "conv_kernel": f.require("conv_kernel"),
            "chunk_size": f.require("chunk_size"), "bias": f.get("use_bias", False),
            "conv_bias": f.get("use_conv_bias", True), "norm_eps": eps,
            "dt_limit_min": float(limit[0]), "dt_limit_max": None if math.isinf(limit[1]) else float(limit[1]),
            "dt_min": float(f.get("time_step_min", 0.001)), "dt_max": float(f.get("time_step_max", 0.1)),
            "dt_floor": float(f.get("time_step_floor", 1e-4)),
        }
        norm = {"name": "rmsnorm", "eps": eps}
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": f.require("num_hidden_layers"),
            "max_seq_len": MAX_SEQ_LEN, "position": "nope", "final_norm": norm,
            "layers": {"default": {"mixer": mixer, "norm": norm, "block": "mixer_only"}},
            "head": {"tied": f.get("tie_word_embeddings", False)},
        }
        f.finish(strict)
        try:
            return ModelSpec.from_dict(spec)
        except ValueError as exc:  # a mixer setting out of range: name the config field behind it
            raise ConfigError(_config_field(str(exc)), str(exc), self.model_type) from None

    def spec_to_config(self, spec):
        layer = spec.layer(0)
        if len(spec.layers) != 1 or layer.mixer.name != "mamba2" or layer.block.name != "mixer_only":
            raise ValueError("mamba2 has one kind of layer: a mamba2 mixer in a mixer_only block")
        if spec.position.name != "nope":
            raise ValueError("mamba2 has no position encoding")
        m, norm = layer.mixer, layer.norm
        if norm.name != "rmsnorm" or spec.final_norm is None or spec.final_norm != norm or m.norm_eps != norm.eps:
            raise ValueError("mamba2 uses one RMSNorm epsilon for the layers, the final norm and the gated norm")
        d = spec.d_model
        if (m.n_heads * m.head_dim) % d:
            raise ValueError(f"mamba2 needs n_heads * head_dim ({m.n_heads * m.head_dim}) to be a multiple of d_model {d}")
        return {
            "vocab_size": spec.vocab_size, "hidden_size": d, "num_hidden_layers": spec.n_layers,
            "num_heads": m.n_heads, "head_dim": m.head_dim, "expand": m.n_heads * m.head_dim // d,
            "state_size": m.state_size, "n_groups": m.n_groups, "conv_kernel": m.conv_kernel,
            "chunk_size": m.chunk_size, "use_bias": m.bias, "use_conv_bias": m.conv_bias,
            "layer_norm_epsilon": norm.eps, "hidden_act": "silu",
            "time_step_limit": [m.dt_limit_min, INFINITY if m.dt_limit_max is None else m.dt_limit_max],
            "time_step_min": m.dt_min, "time_step_max": m.dt_max, "time_step_floor": m.dt_floor,
            "tie_word_embeddings": spec.head.tied,
        }


# The mixer settings and the mamba2 config fields they come from (to name the field of a bad value).
_FIELDS = {"n_heads": "num_heads", "head_dim": "head_dim", "state_size": "state_size", "n_groups": "n_groups",
           "conv_kernel": "conv_kernel", "chunk_size": "chunk_size", "dt_limit": "time_step_limit",
           "norm_eps": "layer_norm_epsilon", "dt_min": "time_step_min", "dt_max": "time_step_max",
           "dt_floor": "time_step_floor"}


def _config_field(message: str) -> str:
    for setting, field in _FIELDS.items():
        if f".{setting}" in message.split(":")[0]:
            return field
    return "config"


# mamba_ssm's Mamba2 defaults (mamba_ssm.modules.mamba2.Mamba2) for what ssm_cfg leaves out.
SSM_DEFAULTS = {"layer": "Mamba2", "d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1,
                "chunk_size": 256, "bias": False, "conv_bias": True, "dt_min": 0.001, "dt_max": 0.1,
                "dt_init_floor": 1e-4, "dt_limit": [0.0, math.inf], "rmsnorm": True, "norm_before_gate": False,
                "D_has_hdim": False, "d_ssm": None}
# MambaConfig's defaults (mamba_ssm.models.config_mamba) for what the config leaves out.
LAYOUT_DEFAULTS = {"d_intermediate": 0, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                   "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
                   "tie_embeddings": True}


class _SsmCfg(Fields):
    """The fields of ``ssm_cfg``, named as such in errors."""

    def error(self, key, message):
        return ConfigError(f"ssm_cfg.{key}", message, "mamba_ssm")


def ssm_layout_to_config(config: dict[str, Any]) -> dict[str, Any]:
    """The transformers ``mamba2`` config of a ``mamba_ssm`` config.json, as transformers' conversion
    script writes it; every field read, what zoo cannot express refused by name."""
    f = Fields({k: v for k, v in config.items() if k != "model_type"}, "mamba_ssm", LAYOUT_DEFAULTS)
    d = f.positive("d_model")
    s = _SsmCfg(f.get("ssm_cfg", {}, kind=dict), "mamba_ssm", SSM_DEFAULTS)
    s.expect("layer", ("Mamba2",), "zoo reads Mamba-2 checkpoints (Mamba-1 has another mixer)")
    s.expect("rmsnorm", (True,), "Mamba-2's gated norm is an RMSNorm")
    s.expect("norm_before_gate", (False,), "zoo's gated norm gates, then normalises")
    s.expect("D_has_hdim", (False,), "zoo's D skip has one value per head")
    expand, headdim = s.positive("expand"), s.positive("headdim")
    if expand * d % headdim:  # mamba_ssm asserts it: the inner width splits into heads of headdim
        raise s.error("headdim", f"{headdim} does not divide expand * d_model = {expand} * {d} = {expand * d}")
    d_ssm = s.get("d_ssm", kind=int)
    if d_ssm is not None and d_ssm != expand * d:
        raise s.error("d_ssm", f"{d_ssm} differs from expand * d_model = {expand * d}: zoo's Mamba-2 layer "
                               "runs its SSM over the whole inner width")
    f.expect("d_intermediate", (0,), "a Mamba-2 layer of this layout has no MLP")
    if f.get("attn_layer_idx", [], kind=list):
        raise f.error("attn_layer_idx", "attention layers in a mamba_ssm model are not read by zoo; "
                                        "write the hybrid as a recipe (see zoo/families/nemotron_h_style.toml)")
    f.get("attn_cfg", {}, kind=dict)  # configures the attention layers, of which there are none
    f.expect("rms_norm", (True,), "Mamba-2 models use RMSNorm")
    f.get("fused_add_norm")  # a kernel choice: the same function
    multiple = f.positive("pad_vocab_size_multiple", 8)
    vocab = f.require("vocab_size")
    inner = {
        "model_type": "mamba2", "hidden_size": d, "num_hidden_layers": f.require("n_layer"),
        "vocab_size": vocab + (-vocab) % multiple, "num_heads": expand * d // headdim, "head_dim": headdim,
        "expand": expand, "state_size": s.positive("d_state"), "n_groups": s.positive("ngroups"),
        "conv_kernel": s.positive("d_conv"), "chunk_size": s.positive("chunk_size"),
        "use_bias": s.get("bias", False), "use_conv_bias": s.get("conv_bias", True),
        "time_step_min": s.get("dt_min", 0.001), "time_step_max": s.get("dt_max", 0.1),
        "time_step_floor": s.get("dt_init_floor", 1e-4),
        "time_step_limit": [_special_float(v) for v in s.get("dt_limit", kind=list)],
        "residual_in_fp32": f.get("residual_in_fp32", True), "tie_word_embeddings": f.get("tie_embeddings", True),
        "layer_norm_epsilon": 1e-5,  # mamba_ssm's norm_epsilon, which its config does not carry
    }
    s.finish()
    f.finish()
    try:  # a value the mamba2 reading refuses is named by its mamba_ssm field
        Mamba2Format().config_to_spec(inner)
    except ConfigError as exc:
        field = SSM_NAMES.get(exc.field, exc.field)
        raise ConfigError(field, str(exc).split(": ", 1)[1], "mamba_ssm") from None
    return inner


#: The transformers mamba2 field -> the mamba_ssm field it is converted from.
SSM_NAMES = {"hidden_size": "d_model", "num_hidden_layers": "n_layer", "num_heads": "ssm_cfg.headdim",
             "head_dim": "ssm_cfg.headdim", "expand": "ssm_cfg.expand", "state_size": "ssm_cfg.d_state",
             "n_groups": "ssm_cfg.ngroups", "conv_kernel": "ssm_cfg.d_conv", "chunk_size": "ssm_cfg.chunk_size",
             "use_bias": "ssm_cfg.bias", "use_conv_bias": "ssm_cfg.conv_bias", "time_step_min": "ssm_cfg.dt_min",
             "time_step_max": "ssm_cfg.dt_max", "time_step_floor": "ssm_cfg.dt_init_floor",
             "time_step_limit": "ssm_cfg.dt_limit", "tie_word_embeddings": "tie_embeddings"}


FORMATS = [Mamba2Format()]
