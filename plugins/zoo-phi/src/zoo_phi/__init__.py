"""The Phi family and the ``phi`` checkpoint format, registered into zoo through the ``zoo.plugins`` entry point."""

from pathlib import Path

import zoo


@zoo.hookimpl
def zoo_register(registry):
    from zoo_phi.format import Phi

    registry.add_family(Path(__file__).with_name("phi.toml"))
    registry.add_checkpoint_format("phi", Phi())
