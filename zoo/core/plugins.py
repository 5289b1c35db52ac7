"""Loading plugins: entry points and ``ZOO_PLUGINS``, provenance (which plugin registered what),
failure collection, and withdrawing what a failing plugin registered.

:class:`PluginLoader` is the loading half of :class:`zoo.core.registry.PluginManager`; the
registration half (the typed registries and ``add_*`` helpers) lives in :mod:`zoo.core.registry`.

Environment:
  ``ZOO_DISABLE_PLUGIN_AUTOLOAD=1``  do not load plugins from the ``zoo.plugins`` entry points
  ``ZOO_PLUGINS=a,b``                 load these plugins (entry-point names or module names) anyway
  ``ZOO_STRICT_PLUGINS=1``            a plugin that fails to load is an error, not a warning
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from zoo.core import kinds

ENTRY_POINT_GROUP = "zoo.plugins"


# Built-in plugins, loaded by module name the way pytest loads its own: through the same hook.
BUILTIN_PLUGINS = ("zoo.components", "zoo.families", "zoo.checkpoints.hf.formats")


class PluginError(RuntimeError):
    """A plugin failed to load or to register its parts (fatal only in strict mode)."""


class PluginWarning(UserWarning):
    """A plugin failed to load and was skipped."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class PluginInfo:
    """Provenance of one plugin: where it came from and what it registered."""

    name: str
    module: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    registered: list[tuple[str, str]] = field(default_factory=list)
    error: Optional[str] = None
    builtin: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["registered"] = [{"kind": k, "name": n} for k, n in self.registered]
        return d


@functools.lru_cache(maxsize=None)
def _distribution_of(module: str) -> tuple[Optional[str], Optional[str]]:
    """The installed distribution (name, version) providing a top-level module, if any."""
    from importlib.metadata import packages_distributions, version

    top = module.split(".")[0]
    for dist in packages_distributions().get(top, []):
        try:
            return dist, version(dist)
        except Exception:
            continue
    return None, None


SLOW_PLUGIN_S = 1.0  # a plugin loading longer than this is named on stderr while it loads


def _slow_notice(name: str, where: str, quiet: bool = False) -> Any:
    """A started timer that names the plugin on stderr if it is still loading after SLOW_PLUGIN_S
    (``quiet``: a built-in, whose import is zoo's own start-up, gets a timer that never fires)."""
    import sys
    import threading

    def notice() -> None:
        print(f"zoo: loading plugin {name!r} ({where}) is taking over {SLOW_PLUGIN_S:g} s", file=sys.stderr, flush=True)

    timer = threading.Timer(SLOW_PLUGIN_S, notice)
    timer.daemon = True
    if not quiet:
        timer.start()
    return timer


def _warn_unmarked_hook(plugin: Any, name: str, where: str) -> None:
    """pluggy ignores a ``zoo_register`` without the marker: say so instead of registering nothing silently."""
    hook = getattr(plugin, "zoo_register", None)
    if callable(hook) and not hasattr(hook, "zoo_impl"):
        warnings.warn(f"zoo plugin {name!r} ({where}) defines zoo_register without @zoo.hookimpl, so zoo never "
                      "calls it and the plugin registers nothing; decorate it with @zoo.hookimpl",
                      PluginWarning, stacklevel=4)


