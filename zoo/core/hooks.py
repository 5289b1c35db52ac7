"""The plugin hook: what a zoo plugin implements (``zoo_register``).

A plugin is a module, found through the ``zoo.plugins`` entry-point group (or loaded by name
through ``ZOO_PLUGINS`` / :func:`zoo.load_plugin`), that implements ``zoo_register`` with
``@zoo.hookimpl``. pluggy calls hooks with keyword arguments only, and an implementation may
accept any subset of a hook's arguments, so the contract can grow without breaking plugins.

The interface of each kind of part, checked when a part is registered, is :mod:`zoo.core.kinds`.
"""

from __future__ import annotations

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
