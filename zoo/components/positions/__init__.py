"""Position encodings (encodings.py) and RoPE frequency scalings (rope_scaling.py).

Importing a part from the package itself is deprecated since zoo 0.2 (removed in 0.4): import it
from zoo.components.positions.encodings."""

from zoo.core.deprecations import moved_module

__getattr__, __dir__ = moved_module(__name__)
