"""The kinds of part: the base each kind implements, every kind zoo knows (:data:`KINDS`), and the
interface check each registration passes (the tables below). The forward context is
:mod:`zoo.core.context`; the plugin hook is :mod:`zoo.core.hooks`.

The interfaces are deliberately thin, so that fast kernels (SDPA, flex attention, Triton) fit behind them:

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
part reads its attributes. It also states how it shards under tensor parallelism
(:func:`parallelize`, the ``parallelize`` hook below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

import dataclasses
import inspect

import torch
from torch import nn

from zoo.core import deprecations as _deprecations


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

    def parallelize(self, tp_mesh: Any) -> None:
        """Tensor parallelism (:func:`parallelize`): a rotary encoding (or none) has nothing to shard, its
        tables are made per forward for the whole sequence, which the mixers see gathered. Default: an
        absolute encoding (added to the sequence-sharded embeddings) or a score bias (per global head)
        has no plan, and refuses."""
        if self.applies_to not in ("qk", "none"):
            raise no_plan(self)


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

    def parallelize(self, tp_mesh: Any) -> None:
        """Shard this mixer over ``tp_mesh`` (tensor and sequence parallelism). Called once by its
        block's ``parallelize`` (:func:`parallelize`), on the meta device, before activation
        checkpointing and FSDP2. The contract: ``x`` arrives as this process's slice of the sequence,
        a local (B, T / tp, d_model) tensor, and the output leaves the same way; in between the part
        does what its plan says (``torch.distributed.tensor.parallel.parallelize_module`` with
        ``PrepareModuleInput``, ``ColwiseParallel``, ``RowwiseParallel``), computes with its local head
        counts, and makes sure every parameter held whole on each process gets its whole gradient
        (:func:`zoo.core.parallel.grad_summed`). Default: no plan, so ``tp > 1`` is an error naming the part."""
        raise no_plan(self)


def no_plan(part: nn.Module, where: str = "") -> NotImplementedError:
    """The error for a part without a tensor-parallel plan (``tp > 1`` cannot shard it)."""
    at = f"{where} " if where else ""
    return NotImplementedError(
        f"{at}({type(part).__module__}.{type(part).__qualname__}) has no tensor-parallel plan: it does not "
        "define parallelize(tp_mesh, ...), so parallel.tp > 1 cannot shard it; set tp = 1, or give the part a "
        "plan (docs/training.md, 'Tensor and sequence parallelism')")


def parallelize(part: nn.Module, tp_mesh: Any, where: str, **kw: Any) -> None:
    """Ask ``part`` (at ``where`` in the model, e.g. ``layers.3.ffn``) to shard itself over ``tp_mesh``:
    its ``parallelize(tp_mesh, **kw)`` hook. Every kind has the hook with the same name:

    - a mixer or an FFN: ``parallelize(tp_mesh)``, local sequence slices in and out (:meth:`Mixer.parallelize`);
    - a norm: ``parallelize(tp_mesh, shard_dim=...)``: its input arrives split on ``shard_dim`` (1: the
      sequence of the residual stream, or the heads of a per-head QK-norm; -1: the normalised features
      themselves, a QK-norm over a whole projection) and leaves split the same way, local;
    - a position encoding: ``parallelize(tp_mesh)``: RoPE has nothing to shard (its tables are computed
      per forward for the whole sequence); an absolute or bias encoding refuses;
    - a block: ``parallelize(tp_mesh, where=...)``: each of its parts, with :func:`parallelize`.

    The decoder calls it for its blocks, final norm and positions (``Decoder.parallelize``), itself called
    by the trainer (``zoo.train.loop.start_model``). A part without the hook (or whose hook is the
    default) makes ``tp > 1`` an error naming it."""
    fn = getattr(part, "parallelize", None)
    if not callable(fn):
        raise no_plan(part, where)
    try:
        fn(tp_mesh, **kw)
    except NotImplementedError as exc:
        if where and not str(exc).startswith(where):
            raise NotImplementedError(f"{where}: {exc}") from None
        raise


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
    if not callable(old):
        return None
    _deprecations.warn("Mixer.head_dim_for(cfg, d_model)")
    return old(cfg, d_model)


def takes_ctx(module: nn.Module) -> bool:
    """Whether ``module.forward`` accepts the forward context after ``x`` (FFNs written before the
    context was passed take ``x`` only, and are called that way)."""
    import inspect

    try:
        inspect.signature(module.forward).bind(None, None)
    except TypeError:
        _deprecations.warn("an FFN whose forward takes no ctx")
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The interface of each kind
# ---------------------------------------------------------------------------------------------

#: Every kind of registered thing. Plugins may add kinds (``registry.add_kind``); zoo's own are all here.
KINDS = (
    "norm",
    "activation",
    "ffn",
    "position",
    "rope_scaling",
    "mixer",
    "block",
    "stability",
    "family",
    "checkpoint_format",
    "router",  # a mixture of experts' router (components/ffn/routers.py)
    "kernel",  # a fast implementation behind a part (zoo.core.kernels dispatches; components/kernels/)
)

#: The keyword arguments the builder passes to each module-like kind's constructor
#: (``cls(config, **context)``), and the arguments of its ``forward``.
CONSTRUCTOR_CONTEXT: dict[str, tuple[str, ...]] = {
    "norm": ("dim",),
    "activation": (),
    "ffn": ("d_model",),
    "position": ("spec", "layer"),
    "rope_scaling": ("dim", "theta"),
    "mixer": ("d_model", "layer", "spec", "index"),
    "block": ("spec", "layer", "index"),
    "router": ("d_model", "n_experts", "top_k"),
}
#: The arguments of each kind's ``forward``. An FFN is called ``(x, ctx)`` when its forward takes the
#: context (``ctx=None`` when it runs alone), else ``(x)``.
FORWARD_ARGS: dict[str, tuple[str, ...]] = {
    "norm": ("x",),
    "activation": ("x",),
    "ffn": ("x",),
    "mixer": ("x", "ctx", "pos"),
    "block": ("x", "ctx", "pos"),
    "router": ("x",),
}
#: Methods a kind must provide beyond its constructor and forward. A mixer's ``new_state``,
#: ``rotary_dim``, ``cost`` and ``facts`` are optional (see zoo.core.kinds.Mixer for the defaults).
METHODS: dict[str, tuple[str, ...]] = {
    "position": ("embed", "prepare", "rotate", "score_bias"),
    "rope_scaling": ("frequencies",),
    "family": ("recipe", "spec", "hf_ids"),
}
POSITION_APPLIES_TO = ("embedding", "qk", "bias", "none")

INTERFACES: dict[str, Callable[[Any], list[str]]] = {}

#: Old names of kinds, still accepted everywhere a kind is named: attention is one kind of token mixer.
KIND_ALIASES = {"attention": "mixer"}


def canonical_kind(kind: str) -> str:
    """The kind's current name (``attention`` -> ``mixer``, deprecated)."""
    if kind in KIND_ALIASES:
        _deprecations.warn(f"kind {kind!r}")
    return KIND_ALIASES.get(kind, kind)


