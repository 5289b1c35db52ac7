"""Deprecated since zoo 0.2, removed in 0.4: the decode state lives in :mod:`zoo.core.state`.

``KVCache.for_model(model, max_len)`` is the old spelling of ``model.new_state(None, max_len)``.
"""

from __future__ import annotations

from typing import Optional

from zoo.core.deprecations import moved_module, warn

__getattr__, __dir__ = moved_module(__name__)


class KVCache:
    """``KVCache.for_model(model, max_len)``: the old spelling of ``model.new_state(None, max_len)``."""

    @staticmethod
    def for_model(model, max_len: Optional[int] = None):
        warn("zoo.cache.KVCache.for_model(model, max_len)")
        return model.new_state(None, max_len)
