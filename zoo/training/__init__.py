"""Training: the run's settings (config), the loop, its checkpoints, resuming and the data.

``zoo.train`` is the function :func:`zoo.training.loop.train`; import the modules by their full path
(``from zoo.training.config import TrainConfig``). zoo 0.1 imported ``train``, ``TrainConfig`` and the
checkpoint helpers from ``zoo.training`` itself, which still works: they are looked up in the modules
below when first asked for."""

import importlib

_HOMES = ("zoo.training.loop", "zoo.training.config", "zoo.training.checkpointer")


def __getattr__(name):
    if not name.startswith("__"):
        for home in _HOMES:
            mod = importlib.import_module(home)
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module 'zoo.training' has no attribute {name!r} (its names live in {', '.join(_HOMES)})")
