"""The built-in catalogue of parts, loaded as a plugin through the same hook as third-party ones."""

import importlib

from zoo.hookspecs import hookimpl

MODULES = ("stability", "norms", "activations", "ffn", "positions", "rope_scaling", "attention", "blocks", "moe", "kernels",
           "mla", "dsa", "linear_attention", "mamba2", "gated_deltanet", "ffn_only")


@hookimpl
def zoo_register(registry):
    # Each module registers its parts with @zoo.register while it is imported here, so the
    # registrations are attributed to this plugin.
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")
