"""The built-in family recipes: one TOML file per family, data only. Loaded as a plugin."""

from pathlib import Path

from zoo.core.hooks import hookimpl
from zoo.core.spec import Family


@hookimpl
def zoo_register(registry):
    for path in sorted(Path(__file__).parent.glob("*.toml")):
        family = Family.from_toml(path)
        registry.add("family", family.name, family)
