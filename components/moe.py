"""Deprecated since zoo 0.2, removed in 0.4: moved to zoo.components.ffn.moe, zoo.components.ffn.routers."""

from zoo.core.deprecations import moved_module

__getattr__, __dir__ = moved_module(__name__)
