"""Optional dependencies: a module an extra of zoo-lm installs, or an error naming that extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_extra(name: str, needed_by: str, extra: str) -> ModuleType:
    """The module ``name``, or a ``ModuleNotFoundError`` (its ``name`` the module's) saying
    "``needed_by`` ``name``, which the main install leaves out: pip install 'zoo-lm[``extra``]'" when it
    is not installed. A module missing inside it (a dependency of its own) is raised as it is."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != name:
            raise
        raise ModuleNotFoundError(f"{needed_by} {name}, which the main install leaves out: "
                                  f"pip install 'zoo-lm[{extra}]'", name=name) from None
