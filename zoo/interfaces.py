"""The interfaces that registered parts implement, and the context the builder hands them.

They are deliberately thin, so that fast kernels (SDPA, flex attention, Triton) fit behind them:

- a norm is any ``nn.Module`` built as ``cls(config, dim=...)`` and called on ``x``;
- an FFN is built as ``cls(config, d_model=...)`` and called as ``ffn(x, ctx)`` (``ctx`` may be
  ``None`` when it runs alone; an FFN may add auxiliary losses and metrics to it);
- a token *mixer* (attention is one kind; recurrent and latent mixers are others) is built as
  ``cls(config, d_model=..., layer=..., spec=..., index=...)`` and called as
  ``mixer(x, ctx, pos)``. It owns its decode state: :meth:`Mixer.new_state` makes one layer's
  state, which it finds again as ``ctx.state.layers[index]``;
- a position encoding is a :class:`PositionEncoding`; each layer sees it through a
  :class:`PositionState` (its per-forward tables).

A part states its own facts (:class:`Cost`, :meth:`Mixer.facts`, ``shrink``); nothing outside a
part reads its attributes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from zoo.spec import Part


class PositionEncoding(nn.Module):
    """Base for position encodings. Absolute ones add to the embeddings; rotary ones rotate q and k;
    bias ones (ALiBi) add to the attention scores. Override what applies."""

    #: "embedding" (added to token embeddings), "qk" (rotates queries and keys), "bias", or "none".
    applies_to: ClassVar[str] = "none"

    @classmethod
    def max_positions(cls, config: Any, spec: Any) -> Optional[int]:
        """The most positions this encoding can represent in a model of ``spec`` (a learned table
        has ``max_seq_len`` rows); None when it has no hard limit (RoPE and ALiBi extrapolate)."""
        return None

    def embed(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        return None

    def prepare(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-forward state shared by every layer using this encoding (RoPE's cos and sin)."""
        return position_ids

    def rotate(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def score_bias(self, state: Any, q_idx: torch.Tensor, k_idx: torch.Tensor, n_heads: int) -> Optional[torch.Tensor]:
        """An additive (1 or B, H, Tq, Tk) bias on attention scores, or None."""
        return None


@dataclass
class PositionState:
    """A layer's view of its position encoding during one forward (RoPE's tables, ALiBi's slopes)."""

    module: PositionEncoding
    state: Any

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.rotate(q, k, self.state)

    def score_bias(self, q_idx: torch.Tensor, k_idx: torch.Tensor, n_heads: int) -> Optional[torch.Tensor]:
        return self.module.score_bias(self.state, q_idx, k_idx, n_heads)

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A rotary encoding's cosine and sine per rotated pair, (B, 1, T, rotary_dim / 2)."""
        fn = getattr(self.module, "pairs", None)
        if fn is None:
            raise TypeError(f"position encoding {type(self.module).__name__} gives no rotation angles (pairs)")
        return fn(self.state)


#: The name this had before mixers (kept so that plugin code importing it keeps working).
Rotary = PositionState


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


class ForwardContext:
    """What every layer needs to know about the current forward pass.

    ``slots`` are the absolute slots of the current tokens in the sequence (including left
    padding), which causal and sliding-window masks are computed on; ``position_ids`` are the
    positions the position encoding sees (they skip padding). ``key_mask`` (B, past + T) marks
    real tokens, ``None`` when there is no padding. ``state`` is the decode state
    (:class:`zoo.state.DecodeState`) when decoding incrementally: a mixer reads and updates its own
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
        #: pooled over every layer, say), keyed by a name the parts agree on.
        self.shared: dict[str, Any] = {}
        self._at_end: dict[str, Callable[["ForwardContext"], None]] = {}

    def at_end(self, key: str, fn: Callable[["ForwardContext"], None]) -> None:
        """Run ``fn(ctx)`` once after the last layer (registered once per ``key``, however many layers
        ask): where a loss pooled over layers is computed from what ``shared`` gathered."""
        self._at_end.setdefault(key, fn)

    def finish(self) -> None:
        """Called by the model after its last layer."""
        for fn in self._at_end.values():
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
        return self.slots


@runtime_checkable
class LayerState(Protocol):
    """One layer's decode state, made by its mixer's ``new_state`` and opaque to everything else.

    ``nbytes()`` is what it holds now. ``to_static(max_len)`` (optional) returns a copy with
    fixed-size buffers that a compiled single-token step can update in place; a state without it
    cannot be used by compiled decoding.
    """

    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Cost:
    """What one part costs, as the part itself reports it (see ``cost(context)``).

    ``active_params``: parameters one token uses (None: all of them; a mixture of experts uses
    fewer). ``flops``: forward FLOPs per token at position ``context`` beyond ``2 x`` the weights
    it multiplies (attention's scores and weighted sum); ``flops_mean``: the same averaged over a
    causal sequence of ``context`` tokens. Decode state, in elements (times the storage dtype's
    bytes for bytes), for one sequence: ``state_per_token``, what each token adds while the state
    grows; ``state_at_context``, what is held after ``context`` tokens (a window caps it);
    ``state_fixed``, what is held whatever the length (a recurrent state).
    """

    active_params: Optional[int] = None
    flops: float = 0.0
    flops_mean: float = 0.0
    state_per_token: int = 0
    state_at_context: int = 0
    state_fixed: int = 0


class Mixer(nn.Module):
    """Optional base for token mixers: the methods a mixer may provide, with their defaults.

    A mixer need not subclass this (the interface is checked by shape), but the defaults say what
    the core assumes when a method is missing.
    """

    @classmethod
    def rotary_dim(cls, cfg: Any, d_model: int) -> Optional[int]:
        """The width of the vectors a ``qk`` position encoding rotates (a head's width), or None when
        this mixer takes no rotation. Position modules are built per (position, this width)."""
        return None

    def new_state(self, batch: int, max_len: Optional[int], *, dtype: torch.dtype, device: Any) -> Optional[LayerState]:
        """This layer's decode state for ``batch`` rows of up to ``max_len`` tokens (None: unknown),
        or None when the mixer cannot decode incrementally (``generate`` then refuses the model)."""
        return None

    def cost(self, context: int) -> Cost:
        return Cost()

    def facts(self) -> dict[str, Any]:
        """Facts for ``zoo describe`` (name -> value), in display order."""
        return {}


def rotary_dim_of(layer: Any, d_model: int) -> Optional[int]:
    """The rotation width the mixer of ``layer`` (a LayerSpec) asks for, or None.

    A mixer registered before mixers existed declares ``head_dim_for(cfg, d_model)`` instead of
    ``rotary_dim``: that is read as its rotation width.
    """
    cls, cfg = layer.mixer.cls, layer.mixer.config
    fn = getattr(cls, "rotary_dim", None)
    if callable(fn):
        return fn(cfg, d_model)
    old = getattr(cls, "head_dim_for", None)
    return old(cfg, d_model) if callable(old) else None


def takes_ctx(module: nn.Module) -> bool:
    """Whether ``module.forward`` accepts the forward context after ``x`` (FFNs written before the
    context was passed take ``x`` only, and are called that way)."""
    import inspect

    try:
        inspect.signature(module.forward).bind(None, None)
    except TypeError:
        return False
    return True


def build_part(part: Part | str, kind: str, **context: Any) -> nn.Module:
    """Build a part given as a :class:`Part` or a bare registered name (default config)."""
    if isinstance(part, str):
        from zoo.spec import parse_part

        part = parse_part(kind, part, kind)
    return part.build(**context)