class PluginLoader:
    """Loads plugins into the manager that subclasses it (see :class:`zoo.core.registry.PluginManager`)."""

    # -- loading ------------------------------------------------------------------------------
    def ensure_loaded(self) -> None:
        """Load the built-ins, then (unless disabled) every ``zoo.plugins`` entry point, then
        the plugins named in ``ZOO_PLUGINS``. Runs once."""
        if self._loading:
            return
        if self._loaded:
            self._raise_failures()
            return
        self._loading = True
        try:
            for modname in self.builtin_plugins:
                self._collect(self.load_plugin, modname, builtin=True)
            if not _env_flag("ZOO_DISABLE_PLUGIN_AUTOLOAD"):
                for ep in self._entry_points():
                    self._collect(self._load_entry_point, ep)
            for name in os.environ.get("ZOO_PLUGINS", "").split(","):
                if name.strip():
                    self._collect(self.load_plugin, name.strip())
            for info in list(self.plugins.values()):  # now that every part is registered
                self._collect(self._check_families_or_withdraw, info)
        finally:
            self._loading = False
            self._loaded = True
        self._raise_failures()

    def _collect(self, load: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """Run one plugin's loading step; a fatal failure is kept (so every healthy plugin still
        loads, and every later use fails again until the plugin is fixed)."""
        try:
            load(*args, **kw)
        except PluginError as exc:
            self._failures.append((str(exc), kw.get("builtin", False)))

    def _raise_failures(self) -> None:
        fatal = [m for m, builtin in self._failures if builtin or _env_flag("ZOO_STRICT_PLUGINS")]
        if fatal:
            raise PluginError("; ".join(fatal))

    def _check_families(self, info: "PluginInfo") -> None:
        """Every preset of the families a third-party plugin registered must parse (the error names
        the family file and the preset)."""
        if info.builtin or info.error is not None:
            return
        for kind, name in list(info.registered):
            if kind == "family":
                family = self.registries["family"].entry(name).obj
                for preset in getattr(family, "presets", {}):
                    family.spec(preset)

    def _check_families_or_withdraw(self, info: "PluginInfo") -> None:
        try:
            self._check_families(info)
        except Exception as exc:  # withdrawn like a plugin whose hook raised
            self._withdraw(info, None, exc)

    @staticmethod
    def _entry_points() -> list[Any]:
        from importlib.metadata import entry_points

        return list(entry_points(group=ENTRY_POINT_GROUP))

    def _load_entry_point(self, ep: Any) -> PluginInfo:
        dist = getattr(ep, "dist", None)
        return self._load(
            ep.name, ep.value.split(":")[0], ep.load,
            distribution=getattr(dist, "name", None), version=getattr(dist, "version", None),
        )

    def load_plugin(self, name: str, *, builtin: bool = False) -> PluginInfo:
        """Load one plugin explicitly: an entry-point name of the ``zoo.plugins`` group, or a
        module name. This works with autoloading disabled. Returns its :class:`PluginInfo`."""
        if not builtin:
            self.ensure_loaded()
        if name in self.plugins and self.plugins[name].error is None:
            return self.plugins[name]
        if not builtin:
            for ep in self._entry_points():
                if ep.name == name:
                    return self._load_entry_point(ep)
        dist, version = _distribution_of(name)
        return self._load(name, name, lambda: importlib.import_module(name),
                          distribution=dist, version=version, builtin=builtin)

    def _load(self, name: str, module: str, loader: Callable[[], Any], *, distribution: Optional[str] = None,
              version: Optional[str] = None, builtin: bool = False) -> PluginInfo:
        """Import a plugin and call its ``zoo_register`` hook, recording what it adds. A failing
        plugin is withdrawn, recorded and warned about; ``ZOO_STRICT_PLUGINS=1`` makes it fatal."""
        if name in self.plugins and self.plugins[name].error is None:
            return self.plugins[name]
        info = PluginInfo(name=name, module=module, distribution=distribution, version=version, builtin=builtin)
        self.plugins[name] = info
        plugin = None
        slow = _slow_notice(name, distribution or module, quiet=builtin)
        try:
            with self.providing(name):
                plugin = loader()
                if self.pm.is_registered(plugin):  # already loaded under another name
                    del self.plugins[name]
                    return self.plugins[self.pm.get_name(plugin)]
                _warn_unmarked_hook(plugin, name, distribution or module)
                self.pm.register(plugin, name=name)
                others = [p for p in self.pm.get_plugins() if p is not plugin]
                self.pm.subset_hook_caller("zoo_register", remove_plugins=others)(registry=self)
            for kind, reg in self.registries.items():  # parts of its modules registered before it loaded
                info.registered += [(kind, e.name) for by_provider in reg._all.values() for e in by_provider.values()
                                    if e.provider == name and (kind, e.name) not in info.registered]
            if not self._loading:  # loaded on its own, after every other part: its families can be checked now
                self._check_families(info)
        except (Exception, SystemExit) as exc:  # a plugin must not take zoo down unless asked to
            self._withdraw(info, plugin, exc)
        finally:
            slow.cancel()
        return info

    def _withdraw(self, info: "PluginInfo", plugin: Any, exc: BaseException) -> None:
        """Undo everything a failing plugin registered (parts, registry kinds, its hooks), then warn,
        or raise in strict mode and for the built-ins."""
        name = info.name
        info.error = f"{type(exc).__name__}: {exc}"
        for kind, part in info.registered:
            self.registries[kind].remove(part, name)
        info.registered.clear()
        for kind, provider, interface in list(self._added_kinds):
            if provider == name:  # a kind the plugin added goes with it
                self._added_kinds.remove((kind, provider, interface))
                self.registries.pop(kind, None)
                kinds.INTERFACES.pop(kind, None)
                if interface is not None:
                    kinds.INTERFACES[kind] = interface
        if plugin is None and self.pm.has_plugin(name):
            plugin = self.pm.get_plugin(name)
        if plugin is not None and self.pm.is_registered(plugin):
            self.pm.unregister(plugin)
        message = f"zoo plugin {name!r} ({info.distribution or info.module}) failed to load: {info.error}"
        if info.builtin or _env_flag("ZOO_STRICT_PLUGINS"):
            raise PluginError(message) from exc
        warnings.warn(message + " It was skipped; set ZOO_STRICT_PLUGINS=1 to make this an error.",
                      PluginWarning, stacklevel=4)
