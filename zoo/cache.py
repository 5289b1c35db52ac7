"""Old home of the key/value cache, kept so that code importing it keeps working.

The decode state now lives in :mod:`zoo.state`: each mixer makes its own layer state, and
``model.new_state(batch, max_len)`` makes the model's :class:`~zoo.state.DecodeState`.
"""

from __future__ import annotations

from typing import Optional

from zoo.state import DecodeState, KVState  # noqa: F401


class KVCache:
    """``KVCache.for_model(model, max_len)``: the old spelling of ``model.new_state(None, max_len)``."""

    @staticmethod
    def for_model(model, max_len: Optional[int] = None) -> DecodeState:
        return model.new_state(None, max_len)
