"""The plugin contract: the hooks a zoo plugin implements and the interface of each kind of part.

A plugin is a module, found through the ``zoo.plugins`` entry-point group (or loaded by name
through ``ZOO_PLUGINS`` / :func:`zoo.load_plugin`), that implements ``zoo_register`` with
``@zoo.hookimpl``. pluggy calls hooks with keyword arguments only, and an implementation may
accept any subset of a hook's arguments, so the contract can grow without breaking plugins.

Every kind of part has an interface, checked when the part is registered, so that a plugin
author sees what is missing at once rather than when a model is built.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("zoo")
hookimpl = pluggy.HookimplMarker("zoo")


@hookspec
def zoo_register(registry):
    """Register parts of any kind: components, families, checkpoint formats.

    ``registry`` is the plugin manager. Use its typed helpers (``registry.add_norm(name, cls)``,
    ``add_mixer``, ``add_position``, ``add_family``, ``add_checkpoint_format``... one per
    kind; ``override=True`` replaces a part someone else registered) or the generic
    ``registry.add(kind, name, obj)``. Registrations made while this hook runs are attributed to
    the plugin; if the hook raises, everything it registered is withdrawn.
    """


# ---------------------------------------------------------------------------------------------
# The interface of each kind
# ---------------------------------------------------------------------------------------------

#: The keyword arguments the builder passes to each module-like kind's constructor
#: (``cls(config, **context)``), and the arguments of its ``forward``.
CONSTRUCTOR_CONTEXT: dict[str, tuple[str, ...]] = {
    "norm": ("dim",),
    "activation": (),
    "ffn": ("d_model",),
    "position": ("spec", "layer"),
    "rope_scaling": ("dim", "theta"),
    "mixer": ("d_model", "layer", "spec", "index"),
    "block": ("spec", "layer", "index"),
}
#: The arguments of each kind's ``forward``. An FFN is called ``(x, ctx)`` when its forward takes the
#: context (``ctx=None`` when it runs alone), else ``(x)``.
FORWARD_ARGS: dict[str, tuple[str, ...]] = {
    "norm": ("x",),
    "activation": ("x",),
    "ffn": ("x",),
    "mixer": ("x", "ctx", "pos"),
    "block": ("x", "ctx", "pos"),
}
#: Methods a kind must provide beyond its constructor and forward. A mixer's ``new_state``,
#: ``rotary_dim``, ``cost`` and ``facts`` are optional (see zoo.interfaces.Mixer for the defaults).
METHODS: dict[str, tuple[str, ...]] = {
    "position": ("embed", "prepare", "rotate", "score_bias"),
    "rope_scaling": ("frequencies",),
    "family": ("recipe", "spec", "hf_ids"),
}
POSITION_APPLIES_TO = ("embedding", "qk", "bias", "none")

INTERFACES: dict[str, Callable[[Any], list[str]]] = {}

#: Old names of kinds, still accepted everywhere a kind is named: attention is one kind of token mixer.
KIND_ALIASES = {"attention": "mixer"}


def canonical_kind(kind: str) -> str:
    """The kind's current name (``attention`` -> ``mixer``)."""
    return KIND_ALIASES.get(kind, kind)


def interface(kind: str):
    """Declare the interface check of a kind: a function returning what an object lacks (a list
    of phrases, empty when it conforms). Plugins that add a kind declare its interface too."""

    def deco(fn: Callable[[Any], list[str]]):
        INTERFACES[kind] = fn
        return fn

    return deco


def _accepts(fn: Any, positional: int, keywords: tuple[str, ...]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: give them the benefit of the doubt
        return True
    try:
        sig.bind(*([None] * positional), **{k: None for k in keywords})
    except TypeError:
        return False
    return True


def _module_part(kind: str) -> Callable[[Any], list[str]]:
    def check(obj: Any) -> list[str]:
        from torch import nn

        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            return [f"to be a torch.nn.Module subclass (got {obj!r})"]
        missing = []
        cfg = getattr(obj, "Config", None)
        if cfg is None or not dataclasses.is_dataclass(cfg):
            missing.append("a `Config` dataclass attribute holding its settings (an empty one if it has none)")
        ctx = CONSTRUCTOR_CONTEXT[kind]
        if not _accepts(obj, 1, ctx):
            args = ", ".join(("config", *(f"{k}=..." for k in ctx)))
            missing.append(f"a constructor accepting `({args})`")
        fwd = FORWARD_ARGS.get(kind)
        if fwd and not _accepts(getattr(obj, "forward"), 1 + len(fwd), ()):
            missing.append(f"`forward(self, {', '.join(fwd)})`")
        for name in METHODS.get(kind, ()):
            if not callable(getattr(obj, name, None)):
                missing.append(f"a `{name}` method")
        if kind == "position" and getattr(obj, "applies_to", None) not in POSITION_APPLIES_TO:
            missing.append(f"`applies_to` set to one of {', '.join(map(repr, POSITION_APPLIES_TO))} "
                           "(subclass zoo.interfaces.PositionEncoding)")
        return missing

    return check


for _kind in CONSTRUCTOR_CONTEXT:
    INTERFACES[_kind] = _module_part(_kind)


@interface("stability")
def _stability(obj: Any) -> list[str]:
    return [] if callable(obj) else ["to be callable (a function of tensors)"]


@interface("family")
def _family(obj: Any) -> list[str]:
    missing = []
    if not isinstance(getattr(obj, "name", None), str):
        missing.append("a `name` string")
    if not isinstance(getattr(obj, "presets", None), dict):
        missing.append("a `presets` dict mapping preset names to their settings")
    for name in METHODS["family"]:
        if not callable(getattr(obj, name, None)):
            missing.append(f"a `{name}` method (use zoo.Family, e.g. zoo.Family.from_toml(path))")
    return missing


def module_interface(kind: str, constructor: tuple[str, ...], forward: tuple[str, ...] = (),
                     methods: tuple[str, ...] = ()) -> Callable[[Any], list[str]]:
    """The interface check of a module-like kind a plugin adds (``registry.add_kind(kind, check)``):
    an ``nn.Module`` with a ``Config``, built as ``cls(config, **constructor)``, called with ``forward``."""
    CONSTRUCTOR_CONTEXT[kind], FORWARD_ARGS[kind], METHODS[kind] = constructor, forward, methods
    return _module_part(kind)


def check(kind: str, obj: Any) -> list[str]:
    """What ``obj`` lacks to be registered as a ``kind`` (empty when it conforms)."""
    fn = INTERFACES.get(canonical_kind(kind))
    return fn(obj) if fn is not None else []
