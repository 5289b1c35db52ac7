"""Typed registries of named parts, and the plugin manager that fills them.

Every part of a model (a norm, an attention variant, a family recipe, a checkpoint format)
lives in the registry of its kind under a name. Parts arrive through plugins: the built-in
catalogue is loaded exactly like a third-party package, through the ``zoo_register`` hook
(see :mod:`zoo.hookspecs`). Plugins are discovered lazily, on the first look-up.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import importlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pluggy

from zoo import hookspecs

ENTRY_POINT_GROUP = "zoo.plugins"
# Built-in plugins, loaded by module name the way pytest loads its own: through the same hook.
BUILTIN_PLUGINS = ("zoo.components", "zoo.families", "zoo.checkpoints.formats")

KINDS = (
    "norm",
    "activation",
    "ffn",
    "position",
    "rope_scaling",
    "attention",
    "block",
    "stability",
    "family",
    "checkpoint_format",
)


class RegistryError(LookupError):
    """A registry look-up or registration failed."""


class UnknownNameError(RegistryError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DuplicateNameError(RegistryError):
    pass


class PluginError(RuntimeError):
    """A plugin failed to load or to register its parts."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    obj: Any
    provider: str


# What each kind requires of a registered object; checked at registration so that a plugin
# author sees the problem at once, not at build time. A check returns a list of what is missing.
_INTERFACE_CHECKS: dict[str, Callable[[Any], list[str]]] = {}


def interface(kind: str):
    """Declare the interface check for a kind (used by the core and by plugins adding kinds)."""

    def deco(fn: Callable[[Any], list[str]]):
        _INTERFACE_CHECKS[kind] = fn
        return fn

    return deco


