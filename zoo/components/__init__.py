"""The built-in catalogue of parts, loaded as a plugin through the same hook as third-party ones."""

import importlib

from zoo.core.hooks import hookimpl

MODULES = ("stability", "norms", "activations", "ffn.dense", "positions.rope_scaling", "positions.encodings",
           "mixers.attention", "mixers.none", "blocks", "ffn.routers", "ffn.moe", "kernels", "mixers.mla", "mixers.dsa",
           "mixers.linear_attention", "mixers.mamba2", "mixers.gated_deltanet")


@hookimpl
def zoo_register(registry):
    # Each module registers its parts with @zoo.register while it is imported here, so the
    # registrations are attributed to this plugin.
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")
