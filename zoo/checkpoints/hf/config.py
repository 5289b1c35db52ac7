"""An HF ``config.json`` <-> a zoo spec, through the format registered for its ``model_type``: reading
the file, the spec it describes (read as transformers reads it), the fields nothing reads, and the
config a spec is written as; and what of a spec decides the function it computes (:func:`_architecture`),
by which a saved or exported config is checked against the model."""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

from zoo.checkpoints.files.io import regular_file
from zoo.checkpoints.hf.format import CheckpointError, CheckpointFormat, ConfigError, collect_ignored, get_format, layout_of
from zoo.checkpoints.quantized import read_quantization, without_quantization
from zoo.core.spec import ModelSpec, to_dict

# Non-architectural fields carried from the loaded config into a saved one.
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory} has no config.json")
    try:
        config = json.loads(regular_file(path, "config").read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not a {type(config).__name__}")
    return config


def _format_and_config(config: dict[str, Any]) -> tuple[CheckpointFormat, dict[str, Any], dict[str, str]]:
    if not isinstance(config, dict):
        raise ConfigError("config", f"must be a JSON object, got {type(config).__name__}")
    read_quantization(config)  # a quantization zoo cannot read is refused by name
    config = without_quantization(config)  # the architecture is the unquantized model's
    fmt = get_format(config.get("model_type") or layout_of(config))
    inner, renames = fmt.unwrap(config)
    if inner is not config:
        fmt = get_format(inner.get("model_type") or fmt.model_type)
    return fmt, inner, renames


def config_to_spec(config: dict[str, Any], *, strict: bool = False) -> ModelSpec:
    """The zoo spec an HF config describes, read as transformers reads it: a field zoo cannot express
    is an error naming it; a field transformers ignores is accepted (``strict=True`` refuses it too)."""
    fmt, inner, _ = _format_and_config(config)
    return fmt.config_to_spec(inner, strict=strict)


def ignored_fields(config: dict[str, Any]) -> list[str]:
    """The fields of ``config`` that neither transformers' modelling code nor zoo reads (vendor extras
    such as Qwen's ``use_mrope``): they change nothing in the model and are kept on saving."""
    fmt, inner, _ = _format_and_config(config)
    with collect_ignored() as ignored:
        fmt.config_to_spec(inner, strict=False)
    return sorted(set(ignored))


def spec_to_config(spec: ModelSpec, model_type: str) -> dict[str, Any]:
    """The HF config of ``spec`` in ``model_type``'s format; a CheckpointError when the format has no
    way to say what the spec holds (a format reads the parts it knows: learned positions have no
    RoPE base for a RoPE-only format to write)."""
    fmt = get_format(model_type)
    try:
        body = fmt.spec_to_config(spec)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else f"it has no field for what the spec holds ({type(exc).__name__}: {exc})"
        raise CheckpointError(f"this model cannot be written as {fmt.model_type}: {detail}") from None
    return {"architectures": [fmt.architecture], "model_type": fmt.model_type, **body}


def _architecture(spec: ModelSpec) -> dict[str, Any]:
    """What decides the function a spec computes, layer by layer, with defaults resolved (not layer
    kind names, labels or training-only settings), so that two spellings of one model compare equal.
    Each part resolves its own defaults (``resolved(config, d_model)``, when it has one)."""
    def resolved(part):
        if part is None:
            return None
        settings = part.cls.resolved(part.config, spec.d_model)
        return {"name": part.name, **settings} if settings is not None else to_dict(part)

    data = {k: v for k, v in spec.to_dict().items()
            if k not in ("layers", "layer_pattern", "label", "dropout", "init_std", "z_loss", "position")}
    per_layer = []
    for i in range(spec.n_layers):
        layer = spec.layer(i)
        ffn = resolved(layer.ffn)
        ffn["name"] = "glu" if getattr(layer.ffn.cls, "gated", False) else ffn["name"]
        per_layer.append({"mixer": resolved(layer.mixer), "ffn": ffn, "norm": resolved(layer.norm),
                          "block": resolved(layer.block), "position": resolved(spec.position_for(i))})
    data["per_layer"] = per_layer
    if "mtp" in data:  # its loss weight is a training setting
        data["mtp"] = {k: v for k, v in data["mtp"].items() if k != "weight"}
    return data


def _unstored(path: str, fmt: CheckpointFormat) -> bool:
    """Whether a path of :func:`_architecture` is one the format says its config does not store
    (``fmt.not_stored``: spec paths such as ``max_seq_len`` or ``layers.*.mixer.width``)."""
    spec_path = re.sub(r"^per_layer\[\d+\]\.", "layers.*.", path)
    return any(fnmatch.fnmatchcase(spec_path, p) or spec_path.startswith(p + ".") for p in fmt.not_stored)
