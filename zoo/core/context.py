"""The forward context: what one forward pass hands every part (positions, masks, decode state,
auxiliary losses and metrics)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar
import torch

from zoo.core import deprecations as _deprecations


T = TypeVar("T")

_RECOMPUTING = [False]  # a plain global (not a ContextVar): torch.compile traces a read of it without a break


def recomputing() -> bool:
    """True while activation checkpointing recomputes a block's forward during backward. A part with a
    side effect in its forward (a counter of tokens per expert) skips it then, so that it happens once
    per forward; :class:`ForwardContext` ignores the losses and metrics added then."""
    return _RECOMPUTING[0]


@contextlib.contextmanager
def recomputation():
    """The scope :func:`recomputing` reports (entered by zoo's activation checkpointing)."""
    before, _RECOMPUTING[0] = _RECOMPUTING[0], True
    try:
        yield
    finally:
        _RECOMPUTING[0] = before


#: (metric names, callback) of each open :func:`asking` scope.
_ASKING: list[tuple[frozenset, Callable[["ForwardContext"], None]]] = []


@contextlib.contextmanager
def asking(names: Iterable[str], on_finish: Callable[["ForwardContext"], None]) -> Iterator[None]:
    """Within the block, every new forward context asks its parts for the optional metrics ``names``
    (``ctx.asks(name)``: attention's ``attn_logit_max``), and is passed to ``on_finish(ctx)`` after
    the model's last layer, its ``metrics`` filled."""
    entry = (frozenset(names), on_finish)
    _ASKING.append(entry)
    try:
        yield
    finally:
        _ASKING.remove(entry)


class ForwardContext:
    """What every layer needs to know about the current forward pass.

    ``slots`` are the absolute slots of the current tokens in the sequence (including left
    padding), which causal and sliding-window masks are computed on; ``position_ids`` are the
    positions the position encoding sees (they skip padding). ``key_mask`` (B, past + T) marks
    real tokens, ``None`` when there is no padding. ``state`` is the decode state
    (:class:`zoo.core.state.DecodeState`) when decoding incrementally: a mixer reads and updates its own
    entry ``state.layers[index]`` and nothing else.

    Parts report training signals through :meth:`add_loss` and :meth:`add_metric`; the model's loss
    output carries them. (A plain class, not a dataclass, on purpose: wrappers such as FSDP2 rebuild
    dataclass arguments that hold tensors needing gradients, and the terms added by one block would
    then be lost to the next.)
    """

    def __init__(self, position_ids: torch.Tensor, slots: torch.Tensor, key_mask: Optional[torch.Tensor] = None,
                 state: Any = None):
        self.position_ids, self.slots, self.key_mask, self.state = position_ids, slots, key_mask, state
        self.aux: dict[str, torch.Tensor] = {}
        self.aux_weights: dict[str, float] = {}
        self.metrics: dict[str, torch.Tensor] = {}
        self._metric_counts: dict[str, int] = {}
        #: Room for parts to gather what they share across layers in one forward (router statistics
        #: pooled over every layer, say), keyed by a name the parts agree on; zoo's own parts use the
        #: typed :meth:`slot` instead.
        self.shared: dict[str, Any] = {}
        self._slots: dict[type, Any] = {}
        self._at_end: dict[str, Callable[["ForwardContext"], None]] = {}
        #: The optional metrics parts are asked to report (see :func:`asking`), and who reads them.
        self.asked: frozenset = frozenset().union(*(names for names, _ in _ASKING))
        self._readers = [fn for _, fn in _ASKING]
        #: The number of layers of the model running (set by the model; None elsewhere).
        self.n_layers: Optional[int] = None
        #: (B, T) the packed document of each token (non-decreasing along a row), or None: one
        #: sequence per row. A mixer that states ``documents = True`` keeps each document to itself
        #: (attention within it, recurrent state reset at its first token).
        self.documents: Optional[torch.Tensor] = None

    def asks(self, name: str) -> bool:
        """Whether a part should report the optional metric ``name`` (costly to compute) in this forward."""
        return name in self.asked

    def slot(self, kind: type[T]) -> T:
        """What the layers of this forward share of one kind: the one instance of ``kind``, a class the
        producing part defines (made with no arguments on first use): DSA's selections by the layer that
        made them, a mixture of experts' layer count and pooled statistics. Typed and owned by its
        producer, where :attr:`shared` is keyed by strings the parts must agree on."""
        out = self._slots.get(kind)
        if out is None:
            out = self._slots[kind] = kind()
        return out

    def at_end(self, key: str, fn: Callable[["ForwardContext"], None]) -> None:
        """Run ``fn(ctx)`` once after the last layer (registered once per ``key``, however many layers
        ask): where a loss pooled over layers is computed from what a :meth:`slot` gathered."""
        self._at_end.setdefault(key, fn)

    def finish(self) -> None:
        """Called by the model after its last layer."""
        for fn in self._at_end.values():
            fn(self)
        for fn in self._readers:
            fn(self)

    def add_loss(self, name: str, value: torch.Tensor, weight: float = 1.0) -> None:
        """Add an auxiliary loss term: the total loss gains ``weight * value``. Terms of one name
        (one per MoE layer, say) add up; their weights must agree."""
        if recomputing():  # added once already, in the forward
            return
        if name in self.aux:
            if self.aux_weights[name] != weight:
                raise ValueError(f"auxiliary loss {name!r} added with weights {self.aux_weights[name]} and {weight}")
            self.aux[name] = self.aux[name] + value
        else:
            self.aux[name], self.aux_weights[name] = value, float(weight)

    def add_metric(self, name: str, value: torch.Tensor) -> None:
        """Record a metric (no gradient); values of one name from several layers are averaged."""
        if recomputing():
            return
        value = value.detach()
        n = self._metric_counts.get(name, 0)
        self.metrics[name] = value if n == 0 else self.metrics[name] + (value - self.metrics[name]) / (n + 1)
        self._metric_counts[name] = n + 1

    def aux_total(self) -> Optional[torch.Tensor]:
        """``sum(weight * value)`` over the auxiliary losses, or None when there are none."""
        total = None
        for name, value in self.aux.items():
            term = self.aux_weights[name] * value
            total = term if total is None else total + term
        return total

    @property
    def q_idx(self) -> torch.Tensor:  # the name before mixers
        _deprecations.warn("ForwardContext.q_idx")
        return self.slots


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 where ``documents`` (B, T) changes along a row."""
    T = documents.shape[-1]
    idx = torch.arange(T, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) True at the first token of each document after a row's first: where state must reset."""
    starts = torch.zeros_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts
