"""Typed registries of named parts, and the plugin manager that fills them.

Every part of a model (a norm, an attention variant, a family recipe, a checkpoint format)
lives in the registry of its kind under a name. Parts arrive through plugins: the built-in
catalogue is loaded exactly like a third-party package, through the ``zoo_register`` hook
(see :mod:`zoo.core.hooks`). Plugins are discovered lazily, on the first use of a registry.

Loading (entry points, provenance, withdrawal of a failing plugin) is :class:`zoo.core.plugins.PluginLoader`,
the base of :class:`PluginManager`; its environment switches are documented there.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import pluggy

from zoo.core import hooks, kinds
from zoo.core.deprecations import warn
from zoo.core.kinds import KINDS, KIND_ALIASES, canonical_kind  # noqa: F401  (re-exported)
from zoo.core.kinds import interface  # noqa: F401  (re-exported: kinds declare their interface here too)
from zoo.core.plugins import (  # noqa: F401  (re-exported)
    BUILTIN_PLUGINS,
    ENTRY_POINT_GROUP,
    PluginError,
    PluginInfo,
    PluginLoader,
    PluginWarning,
)


#: Readers that turn a file into a registrable object, by kind (``zoo.model.recipes`` adds the family reader),
#: so that ``add_family(path)`` works without the registry importing the recipes.
FILE_READERS: dict[str, Callable[[Any], Any]] = {}


class RegistryError(LookupError):
    """A registry look-up or registration failed."""


class UnknownNameError(RegistryError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DuplicateNameError(RegistryError):
    pass


class NameCollisionWarning(UserWarning):
    """A plugin registered a name zoo also ships (or zoo added one a plugin already had): both stay,
    each reachable by its qualified name ``provider:name``; the bare name means zoo's."""


#: How qualified names spell zoo's own entries (``zoo:relu2``).
ZOO = "zoo"
#: Provider names whose preference :func:`preferring` has opened (a plugin's family being parsed).
_PREFER: list[str] = []


@contextlib.contextmanager
def preferring(qualifier: Optional[str]) -> Iterator[None]:
    """Within the block, a bare name that ``qualifier`` (a plugin's name) registered itself means that
    plugin's entry, even where zoo ships the same name: a plugin's own recipes resolve to it first."""
    _PREFER.append(qualifier or "")
    try:
        yield
    finally:
        _PREFER.pop()


class InterfaceError(RegistryError, TypeError):
    """A registered object does not meet the interface of its kind."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    obj: Any
    provider: str
    replaced: Optional["Entry"] = None  # the entry an explicit override displaced


# Names an entry claims beyond its own: a family claims its preset names, which must be unique
# across families (``zoo.build("llama3-8b")`` has to mean one thing).
_CLAIMS: dict[str, Callable[[Any], list[str]]] = {"family": lambda fam: list(getattr(fam, "presets", {}))}


class Registry:
    """The registry of one kind of part."""

    def __init__(self, kind: str, owner: "PluginManager"):
        self.kind = kind
        self._owner = owner
        self._entries: dict[str, Entry] = {}
        #: bare name -> qualifier (``zoo`` or a plugin's name) -> entry, every provider's, also those the
        #: bare name does not mean
        self._all: dict[str, dict[str, Entry]] = {}

    def qualifier(self, provider: str) -> str:
        """How a qualified name spells ``provider``: ``zoo`` for zoo's built-in plugins, else the plugin's name."""
        return ZOO if provider in self._owner.builtin_plugins or provider in BUILTIN_PLUGINS else provider

    def add(self, name: str, obj: Any, *, provider: str, override: bool = False) -> Any:
        owner = self._owner
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} names must be non-empty strings; {owner.describe(provider)} gave {name!r}")
        missing = kinds.check(self.kind, obj)
        if missing:
            raise InterfaceError(
                f"{owner.describe(provider)} registers {self.kind} {name!r} ({getattr(obj, '__qualname__', obj)!r}), "
                f"which does not meet the {self.kind} interface: it needs " + "; ".join(missing) + "."
            )
        obj = kinds.adapt_part(self.kind, obj)  # a part that does not inherit its base gets the defaults
        old = self._entries.get(name)
        if old is not None and old.obj is obj:
            return obj
        if old is not None and not override and (self.qualifier(old.provider) == ZOO) != (self.qualifier(provider) == ZOO):
            return self._both(name, old, Entry(self.kind, name, obj, provider))
        if old is not None and not override:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: by {owner.describe(old.provider)} and by "
                f"{owner.describe(provider)}. Rename one of them, or register with override=True to replace "
                f"the first one on purpose."
            )
        claims = _CLAIMS.get(self.kind)
        if claims is not None:
            for other in self._entries.values():
                if other.name == name:
                    continue
                clash = sorted(set(claims(obj)) & set(claims(other.obj)))
                if clash:
                    raise DuplicateNameError(
                        f"{self.kind} {name!r} of {owner.describe(provider)} claims {clash[0]!r}, which "
                        f"{self.kind} {other.name!r} of {owner.describe(other.provider)} already has. Rename one."
                    )
        if self.kind == "family" and hasattr(obj, "provider") and not obj.provider:
            obj.provider = self.qualifier(provider)  # its recipes prefer its own parts (preferring)
        entry = Entry(self.kind, name, obj, provider, replaced=old)
        self._entries[name] = entry
        self._all.setdefault(name, {})[self.qualifier(provider)] = entry
        return obj

    def _both(self, name: str, old: Entry, new: Entry) -> Any:
        """zoo and a plugin both register ``name``: a zoo release that adds a name a plugin already had
        must not break the plugin, nor may installing a plugin change what a zoo name means. Both stay,
        reachable as ``zoo:name`` and ``plugin:name``; the bare name means zoo's, except in the plugin's
        own recipes (:func:`preferring`)."""
        ours, theirs = (old, new) if self.qualifier(old.provider) == ZOO else (new, old)
        self._entries[name] = ours
        self._all.setdefault(name, {})[self.qualifier(new.provider)] = new
        plugin = self.qualifier(theirs.provider)
        warnings.warn(NameCollisionWarning(
            f"{self.kind} {name!r} is registered by zoo ({ours.provider}) and by "
            f"{self._owner.describe(theirs.provider)}: both are kept. The bare name {name!r} means zoo's "
            f"(spell it '{ZOO}:{name}' to be explicit); write '{plugin}:{name}' for the plugin's. The plugin's "
            f"own families resolve {name!r} to the plugin's first."), stacklevel=4)
        return new.obj

    def resolve(self, name: str) -> str:
        """The name a spec stores for ``name``: qualified (``plugin:name``) when a preferred plugin
        (:func:`preferring`) has its own entry of that name and the bare name means another's."""
        if ":" in name or not _PREFER or not _PREFER[-1]:
            return name
        q = _PREFER[-1]
        own = self._all.get(name, {}).get(q)
        bare = self._loaded().get(name)
        return f"{q}:{name}" if own is not None and bare is not None and own is not bare else name

    def qualified_names(self, name: str) -> list[str]:
        """Every qualified spelling of ``name`` (more than one when zoo and a plugin both have it)."""
        self._loaded()
        return sorted(f"{q}:{name}" for q in self._all.get(name, {}))

    def remove(self, name: str, provider: str) -> None:
        """Withdraw ``provider``'s entry (restoring what it had overridden)."""
        q = self.qualifier(provider)
        if self._all.get(name, {}).get(q) is not None and self._all[name][q].provider == provider:
            del self._all[name][q]
        entry = self._entries.get(name)
        if entry is None or entry.provider != provider:
            return
        if entry.replaced is not None:
            self._all.setdefault(name, {})[self.qualifier(entry.replaced.provider)] = entry.replaced
        if entry.replaced is not None:
            self._entries[name] = entry.replaced
        else:
            del self._entries[name]

    def _loaded(self) -> dict[str, Entry]:
        self._owner.ensure_loaded()
        return self._entries

    def entry(self, name: str) -> Entry:
        entries = self._loaded()
        if ":" in name:
            q, bare = name.split(":", 1)
            found = self._all.get(bare, {}).get(q)
            if found is None:
                spellings = ", ".join(self.qualified_names(bare)) or "none"
                raise UnknownNameError(f"unknown {self.kind} {name!r}: no provider {q!r} registers {bare!r} "
                                       f"(its qualified names: {spellings}).")
            return found
        if _PREFER and _PREFER[-1] and self._all.get(name, {}).get(_PREFER[-1]) is not None:
            return self._all[name][_PREFER[-1]]
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

    def shadowed(self, name: str) -> list[tuple[str, Entry]]:
        """The entries of ``name`` the bare name does not mean (a plugin's, where zoo ships the same
        name), each with its qualified spelling."""
        bare = self._loaded().get(name)
        return sorted((f"{q}:{name}", e) for q, e in self._all.get(name, {}).items() if e is not bare)

    def __contains__(self, name: str) -> bool:
        if ":" in name:
            q, bare = name.split(":", 1)
            self._loaded()
            return q in self._all.get(bare, {})
        return name in self._loaded()


class PluginManager(PluginLoader):
    """Holds every registry and loads plugins into them (lazily, once)."""

    def __init__(self, builtin_plugins: tuple[str, ...] = BUILTIN_PLUGINS) -> None:
        self.builtin_plugins = builtin_plugins
        self.pm = pluggy.PluginManager("zoo")
        self.pm.add_hookspecs(hooks)
        self.registries = {k: Registry(k, self) for k in KINDS}
        self.plugins: dict[str, PluginInfo] = {}
        self._loaded = False
        self._loading = False
        self._provider: list[str] = []
        self._failures: list[tuple[str, bool]] = []  # (message, fatal even without strict mode)
        self._added_kinds: list[tuple[str, Optional[str], Any]] = []  # (kind, provider, interface it replaced)

    # -- registration -------------------------------------------------------------------------
    @property
    def current_provider(self) -> Optional[str]:
        return self._provider[-1] if self._provider else None

    @contextlib.contextmanager
    def providing(self, name: str) -> Iterator[None]:
        self._provider.append(name)
        try:
            yield
        finally:
            self._provider.pop()

    def describe(self, provider: str) -> str:
        """``plugin 'x' (distribution d 1.0)``: how messages name a provider."""
        info = self.plugins.get(provider)
        if info is None:
            return repr(provider)
        if info.distribution:
            return f"plugin {provider!r} (distribution {info.distribution} {info.version or ''})".replace(" )", ")")
        return f"plugin {provider!r}"

    def add_kind(self, kind: str, check: Optional[Callable[[Any], list[str]]] = None) -> Registry:
        """Add a new kind of part (with its interface check, if any)."""
        if kind not in self.registries:
            self._added_kinds.append((kind, self.current_provider, kinds.INTERFACES.get(kind)))
            self.registries[kind] = Registry(kind, self)
        if check is not None:
            kinds.INTERFACES[kind] = check
        return self.registries[kind]

    def registry(self, kind: str) -> Registry:
        kind = canonical_kind(kind)
        if kind not in self.registries:
            self.ensure_loaded()  # a plugin may add the kind
        try:
            return self.registries[kind]
        except KeyError:
            close = difflib.get_close_matches(kind, list(self.registries), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownNameError(f"unknown registry kind {kind!r}.{hint} Kinds: {', '.join(self.registries)}.") from None

    def _provider_for(self, obj: Any) -> str:
        current = self.current_provider
        if current is not None:
            return current
        # Registered outside a plugin's hook (a module imported directly): credit the plugin
        # whose module contains it, else the module itself.
        module = getattr(obj, "__module__", None) or "<unknown>"
        for info in self.plugins.values():
            if module == info.module or module.startswith(info.module + "."):
                return info.name
        return module

    def add(self, kind: str, name: str, obj: Any, *, provider: Optional[str] = None, override: bool = False) -> Any:
        """Register ``obj`` as the ``kind`` called ``name``. The interface of the kind is checked
        now; a taken name is an error naming both providers unless ``override=True``."""
        if not self._loading and not self._loaded:
            owner = self._builtin_owner(obj) if provider is None else None
            if owner is None:
                self.ensure_loaded()  # so a name clash with a built-in or a plugin is seen now
            else:
                # A built-in module imported before the registry loaded (`from zoo.components.mixers.attention
                # import causal_mask` first thing): loading now would run the plugins while that module
                # is half-imported, before its own parts exist. It is credited to its plugin, which
                # lists it when it loads.
                provider = owner
        kind = canonical_kind(kind)
        provider = provider or self._provider_for(obj)
        self.registry(kind).add(name, obj, provider=provider, override=override)
        info = self.plugins.get(provider)
        if info is not None and (kind, name) not in info.registered:
            info.registered.append((kind, name))
        return obj

    def _builtin_owner(self, obj: Any) -> Optional[str]:
        """The built-in plugin whose package holds ``obj``'s module, if any."""
        module = getattr(obj, "__module__", None) or ""
        return next((p for p in self.builtin_plugins if module == p or module.startswith(p + ".")), None)

    # Typed helpers, one per kind: the interface of the kind is checked at registration.
    def add_norm(self, name: str, cls: type, *, override: bool = False) -> type:
        """A norm: ``nn.Module`` built as ``cls(config, dim=...)``, called on ``x``."""
        return self.add("norm", name, cls, override=override)

    def add_activation(self, name: str, cls: type, *, override: bool = False) -> type:
        """A pointwise activation: ``nn.Module`` built as ``cls(config)``."""
        return self.add("activation", name, cls, override=override)

    def add_ffn(self, name: str, cls: type, *, override: bool = False) -> type:
        """A feed-forward network: built as ``cls(config, d_model=...)``, (B, T, d) -> (B, T, d)."""
        return self.add("ffn", name, cls, override=override)

    def add_position(self, name: str, cls: type, *, override: bool = False) -> type:
        """A :class:`zoo.core.kinds.PositionEncoding` built as ``cls(config, spec=..., layer=...)``."""
        return self.add("position", name, cls, override=override)

    def add_rope_scaling(self, name: str, cls: type, *, override: bool = False) -> type:
        """A RoPE frequency scaling built as ``cls(config, dim=..., theta=...)`` with ``frequencies(seq_len)``."""
        return self.add("rope_scaling", name, cls, override=override)

    def add_mixer(self, name: str, cls: type, *, override: bool = False) -> type:
        """A token mixer (attention, recurrent, latent) built as ``cls(config, d_model=, layer=, spec=, index=)``,
        called ``(x, ctx, pos)``; ``new_state(batch, max_len, dtype=, device=)`` makes its decode state."""
        return self.add("mixer", name, cls, override=override)

    def add_attention(self, name: str, cls: type, *, override: bool = False) -> type:
        """The name :meth:`add_mixer` had before mixers (deprecated): an attention is a token mixer."""
        warn("PluginManager.add_attention")
        return self.add("mixer", name, cls, override=override)

    def add_block(self, name: str, cls: type, *, override: bool = False) -> type:
        """A block built as ``cls(config, spec=, layer=, index=)``, called ``(x, ctx, rotary)``."""
        return self.add("block", name, cls, override=override)

    def add_stability(self, name: str, fn: Callable, *, override: bool = False) -> Callable:
        """A stability function of tensors (soft-cap, z-loss)."""
        return self.add("stability", name, fn, override=override)

    def add_family(self, family: Any, *, override: bool = False) -> Any:
        """A family (a :class:`zoo.Family`, or a path to a family TOML file); its presets must be new names."""
        if isinstance(family, (str, os.PathLike)):
            if not os.path.isfile(family):
                raise RegistryError(
                    f"family file {os.fspath(family)} is missing. An installed plugin ships only the data files "
                    "its build lists: add them to pyproject.toml, e.g. [tool.setuptools.package-data] "
                    "your_module = [\"*.toml\"], and reinstall"
                )
            reader = FILE_READERS.get("family")
            if reader is None:
                raise RegistryError(f"cannot read family file {family}: import zoo (which adds the family reader) first")
            family = reader(family)
        return self.add("family", getattr(family, "name", None) or repr(family), family, override=override)

    def add_checkpoint_format(self, name: str, fmt: Any, *, override: bool = False) -> Any:
        """A checkpoint format, keyed by the Hugging Face ``model_type`` it reads and writes."""
        return self.add("checkpoint_format", name, fmt, override=override)

    def provider_of(self, kind: str, name: str) -> str:
        return self.registry(kind).entry(name).provider


_manager = PluginManager()


def manager() -> PluginManager:
    return _manager


def registry(kind: str) -> Registry:
    return _manager.registry(kind)


def register(kind: str, name: Optional[str] = None, *, override: bool = False):
    """Decorator: ``@zoo.register("norm", "rmsnorm")`` registers a class or function."""

    def deco(obj):
        _manager.add(kind, name or getattr(obj, "__name__"), obj, override=override)
        return obj

    return deco


def get(kind: str, name: str) -> Any:
    return _manager.registry(kind).get(name)


def load_plugin(name: str) -> PluginInfo:
    """Load a plugin by entry-point or module name (e.g. with ``ZOO_DISABLE_PLUGIN_AUTOLOAD=1``)."""
    return _manager.load_plugin(name)


def list_components(kind: Optional[str] = None, pattern: str = "*") -> list[str] | dict[str, list[str]]:
    """Names registered under ``kind`` (shell-style ``pattern``), or every kind's names. ``attention``
    is accepted for ``mixer``."""
    if kind is None:
        _manager.ensure_loaded()  # plugins may add kinds: load them before iterating
        return {k: r.names(pattern) for k, r in list(_manager.registries.items())}
    return _manager.registry(kind).names(pattern)
