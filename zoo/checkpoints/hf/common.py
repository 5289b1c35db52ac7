"""Config pieces shared by several formats: RoPE parameters, activations, layer types, norms."""

from __future__ import annotations

from typing import Any, Optional

from zoo.checkpoints.hf.format import KINDS, Fields, is_kind
from zoo.core.spec import ModelSpec, Part

# HF activation names -> zoo activation parts. GPT-2's gelu_new and gelu_fast are the tanh form.
ACTIVATIONS = {
    "silu": {"name": "silu"},
    "swish": {"name": "silu"},
    "gelu": {"name": "gelu"},
    "gelu_pytorch_tanh": {"name": "gelu", "approximate": "tanh"},
    "gelu_new": {"name": "gelu", "approximate": "tanh"},
    "gelu_fast": {"name": "gelu", "approximate": "tanh"},
    "relu": {"name": "relu"},
}


def hf_activations(extra: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, dict[str, Any]]:
    """HF activation name -> zoo activation part: the built-in table, then each registered
    activation's own ``hf_names`` (``{"relu2": {}}``: HF name -> that part's config), then ``extra``
    (a format's own names). A plugin's activation is nameable in configs by declaring ``hf_names``."""
    from zoo.core import registry

    table = dict(ACTIVATIONS)
    for entry in registry.registry("activation").entries():
        for hf_name, config in entry.obj.hf_names.items():
            table.setdefault(hf_name, {"name": entry.name, **config})
    table.update(extra or {})
    return table


def activation(f: Fields, key: str, default: str, extra: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    """Read the HF activation name in field ``key`` (``default`` when absent) as a zoo activation
    part; a name no table knows is an error naming the field. ``extra`` adds a format's own names."""
    try:
        return hf_activation(f.get(key, default), extra)
    except ValueError as exc:
        raise f.error(key, str(exc)) from None


def hf_activation(name: str, extra: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    """The zoo activation part an HF activation name stands for; ValueError for a name no table knows."""
    table = hf_activations(extra)
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(table)}")
    return dict(table[name])


def activation_name(part: Part, extra: Optional[dict[str, dict[str, Any]]] = None) -> str:
    """The HF name of a zoo activation part (inverse of :func:`activation`): the first name whose
    part is exactly this one; the part's own name when no table has it."""
    from zoo.core.spec import parse_part

    for hf_name, entry in hf_activations(extra).items():
        if entry["name"] == part.name and parse_part("activation", entry, hf_name) == part:
            return hf_name
    return part.name


ROPE_KEYS = {
    "default": {},
    "linear": {"factor": "factor"},
    "dynamic": {"factor": "factor"},
    "yarn": {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
             "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
             "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"},
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "original_max_position_embeddings": "original_max_seq_len"},
}
ZOO_SCALING = {"linear": "linear", "dynamic": "dynamic_ntk", "yarn": "yarn", "llama3": "llama3"}


def rope_parameters(f: Fields, layer_type: Optional[str] = None) -> dict[str, Any]:
    """The RoPE parameters as transformers 5 stores them (``rope_parameters``), also from the older
    top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` fields."""
    if "rope_parameters" in f:
        params = f.get("rope_parameters", kind=dict)
        if layer_type is not None and layer_type in params:
            if not isinstance(params[layer_type], dict):
                raise f.error(f"rope_parameters.{layer_type}", f"must be an object, got {params[layer_type]!r}")
            return dict(params[layer_type])
        return dict(params)
    params = dict(f.get("rope_scaling", {}))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = f.get("rope_theta", 10000.0)
    if "partial_rotary_factor" in f:
        params["partial_rotary_factor"] = f.get("partial_rotary_factor", kind=float)
    return params


