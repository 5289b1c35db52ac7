"""Feed-forward parts: dense FFNs (dense.py), the mixture of experts (moe.py) and its routers (routers.py).

Importing a part from the package itself is deprecated since zoo 0.2 (removed in 0.4): import it
from zoo.components.ffn.dense."""

from zoo.core.deprecations import moved_module

__getattr__, __dir__ = moved_module(__name__)
