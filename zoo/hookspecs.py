"""The plugin contract: what a zoo plugin may implement.

A plugin is a module (found through the ``zoo.plugins`` entry-point group, or named in
``ZOO_PLUGINS``) that implements these hooks with ``@zoo.hookimpl``. Hooks take keyword
arguments only, so the contract can grow without breaking existing plugins.
"""

import pluggy

hookspec = pluggy.HookspecMarker("zoo")
hookimpl = pluggy.HookimplMarker("zoo")


@hookspec
def zoo_register(registry):
    """Register parts. ``registry`` is the plugin manager: call ``registry.add(kind, name, obj)``,
    or import modules whose ``@zoo.register(kind, name)`` decorators do it. Every registration
    made while this hook runs is attributed to the plugin."""
