"""Families: named recipes (plain spec data) and their presets.

A family is data: a ``base`` spec table and ``presets``, each a set of dotted-path overrides of
the base plus facts about the preset (its Hugging Face repo ids, its published parameter count).
Families are usually TOML files (see ``zoo/families/``); plugins register them like any part.
"""

from __future__ import annotations

import difflib
import fnmatch
from pathlib import Path
from typing import Any, Callable, Optional

from zoo.core import registry as _registry
from zoo.core.spec import Family, ModelSpec, SpecError, apply_overrides
from zoo.model.decoder import build_model


def _index() -> tuple[dict[str, tuple[Family, str]], dict[str, str]]:
    presets: dict[str, tuple[Family, str]] = {}
    aliases: dict[str, str] = {}
    for entry in _registry.registry("family").entries():
        fam: Family = entry.obj
        for preset in fam.presets:
            if preset in presets:
                other = presets[preset][0]
                raise _registry.DuplicateNameError(
                    f"preset {preset!r} is defined by family {other.name!r} and by family {fam.name!r}"
                )
            presets[preset] = (fam, preset)
            for repo in fam.hf_ids(preset):
                aliases[repo] = preset
                aliases[repo.lower()] = preset
    return presets, aliases


def list_models(pattern: str = "*") -> list[str]:
    """Preset names matching a shell-style pattern: ``list_models("gemma*")``."""
    return sorted(n for n in _index()[0] if fnmatch.fnmatchcase(n, pattern))


def find_preset(name: str) -> tuple[Family, str]:
    presets, aliases = _index()
    if name in presets:
        return presets[name]
    if name in aliases or name.lower() in aliases:
        return presets[aliases.get(name) or aliases[name.lower()]]
    close = difflib.get_close_matches(name, list(presets) + list(aliases), n=5, cutoff=0.5)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise _registry.UnknownNameError(
        f"unknown model {name!r}.{hint} `zoo.list_models()` lists the presets; a recipe file path "
        f"(.toml or .json) or a ModelSpec also builds."
    )


def _overridden(data: dict[str, Any], overrides: dict[str, Any]) -> ModelSpec:
    """Apply overrides to the complete form of ``data`` (defaults filled in), so a path can reach
    a field the recipe left at its default; fall back to the raw data if it does not parse alone."""
    if not overrides:
        return ModelSpec.from_dict(data)
    try:
        full = ModelSpec.from_dict(data).to_dict()
    except SpecError:
        full = data
    return ModelSpec.from_dict(apply_overrides(full, overrides))


#: Functions that read the spec of a checkpoint without its weights (None: not a checkpoint). The
#: checkpoints wing, above this one, adds its reader (zoo.checkpoints.sources.spec_of) when imported.
_SPEC_READERS: list[Callable[[Any], Optional[ModelSpec]]] = []


def add_spec_reader(read: Callable[[Any], Optional[ModelSpec]]) -> None:
    """Let :func:`get_spec` (and :func:`build`) take what ``read`` reads a spec from."""
    if read not in _SPEC_READERS:
        _SPEC_READERS.append(read)


def get_spec(name_or_spec: Any, overrides: Optional[dict[str, Any]] = None, **kw: Any) -> ModelSpec:
    """Resolve a preset name, HF repo id, recipe file, dict or ModelSpec into a validated spec,
    with dotted-path ``overrides`` (and keyword overrides) applied."""
    overrides = {**(overrides or {}), **kw}
    if isinstance(name_or_spec, ModelSpec):
        return name_or_spec.with_overrides(overrides) if overrides else name_or_spec
    if isinstance(name_or_spec, dict):
        return _overridden(name_or_spec, overrides)
    for read in _SPEC_READERS:  # a checkpoint (a directory, a GGUF file, an HF config.json, a Source)
        spec = read(name_or_spec)
        if spec is not None:
            return spec.with_overrides(overrides) if overrides else spec
    if isinstance(name_or_spec, Path) or (
        isinstance(name_or_spec, str) and name_or_spec.endswith((".toml", ".json"))
    ):
        spec = ModelSpec.from_file(name_or_spec)
        return spec.with_overrides(overrides) if overrides else spec
    if not isinstance(name_or_spec, str):
        raise TypeError(f"expected a model name, a recipe path, a dict or a ModelSpec, got {type(name_or_spec).__name__}")
    family, preset = find_preset(name_or_spec)
    if not overrides:
        return family.spec(preset)
    try:
        return _overridden(family.recipe(preset), overrides)
    except SpecError as exc:
        raise exc.under("", f" (building {preset!r} with overrides)") from None


def build(
    name_or_spec: Any,
    *,
    device: Optional[Any] = None,
    dtype: Optional[Any] = None,
    seed: Optional[int] = None,
    overrides: Optional[dict[str, Any]] = None,
    **kw: Any,
):
    """Build a model from a preset name (``"gemma2-2b"``), an HF repo id, a recipe file, a dict
    or a :class:`ModelSpec`; or the architecture of a checkpoint directory, a training run's directory
    or an HF ``config.json``, with fresh weights (``zoo.from_pretrained`` loads its weights).

    Keyword overrides set spec fields by dotted path: ``n_layers=2``, or
    ``overrides={"layers.local.mixer.window": 64}`` (``__`` may stand for ``.``; ``*``
    matches every layer kind). ``device="meta"`` allocates nothing.
    """
    spec = get_spec(name_or_spec, {**(overrides or {}), **kw})
    return build_model(spec, device=device, dtype=dtype, seed=seed)


def published_params(name: str) -> Optional[int]:
    family, preset = find_preset(name)
    return family.presets[preset].get("params")