def _module_part(obj: Any) -> list[str]:
    import dataclasses

    missing = []
    cfg = getattr(obj, "Config", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        missing.append("a `Config` dataclass attribute (the part's own settings)")
    if not callable(obj):
        missing.append("a constructor `cls(config, **context)`")
    return missing


for _k in ("norm", "activation", "ffn", "position", "rope_scaling", "attention", "block"):
    _INTERFACE_CHECKS[_k] = _module_part


@interface("family")
def _family_check(obj: Any) -> list[str]:
    missing = []
    if not isinstance(getattr(obj, "presets", None), dict):
        missing.append("a `presets` dict mapping preset names to recipes")
    if not callable(getattr(obj, "recipe", None)):
        missing.append("a `recipe(preset_name)` method returning the spec dict")
    return missing


class Registry:
    """The registry of one kind of part."""

    def __init__(self, kind: str, owner: "PluginManager"):
        self.kind = kind
        self._owner = owner
        self._entries: dict[str, Entry] = {}

    def add(self, name: str, obj: Any, *, provider: str, override: bool = False) -> Any:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} names must be non-empty strings, got {name!r} from {provider}")
        check = _INTERFACE_CHECKS.get(self.kind)
        if check is not None:
            missing = check(obj)
            if missing:
                raise RegistryError(
                    f"{provider} registers {self.kind} {name!r} ({obj!r}), which does not meet the "
                    f"{self.kind} interface: it lacks " + "; ".join(missing)
                )
        old = self._entries.get(name)
        if old is not None and old.obj is not obj and not override:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: by {old.provider} and by {provider}. "
                f"Rename one, or register with override=True to replace {old.provider}'s."
            )
        self._entries[name] = Entry(self.kind, name, obj, provider)
        return obj

    def _loaded(self) -> dict[str, Entry]:
        self._owner.ensure_loaded()
        return self._entries

    def entry(self, name: str) -> Entry:
        entries = self._loaded()
        if name not in entries:
            close = difflib.get_close_matches(name, list(entries), n=5, cutoff=0.5)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            known = ", ".join(sorted(entries)) or "none"
            raise UnknownNameError(f"unknown {self.kind} {name!r}.{hint} Known {self.kind}s: {known}.")
        return entries[name]

    def get(self, name: str) -> Any:
        return self.entry(name).obj

    def names(self, pattern: str = "*") -> list[str]:
        return sorted(n for n in self._loaded() if fnmatch.fnmatchcase(n, pattern))

    def entries(self) -> list[Entry]:
        return [self._loaded()[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._loaded()


@dataclass
class PluginInfo:
    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    registered: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None
    builtin: bool = False


class PluginManager:
    """Holds every registry and loads plugins into them (lazily, once)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("zoo")
        self.pm.add_hookspecs(hookspecs)
        self.registries = {k: Registry(k, self) for k in KINDS}
        self.plugins: dict[str, PluginInfo] = {}
        self._loaded = False
        self._loading = False
        self._provider: list[str] = []

    # -- registration -------------------------------------------------------------------------
    @property
    def current_provider(self) -> str | None:
        return self._provider[-1] if self._provider else None

    @contextlib.contextmanager
    def providing(self, name: str) -> Iterator[None]:
        self._provider.append(name)
        try:
            yield
        finally:
            self._provider.pop()

    def add_kind(self, kind: str) -> Registry:
        if kind not in self.registries:
            self.registries[kind] = Registry(kind, self)
        return self.registries[kind]

    def registry(self, kind: str) -> Registry:
        try:
            return self.registries[kind]
        except KeyError:
            close = difflib.get_close_matches(kind, list(self.registries), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownNameError(f"unknown registry kind {kind!r}.{hint} Kinds: {', '.join(self.registries)}.") from None

    def add(self, kind: str, name: str, obj: Any, *, provider: str | None = None, override: bool = False) -> Any:
        provider = provider or self.current_provider or getattr(obj, "__module__", None) or "<unknown>"
        self.registry(kind).add(name, obj, provider=provider, override=override)
        info = self.plugins.get(provider)
        if info is not None:
            info.registered.append((kind, name))
        return obj

    # -- loading ------------------------------------------------------------------------------
    def ensure_loaded(self) -> None:
        if self._loaded or self._loading:
            return
        self._loading = True
        try:
            for modname in BUILTIN_PLUGINS:
                self.load_plugin(modname, builtin=True)
            if os.environ.get("ZOO_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "yes"):
                self._load_entry_points()
            for name in filter(None, os.environ.get("ZOO_PLUGINS", "").split(",")):
                self.load_plugin(name.strip())
        finally:
            self._loading = False
            self._loaded = True

    def _load_entry_points(self) -> None:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            self.load_plugin(
                ep.value,
                name=ep.name,
                loader=ep.load,
                distribution=getattr(dist, "name", None),
                version=getattr(dist, "version", None),
            )

    def load_plugin(
        self,
        module: str,
        *,
        name: str | None = None,
        loader: Callable[[], Any] | None = None,
        distribution: str | None = None,
        version: str | None = None,
        builtin: bool = False,
    ) -> PluginInfo:
        """Import a plugin module and call its ``zoo_register`` hook, recording what it adds.

        A failing plugin is recorded and warned about; ``ZOO_STRICT_PLUGINS=1`` makes it fatal.
        """
        name = name or module
        if name in self.plugins and self.plugins[name].error is None:
            return self.plugins[name]
        info = PluginInfo(name=name, module=module, distribution=distribution, version=version, builtin=builtin)
        self.plugins[name] = info
        try:
            with self.providing(name):
                plugin = loader() if loader else importlib.import_module(module)
                if self.pm.is_registered(plugin):
                    return info
                self.pm.register(plugin, name=name)
                hook = self.pm.subset_hook_caller("zoo_register", remove_plugins=[
                    p for p in self.pm.get_plugins() if p is not plugin
                ])
                hook(registry=self)
        except Exception as exc:  # a plugin must not take zoo down unless asked to
            info.error = f"{type(exc).__name__}: {exc}"
            if builtin or os.environ.get("ZOO_STRICT_PLUGINS", "") in ("1", "true", "yes"):
                raise PluginError(f"plugin {name!r} ({module}) failed to load: {info.error}") from exc
            warnings.warn(f"zoo plugin {name!r} ({module}) failed to load and was skipped: {info.error}", stacklevel=2)
        return info

    def provider_of(self, kind: str, name: str) -> str:
        return self.registry(kind).entry(name).provider


_manager = PluginManager()


def manager() -> PluginManager:
    return _manager


def registry(kind: str) -> Registry:
    return _manager.registry(kind)


def register(kind: str, name: str | None = None, *, override: bool = False):
    """Decorator: ``@zoo.register("norm", "rmsnorm")`` registers a class or function."""

    def deco(obj):
        _manager.add(kind, name or getattr(obj, "__name__"), obj, override=override)
        return obj

    return deco


def get(kind: str, name: str) -> Any:
    return _manager.registry(kind).get(name)


def list_components(kind: str | None = None, pattern: str = "*") -> list[str] | dict[str, list[str]]:
    """Names registered under ``kind`` (shell-style ``pattern``), or every kind's names."""
    if kind is None:
        return {k: r.names(pattern) for k, r in _manager.registries.items()}
    return _manager.registry(kind).names(pattern)
