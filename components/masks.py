"""Attention masks that depend on the data (padding, cached slots) are the same for every layer of
a forward: build each once per forward and share it.

:func:`per_forward` keys a mask on the identity of the tensors it is built from (the forward's
slot and key-mask tensors, which every layer receives as the same objects) and forgets it when
any of them is freed, so nothing outlives its forward and an id is never reused while cached.
Under ``torch.compile`` it builds every time: the compiler sees one traced build per layer and
shares or fuses them itself.
"""

import weakref
from typing import Callable

import torch

_memo: dict = {}


def per_forward(tensors: tuple, extra, build: Callable):
    """``build()`` once for these tensors (``None`` entries allowed) and ``extra`` (hashable)."""
    if torch.compiler.is_compiling():
        return build()
    key = tuple(id(t) for t in tensors) + (extra,)
    hit = _memo.get(key)
    if hit is None:
        hit = _memo[key] = build()
        for t in tensors:
            if t is not None:
                weakref.finalize(t, _memo.pop, key, None)
    return hit