def interface(kind: str):
    """Declare the interface check of a kind: a function returning what an object lacks (a list
    of phrases, empty when it conforms). Plugins that add a kind declare its interface too."""

    def deco(fn: Callable[[Any], list[str]]):
        INTERFACES[kind] = fn
        return fn

    return deco


def _accepts(fn: Any, positional: int, keywords: tuple[str, ...]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: give them the benefit of the doubt
        return True
    try:
        sig.bind(*([None] * positional), **{k: None for k in keywords})
    except TypeError:
        return False
    return True


def _module_part(kind: str) -> Callable[[Any], list[str]]:
    def check(obj: Any) -> list[str]:
        from torch import nn

        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            return [f"to be a torch.nn.Module subclass (got {obj!r})"]
        missing = []
        cfg = getattr(obj, "Config", None)
        if cfg is None or not dataclasses.is_dataclass(cfg):
            missing.append("a `Config` dataclass attribute holding its settings (an empty one if it has none)")
        ctx = CONSTRUCTOR_CONTEXT[kind]
        if not _accepts(obj, 1, ctx):
            args = ", ".join(("config", *(f"{k}=..." for k in ctx)))
            missing.append(f"a constructor accepting `({args})`")
        fwd = FORWARD_ARGS.get(kind)
        if fwd and not _accepts(getattr(obj, "forward"), 1 + len(fwd), ()):
            missing.append(f"`forward(self, {', '.join(fwd)})`")
        for name in METHODS.get(kind, ()):
            if not callable(getattr(obj, name, None)):
                missing.append(f"a `{name}` method")
        if kind == "position" and getattr(obj, "applies_to", None) not in POSITION_APPLIES_TO:
            missing.append(f"`applies_to` set to one of {', '.join(map(repr, POSITION_APPLIES_TO))} "
                           "(subclass zoo.core.kinds.PositionEncoding)")
        return missing

    return check


for _kind in CONSTRUCTOR_CONTEXT:
    INTERFACES[_kind] = _module_part(_kind)


@interface("stability")
def _stability(obj: Any) -> list[str]:
    return [] if callable(obj) else ["to be callable (a function of tensors)"]


@interface("family")
def _family(obj: Any) -> list[str]:
    missing = []
    if not isinstance(getattr(obj, "name", None), str):
        missing.append("a `name` string")
    if not isinstance(getattr(obj, "presets", None), dict):
        missing.append("a `presets` dict mapping preset names to their settings")
    for name in METHODS["family"]:
        if not callable(getattr(obj, name, None)):
            missing.append(f"a `{name}` method (use zoo.Family, e.g. zoo.Family.from_toml(path))")
    return missing


def module_interface(kind: str, constructor: tuple[str, ...], forward: tuple[str, ...] = (),
                     methods: tuple[str, ...] = ()) -> Callable[[Any], list[str]]:
    """The interface check of a module-like kind a plugin adds (``registry.add_kind(kind, check)``):
    an ``nn.Module`` with a ``Config``, built as ``cls(config, **constructor)``, called with ``forward``."""
    CONSTRUCTOR_CONTEXT[kind], FORWARD_ARGS[kind], METHODS[kind] = constructor, forward, methods
    return _module_part(kind)


def check(kind: str, obj: Any) -> list[str]:
    """What ``obj`` lacks to be registered as a ``kind`` (empty when it conforms)."""
    fn = INTERFACES.get(canonical_kind(kind))
    return fn(obj) if fn is not None else []


def __getattr__(name: str) -> Any:
    if name == "Rotary":  # the name of PositionState before mixers
        _deprecations.warn("zoo.core.kinds.Rotary")
        return PositionState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