def rope_part(f: Fields, params: dict[str, Any], *, max_pos: int, where: str = "rope_parameters",
              layout: str = "half", rotary_dim: Optional[int] = None) -> dict[str, Any]:
    """A zoo ``rope`` position part from HF RoPE parameters; an unknown type or key is an error."""
    params = dict(params)
    for key, value in params.items():
        want = str if key in ("rope_type", "type") else bool if key == "truncate" else float
        if value is not None and not is_kind(value, want):
            raise f.error(f"{where}.{key}", f"must be {KINDS[want]}, got {value!r} (zoo does not coerce it)")
    kind = params.pop("rope_type", None) or params.pop("type", "default")
    if kind not in ROPE_KEYS:
        raise f.error(f"{where}.rope_type", f"RoPE scaling {kind!r} is not supported; supported: {', '.join(ROPE_KEYS)}")
    part: dict[str, Any] = {"name": "rope", "theta": float(params.pop("rope_theta", 10000.0)), "layout": layout}
    fraction = params.pop("partial_rotary_factor", None)
    if rotary_dim is not None:
        part["rotary_dim"] = rotary_dim
    elif fraction is not None and fraction != 1.0:
        part["rotary_fraction"] = float(fraction)
    scaling: dict[str, Any] = {}
    for hf_key, zoo_key in ROPE_KEYS[kind].items():
        if hf_key in params:
            value = params.pop(hf_key)
            if value is not None:
                scaling[zoo_key] = value
    if params:
        raise f.error(f"{where}.{sorted(params)[0]}", f"RoPE parameter not supported for rope_type {kind!r}")
    if kind == "dynamic":
        scaling["original_max_seq_len"] = max_pos  # HF's dynamic NTK grows past max_position_embeddings
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_pos / scaling["original_max_seq_len"]
    if kind != "default":
        for k in ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                  "low_freq_factor", "high_freq_factor"):
            if k in scaling:
                scaling[k] = float(scaling[k])
        if "original_max_seq_len" in scaling:
            scaling["original_max_seq_len"] = int(scaling["original_max_seq_len"])
        part["scaling"] = {"name": ZOO_SCALING[kind], **scaling}
    return part


def rope_to_hf(part: Part, head_dim: int) -> dict[str, Any]:
    """HF ``rope_parameters`` of a zoo rope part (inverse of :func:`rope_part`)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": part.theta}
    rd = part.rotary_dim if part.rotary_dim is not None else int(head_dim * part.rotary_fraction)
    if rd != head_dim:
        out["partial_rotary_factor"] = rd / head_dim
    if part.scaling is not None:
        s = part.scaling
        kind = {v: k for k, v in ZOO_SCALING.items()}[s.name]
        out["rope_type"] = kind
        for hf_key, zoo_key in ROPE_KEYS[kind].items():
            value = getattr(s.config, zoo_key, None)
            if value is not None:
                out[hf_key] = value
        if kind == "dynamic":
            out.pop("original_max_position_embeddings", None)
    return out


def pattern(types: list[str]) -> tuple[str, ...]:
    """The shortest period of a per-layer list (``layer_pattern`` repeats)."""
    n = len(types)
    for p in range(1, n + 1):
        if all(types[i] == types[i % p] for i in range(n)):
            return tuple(types[:p])
    return tuple(types)


def split_kinds(data: dict[str, Any], tags: list[str], parts: dict[str, dict[str, Any]]) -> None:
    """Split the layer kinds of spec ``data`` (its ``layers`` and ``layer_pattern``) by a per-layer
    tag: layer i of kind k becomes kind ``{k}_{tag}`` (``{tag}`` where k is ``default``), with the
    slots of ``parts[tag]`` put in (a whole slot replaced: ``{"position": {"name": "nope"}}``). With
    one tag for every layer the kinds keep their names."""
    period, n = data["layer_pattern"], data["n_layers"]
    mixed = len(set(tags)) > 1
    layers: dict[str, Any] = {}
    names = []
    for i, tag in enumerate(tags):
        base = period[i % len(period)]
        name = base if not mixed else (tag if base == "default" else f"{base}_{tag}")
        if name not in layers:
            layers[name] = {**data["layers"][base], **parts.get(tag, {})}
        names.append(name)
    data["layers"], data["layer_pattern"] = layers, list(pattern(names))


def layer_types_of(spec: ModelSpec, names: dict[str, str]) -> list[str]:
    """Per-layer HF layer types: ``names`` maps a property of the layer ("window" / "full") to the HF name."""
    return [names["sliding" if spec.layer(i).mixer.window is not None else "full"] for i in range(spec.n_layers)]
