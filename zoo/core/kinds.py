"""The kinds of part: the base each kind implements, every kind zoo knows (:data:`KINDS`), and the
interface check each registration passes (the tables below). The forward context is
:mod:`zoo.core.context`; the plugin hook is :mod:`zoo.core.hooks`.

One base per kind (:class:`Norm`, :class:`Activation`, :class:`FFN`, :class:`Router`,
:class:`Experts`, :class:`Mixer`, :class:`Block`, :class:`PositionEncoding`, :class:`RopeScaling`, all under
:class:`Part`; :class:`LayerState` for decode states) declares the constructor context
(``CONTEXT``: ``cls(config, **context)``), the forward arguments (``FORWARD``) and every hook, with
its default and its caller. This is the one statement of the contract: :data:`BASES`, the tables
derived from it, the registration check and docs/guides/plugins.md's table (:func:`contract_table`) all
read it. A part states its own facts (:class:`Cost`, ``facts``, ``shrink``); nothing outside a part
reads its attributes. It also states how it shards under tensor parallelism (:func:`parallelize`,
the ``parallelize`` hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import dataclasses
import inspect

import torch
from torch import nn

from zoo.core import deprecations as _deprecations
from zoo.core.parallel import apply_plan


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


# ---------------------------------------------------------------------------------------------
# The bases: every hook a part may implement, with its signature, its default and its caller
# ---------------------------------------------------------------------------------------------

def required(fn: Callable) -> Callable:
    """Mark a base's method as one every part of the kind must implement itself (no default)."""
    fn.__zoo_required__ = True
    return fn


class Kernels:
    """The hooks of a module with fast kernels (``zoo.core.kernels`` dispatches): every part has
    them (:class:`Part`), and so does the model for its fused loss."""

    #: The kernel component this part runs (``"attention"``, ``"rmsnorm"``), or None for no fast path.
    kernel: ClassVar[Optional[str]] = None
    #: The backends it accepts, in order of preference (fast ones registered as kernels, reference ones).
    backends: ClassVar[tuple[str, ...]] = ()

    def kernel_problem(self, backend: str, x: Optional[torch.Tensor] = None, forced: bool = False) -> Optional[str]:
        """Called by ``zoo.core.kernels.decide``: why ``backend`` cannot run this part on ``x`` (a
        phrase), or None when it can. Default: it can."""
        return None

    def reference_backend(self) -> str:
        """Called by ``zoo.core.kernels.backend_table``: the backend this part runs without a fast one."""
        return "torch"

    #: How its fast kernel meets DTensors (tensor and sequence parallelism; ``zoo.core.kernels.fast``):
    #: ``"rows"``: it maps each row of the input to a row over the last dimension with parameters
    #: per feature (a norm), so it runs on each process's rows through ``local_map``; ``"layers"``:
    #: its input only reaches its own sub-layers, which take DTensors themselves, so it runs as it is;
    #: None: given a DTensor, it steps aside to the reference path and says so once.
    kernel_on_shards: ClassVar[Optional[str]] = None

    def kernel_tensors(self) -> tuple:
        """Called by ``zoo.core.kernels.fast``: the tensors besides its input that its fast kernel reads
        whole (a sharded one makes it step aside). Default: none; a ``"rows"`` part's own parameters
        are looked at for it."""
        return ()


class Part(Kernels, nn.Module):
    """The hooks every module-like part (norm, activation, FFN, mixer, block, position, router, rope
    scaling) may override. Each line says who calls it; the default is what the core assumes when a
    part does not override it. A part class holds a ``Config`` dataclass and is built as
    ``cls(config, **context)`` with the context of its kind (:data:`CONSTRUCTOR_CONTEXT`).

    A class registered without inheriting its kind's base gets the defaults it lacks mixed in at
    registration (:func:`adapt`), so the core always calls the method and never looks it up.
    A part states how it shards under tensor parallelism as data (``tp_plan``, ``tp_divides``).
    """

    # -- spec time (class-level: called with the part's config, before anything is built) --------
    @classmethod
    def shrink(cls, cfg: Any, **sizes: Any) -> dict[str, Any]:
        """Called by ``zoo.testing.shrink`` with ``head_dim=, d_ff=, window=, d_model=``: the settings
        to change for a tiny copy of this part with the same structure. Default: none."""
        return {}

    @classmethod
    def resolved(cls, cfg: Any, d_model: int) -> Optional[dict[str, Any]]:
        """Called by ``zoo.checkpoints`` (the save check, ``sizes.ffn_size``): the settings with
        defaults resolved (``d_ff`` from its rule), so two spellings of one part compare equal.
        Default None: the config as written."""
        return None

    @classmethod
    def check_in_model(cls, cfg: Any, *, spec: Any, layer: Any) -> None:
        """Called by ``ModelSpec`` validation: raise ``SpecError`` for a setting that is wrong only
        in this model (a head count that does not divide d_model). Default: no check."""
        return None

    # -- built (instance-level) --------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Called by ``Decoder.init_weights`` after the generic init of matrices and embeddings and
        after the torch modules inside the part (a ``Conv1d``) re-ran their own: the part's own
        initialisation is final. Default: nothing."""

    def reset_buffers(self) -> None:
        """Called by ``zoo.checkpoints`` after a load, once non-persistent buffers are zeroed: refill
        them (running counts, caches). Default: leave them zero."""

    def after_optimizer_step(self, *, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Called by ``zoo.train`` after every optimizer step on every process (``reduce`` sums a
        tensor over processes): an aux-loss-free expert-bias update. Default: nothing."""

    def cost(self, context: int) -> Cost:
        """Called by ``zoo.tools.accounting``: what this part costs at ``context`` (:class:`Cost`).
        Default: only its weights."""
        return Cost()

    def facts(self) -> dict[str, Any]:
        """Called by ``zoo describe`` (``zoo.tools.accounting``): facts, name -> value, in display order."""
        return {}

    def activation_bytes(self, seq_len: int, dtype: torch.dtype, *, tp: int = 1, device: str = "cuda") -> Optional[float]:
        """Called by ``zoo.tools.memory`` (``zoo describe --parallel``): the bytes this part's forward keeps
        for backward (the tensors autograd saves, its parts inside included, its parameters not), per
        token of a sequence of ``seq_len`` tokens whose activations are ``dtype``, on one of ``tp``
        tensor-parallel processes (local heads, the sequence slice it sees), on a ``device`` of that type
        (its fast paths differ). Default None: the part does not say, and the figure names it."""
        return None

    #: Called by ``zoo.tools.memory``: names (relative to this part) of its parameters stacked by expert
    #: on dim 0 (a mixture of experts' ``experts.w_up``), which expert parallelism splits over ``ep``.
    expert_parameters: ClassVar[tuple[str, ...]] = ()

    #: Called by ``zoo.training.loop.param_groups``: the part's own parameters (by name; shell-style
    #: patterns such as ``"b_*"``) that take no weight decay: gains, offsets, biases, decay rates, sinks.
    #: Its other own parameters are decayed. Inside a part, a plain torch module decays the ``weight`` of
    #: a linear or convolution layer and nothing else; an embedding table is never decayed. None (the
    #: default, for a part that says nothing: a plugin written before zoo 0.3) keeps zoo 0.2's rule for
    #: its own parameters, decaying matrices (2-D and more) only.
    no_decay: ClassVar[Optional[tuple[str, ...]]] = None

    #: Called by ``zoo.core.precision``: attribute names of tensors that stay float32 when the model
    #: is cast to a narrower dtype (a router's selection bias).
    fp32_tensors: ClassVar[tuple[str, ...]] = ()

    #: Read by the default :meth:`parallelize` (:func:`zoo.core.parallel.apply_plan`): this part's
    #: tensor-parallel plan as data, submodule name -> style (``""`` is the part itself), e.g. attention's
    #: ``{"": "gather_sequence", "q_proj": "colwise", ..., "o_proj": "rowwise"}``; the styles are
    #: :data:`zoo.core.parallel.TP_STYLES`. None: no plan (``tp > 1`` is an error naming the part), unless
    #: the part writes its own ``parallelize``. A plan that depends on the config may be a property.
    tp_plan: ClassVar[Optional[dict[str, str]]] = None
    #: Read with ``tp_plan``: the part's attributes (``n_heads``, ``d_ff``) that ``tp`` must divide.
    tp_divides: ClassVar[tuple[str, ...]] = ()

    def parallelize(self, tp_mesh: Any, **kw: Any) -> None:
        """Called by :func:`parallelize` (from ``Decoder.parallelize``, itself called by
        ``zoo.training.loop.start_model`` on the meta device, before activation checkpointing and FSDP2):
        shard this part over ``tp_mesh`` (tensor and sequence parallelism). For a mixer or an FFN,
        ``x`` arrives as this process's slice of the sequence, a local (B, T / tp, d_model) tensor,
        and the output leaves the same way; in between the part does what its plan says, computes with
        its local head counts, and makes sure every parameter held whole on each process gets its whole
        gradient (:func:`zoo.core.parallel.grad_summed`). A norm takes ``shard_dim=``. Default: the
        declarative plan (``tp_plan``, ``tp_divides``; :func:`zoo.core.parallel.apply_plan`), or, with
        none, an error naming the part. Write this hook only for what no dict says (packed projections,
        MLA's shared rotary key, experts), with the helpers of :mod:`zoo.core.parallel`."""
        if self.tp_plan is None:
            raise no_plan(self)
        apply_plan(self, tp_mesh, parallelize, **kw)

class Norm(Part):
    """A norm: ``cls(config, dim=...)``, called on ``x``."""

    CONTEXT, FORWARD = ("dim",), ("x",)

    #: A norm's gains and offsets take no weight decay (:attr:`Part.no_decay`).
    no_decay: ClassVar[Optional[tuple[str, ...]]] = ("*",)


class Activation(Part):
    """An activation: ``cls(config)``, called on ``x``."""

    CONTEXT, FORWARD = (), ("x",)

    #: Called by ``zoo.checkpoints.hf.common.hf_activations``: HF activation names this part stands for
    #: (HF name -> this part's config), so configs naming them read as this part.
    hf_names: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Called by the dense FFN: the name of the fused gated-product kernel for this activation, or None.
    fused_name: ClassVar[Optional[str]] = None


class FFN(Part):
    """An FFN: ``cls(config, d_model=...)``, called as ``ffn(x, ctx)`` (``ctx`` None when it runs alone);
    it may add auxiliary losses and metrics to ``ctx``."""

    CONTEXT, FORWARD = ("d_model",), ("x",)

    def parallelize_experts(self, ep_mesh: Any) -> list[nn.Module]:
        """Called by ``Decoder.parallelize_experts`` (from ``zoo.training.loop.start_model`` on the meta device,
        after tensor parallelism, before activation checkpointing and FSDP2) when ``parallel.ep`` > 1:
        shard the routed experts over ``ep_mesh`` (:class:`zoo.core.parallel.ExpertParallel`) and return
        the modules whose parameters are now sharded by expert (FSDP2 shards them over the remaining
        data-parallel dimensions on their own). Default: nothing to shard (the part's parameters stay
        whole and are data-parallel like any other); a model needs one part that shards."""
        return []


class Router(Part):
    """A mixture of experts' router: ``cls(config, d_model=, n_experts=, top_k=)``, called on ``x``."""

    CONTEXT, FORWARD = ("d_model", "n_experts", "top_k"), ("x",)

    @classmethod
    def shrink_to(cls, cfg: Any, n_experts: int) -> dict[str, Any]:
        """Called by the MoE's ``shrink``: settings to change when the experts are cut to ``n_experts``."""
        return {}


class Experts(Part):
    """A mixture of experts' routed experts, stacked by expert on dim 0 (kind ``expert``, chosen by name
    in the ``moe`` FFN's ``expert`` setting): ``cls(config, n_experts=, d_model=, d_ff=, dispatch=)``,
    called as ``experts(xs, counts)`` on token copies already grouped by expert (``counts[e]`` rows for
    expert ``e``, in expert order); returns each row's expert output, in the same order. The MoE routes,
    weighs and sums; under expert parallelism each process holds ``n_experts / ep`` consecutive experts
    of every parameter named in ``expert_parameters`` and gets their token copies. zoo's
    (``zoo.components.ffn.experts``) hold ``w_gate``, ``w_up`` (E x d_ff x d_model), ``w_down``
    (E x d_model x d_ff) and, when biased, ``b_gate``, ``b_up`` (E x d_ff) and ``b_down`` (E x d_model);
    a new activation of gate and up is a subclass overriding ``activate``."""

    CONTEXT, FORWARD = ("n_experts", "d_model", "d_ff", "dispatch"), ("xs", "counts")

    #: Read by checkpoint formats and the MoE's accounting: whether each expert has a gate projection
    #: (``act(gate) * up``-like) besides its up and down projections (a class attribute every kind sets).
    gated: ClassVar[bool]


class Mixer(Part):
    """A token mixer: ``cls(config, d_model=, layer=, spec=, index=)``, called as ``mixer(x, ctx, pos)``.
    It owns its decode state (:meth:`new_state`) and finds it again as ``ctx.state.layers[index]``."""

    CONTEXT, FORWARD = ("d_model", "layer", "spec", "index"), ("x", "ctx", "pos")

    #: Called by ``zoo.testing``'s conformance suite: False for a mixer that returns zeros and holds
    #: no parameters (``none``: the layer is its FFN).
    mixes_tokens: ClassVar[bool] = True
    #: Checked by ``Decoder`` before a forward with packed documents (``ctx.documents``): True for a mixer
    #: that keeps each document to itself (attention inside it, a recurrent state reset at its start).
    documents: ClassVar[bool] = False

    @classmethod
    def rotary_dim(cls, cfg: Any, d_model: int) -> Optional[int]:
        """Called by ``Decoder`` (via :func:`rotary_dim_of`): the width of the vectors a ``qk``
        position encoding rotates (a head's width), or None when this mixer takes no rotation.
        Position modules are built per (position, this width)."""
        return None

    @classmethod
    def reads_from(cls, cfg: Any, *, spec: Any, index: int) -> Optional[int]:
        """Called once per layer when a ``ModelSpec`` is checked (:attr:`zoo.core.spec.ModelSpec.sources`):
        the earlier layer whose output of the same forward this layer's mixer reads (DSA's shared
        indexer: the nearest full layer's selection, which that layer leaves in a ``ctx.slot``), or None;
        raise ``SpecError`` when there is none to read. Default: None, the layer reads no other."""
        return None

    def new_state(self, batch: int, max_len: Optional[int], *, dtype: torch.dtype, device: Any) -> Optional["LayerState"]:
        """Called by ``Decoder.new_state``: this layer's decode state for ``batch`` rows of up to
        ``max_len`` tokens (None: unknown), or None when the mixer cannot decode incrementally
        (``generate`` then refuses the model)."""
        return None

    def heads(self) -> Optional[tuple[int, int, int]]:
        """Called by ``zoo.checkpoints.hf.maps`` for a weight transform that needs them (a RoPE
        permutation): (query heads, key/value heads, head width), or None when it has no heads."""
        return None


class Block(Part):
    """A block: ``cls(config, spec=, layer=, index=)``, called as ``block(x, ctx, pos)``. zoo's blocks
    name their submodules ``mixer``, ``ffn`` and the norms ``attn_norm``, ``ffn_norm`` (and
    ``post_attn_norm``, ``post_ffn_norm`` where the block has them)."""

    CONTEXT, FORWARD = ("spec", "layer", "index"), ("x", "ctx", "pos")

    def parallelize(self, tp_mesh: Any, *, prefix: str = "") -> None:
        """Tensor parallelism (:func:`parallelize`). Default: each of the block's parts states its own
        plan. The residual stream between them stays this process's slice of the sequence, so the
        norms on it normalise their slice (``shard_dim=1``) and the mixer and FFN take and give back
        such slices; a submodule that is no part (a plain torch module) is an error naming it."""
        for name, child in self.named_children():
            if isinstance(child, nn.Dropout):
                continue
            at = f"{prefix}.{name}" if prefix else name
            if name in ("mixer", "ffn"):
                parallelize(child, tp_mesh, at)
            else:  # the block's norms
                parallelize(child, tp_mesh, at, shard_dim=1)

    def activation_bytes(self, seq_len: int, dtype: torch.dtype, *, tp: int = 1, device: str = "cuda") -> Optional[float]:
        """What :meth:`Part.activation_bytes` says, for the block: by default the sum of what its parts
        (mixer, FFN, norms) say, the residual additions keeping nothing; None when one of them does not say."""
        total = 0.0
        for child in self.children():
            if not is_part(child):
                continue
            part = child.activation_bytes(seq_len, dtype, tp=tp, device=device)
            if part is None:
                return None
            total += part
        return total


class PositionEncoding(Part):
    """A position encoding: ``cls(config, spec=, layer=)``. Absolute ones add to the embeddings; rotary
    ones rotate q and k; bias ones (ALiBi) add to the attention scores. Override what applies."""

    CONTEXT, FORWARD = ("spec", "layer"), ()

    #: "embedding" (added to token embeddings), "qk" (rotates queries and keys), "bias", or "none".
    applies_to: ClassVar[str] = "none"

    @classmethod
    def max_positions(cls, config: Any, spec: Any) -> Optional[int]:
        """Called by ``zoo.inference.generate.length_limit``: the most positions this encoding can
        represent in a model of ``spec`` (a learned table has ``max_seq_len`` rows); None when it has
        no hard limit (RoPE and ALiBi extrapolate)."""
        return None

    def embed(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Called by ``Decoder`` on the embeddings: what an absolute encoding adds, or None."""
        return None

    def prepare(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Any:
        """Called by ``Decoder.run_layers`` once per forward: the state shared by every layer using
        this encoding (RoPE's cos and sin). ``position_ids`` is (B, T), padding at position 0."""
        return position_ids

    def rotate(self, q: torch.Tensor, k: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by mixers (``pos.rotate``): q and k rotated. Default: unchanged."""
        return q, k

    def score_bias(self, state: Any, q_idx: torch.Tensor, k_idx: torch.Tensor, n_heads: int) -> Optional[torch.Tensor]:
        """Called by attention (``pos.score_bias``): an additive (1 or B, H, Tq, Tk) bias on attention
        scores, or None."""
        return None

    def pairs(self, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by fused kernels (``pos.pairs``): a rotary encoding's cosine and sine per rotated
        pair, (B, 1, T, rotary_dim / 2). Default: this encoding gives none."""
        raise TypeError(f"position encoding {type(self).__name__} gives no rotation angles (pairs)")

    def parallelize(self, tp_mesh: Any, **kw: Any) -> None:
        """Tensor parallelism (:func:`parallelize`): a rotary encoding (or none) has nothing to shard, its
        tables are made per forward for the whole sequence, which the mixers see gathered. Default: an
        absolute encoding (added to the sequence-sharded embeddings: it must add this process's slice) or a
        score bias (per global head: it must bias this process's heads) has no plan, and refuses; the
        learned, sinusoidal and ALiBi encodings state their own."""
        if self.applies_to not in ("qk", "none"):
            raise no_plan(self)


class RopeScaling(Part):
    """A RoPE scaling rule: ``cls(config, dim=, theta=)``."""

    CONTEXT, FORWARD = ("dim", "theta"), ()

    @required
    def frequencies(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Called by RoPE: the inverse frequencies of the rotated pairs (dynamic rules take the
        sequence length). Required."""
        raise NotImplementedError


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
        return self.module.pairs(self.state)


class LayerState:
    """One layer's decode state, made by its mixer's ``new_state`` and opaque to everything else.
    A state class that does not inherit this gets its defaults mixed in (:func:`adapt`) when
    ``Decoder.new_state`` first sees it."""

    @required
    def nbytes(self) -> int:
        """Called by ``DecodeState.nbytes`` (and the accounting's checks): bytes held now. Required."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it holds (nbytes)")

    def to_static(self, max_len: int) -> "LayerState":
        """Called by ``DecodeState.to_static`` for compiled decoding: a copy with fixed-size buffers
        that a compiled single-token step updates in place. Default: this state cannot."""
        raise TypeError(f"decode state {type(self).__name__} has no to_static(max_len): "
                        "its mixer cannot decode with a compiled step")

    def truncate(self, n: int) -> None:
        """Called by ``DecodeState.truncate`` (speculative decoding drops rejected drafts): forget
        the slots from ``n`` on. Default: this state cannot."""
        raise TypeError(f"decode state {type(self).__name__} has no truncate(n): its mixer cannot drop slots it has seen")


def no_plan(part: nn.Module, where: str = "") -> NotImplementedError:
    """The error for a part without a tensor-parallel plan (``tp > 1`` cannot shard it)."""
    at = f"{where} " if where else ""
    return NotImplementedError(
        f"{at}({type(part).__module__}.{type(part).__qualname__}) has no tensor-parallel plan: it does not "
        "state a tp_plan (or define parallelize(tp_mesh, ...)), so parallel.tp > 1 cannot shard it; set tp = 1, "
        "or give the part a plan (docs/reference/training.md, 'Tensor and sequence parallelism')")


def parallelize(part: nn.Module, tp_mesh: Any, where: str, **kw: Any) -> None:
    """Ask ``part`` (at ``where`` in the model, e.g. ``layers.3.ffn``) to shard itself over ``tp_mesh``:
    its ``parallelize(tp_mesh, **kw)`` hook (:meth:`Part.parallelize`):

    - a mixer or an FFN: ``parallelize(tp_mesh)``, local sequence slices in and out;
    - a norm: ``parallelize(tp_mesh, shard_dim=...)``: its input arrives split on ``shard_dim`` (1: the
      sequence of the residual stream, or the heads of a per-head QK-norm; -1: the normalised features
      themselves, a QK-norm over a whole projection) and leaves split the same way, local;
    - a position encoding: ``parallelize(tp_mesh)``: RoPE has nothing to shard; an absolute or bias
      encoding without a plan of its own refuses;
    - a block: ``parallelize(tp_mesh, where=...)``: each of its parts, with :func:`parallelize`.

    A module that is no part (a plain torch module), or a part keeping the default, makes ``tp > 1``
    an error naming it."""
    if not is_part(part):
        raise no_plan(part, where)
    try:
        part.parallelize(tp_mesh, **kw)
    except NotImplementedError as exc:
        if where and not str(exc).startswith(where):
            sep = " " if str(exc).startswith("(") else ": "  # no_plan(part) names the class in brackets
            raise NotImplementedError(f"{where}{sep}{exc}") from None
        raise


def rotary_dim_of(layer: Any, d_model: int) -> Optional[int]:
    """The rotation width the mixer of ``layer`` (a LayerSpec) asks for, or None."""
    return layer.mixer.cls.rotary_dim(layer.mixer.config, d_model)


# ---------------------------------------------------------------------------------------------
# Hooks: what a base declares, what a part overrides, and the defaults a duck-typed part gets
# ---------------------------------------------------------------------------------------------

def hooks(base: type) -> dict[str, Any]:
    """Hook name -> the base's default, for ``base`` and the zoo bases above it (not nn.Module's
    own attributes, nor the upper-case contract attributes ``CONTEXT``/``FORWARD``)."""
    out: dict[str, Any] = {}
    for cls in reversed(base.__mro__):
        if cls in (Kernels, Part, LayerState) or (isinstance(cls, type) and issubclass(cls, (Part, LayerState))):
            out.update({n: v for n, v in vars(cls).items() if not n.startswith("_") and not n.isupper()})
    return out


def _own(cls: type, name: str) -> Any:
    """The attribute ``name`` as ``cls`` or a class above it defines it, not counting zoo's bases
    or the defaults :func:`adapt` mixed in; None when none does."""
    for c in cls.__mro__:
        if c in _BASE_CLASSES or c in (nn.Module, object):
            continue
        if name in vars(c) and name not in _MIXED.get(c, ()):
            return vars(c)[name]
    return None


def overrides(obj: Any, base: Optional[type] = None) -> list[str]:
    """The hooks of ``base`` (default: the zoo base ``obj`` inherits, or :class:`Part`) that ``obj``
    (a part or state, class or instance) implements itself, in the base's order."""
    cls = obj if isinstance(obj, type) else type(obj)
    base = base or next((b for b in (*BASES.values(), Part, LayerState) if issubclass(cls, b)), Part)
    return [n for n in hooks(base) if _own(cls, n) is not None]


def implements(obj: Any, hook: str) -> bool:
    """Whether ``obj`` (a part or state, class or instance) implements ``hook`` itself, rather than
    inheriting (or being given) the base's default: for a hook whose default is a refusal
    (``to_static``, ``truncate``) or a no-op the core skips (``after_optimizer_step``)."""
    return _own(obj if isinstance(obj, type) else type(obj), hook) is not None


#: The hooks in which a part states facts about itself for the other wings (spec checks, shrinking,
#: accounting, memory, checkpoint transforms, parallel plans) rather than computes. In a part file they
#: follow the mechanism, below one line, :data:`FACTS_DIVIDER` (tests/parts/test_part_files.py checks
#: zoo's own). ``check_experts`` is a router's, read by the mixture of experts' spec check.
FACT_HOOKS = ("shrink", "shrink_to", "resolved", "check_in_model", "check_experts", "reads_from", "rotary_dim", "max_positions",
              "heads", "cost", "facts", "activation_bytes", "tp_plan", "tp_divides", "parallelize",
              "parallelize_experts", "expert_parameters")
FACTS_DIVIDER = "# -- what this part states about itself --"

#: Class -> the default hooks :func:`adapt` mixed into it.
_MIXED: dict[type, tuple[str, ...]] = {}


def contract_table() -> str:
    """The constructor contract and hooks of every module-like kind, as the markdown table in
    docs/guides/plugins.md (tests/core/test_contract.py checks that the two agree)."""
    lines = ["| kind | base | built as | called as | hooks (default in the base) |", "|---|---|---|---|---|"]
    for kind, base in BASES.items():
        built = ", ".join(("config", *(f"{k}=" for k in base.CONTEXT)))
        called = f"({', '.join(base.FORWARD)})" if base.FORWARD else "(its methods)"
        names = [f"`{n}`" for n, v in hooks(base).items() if n not in hooks(Part) or base is Part]
        lines.append(f"| {kind} | `{base.__name__}` | `cls({built})` | `{called}` | {', '.join(names) or '-'} |")
    common = ", ".join(f"`{n}`" for n in hooks(Part))
    lines.append(f"| every kind above | `Part` | | | {common} |")
    lines.append(f"| a decode state | `LayerState` | by its mixer's `new_state` | | {', '.join(f'`{n}`' for n in hooks(LayerState))} |")
    return "\n".join(lines)


def adapt(cls: type, base: type) -> type:
    """Give ``cls`` (a part or state class that does not inherit ``base``) every default hook of
    ``base`` it lacks, set on the class itself, so that the core calls each hook as a method. The
    class keeps its identity (what a plugin registered is what the registry holds); the hooks it
    defines are untouched. A mixer that still declares ``head_dim_for`` gets a ``rotary_dim``
    reading it, with a DeprecationWarning."""
    if issubclass(cls, base) or cls in _MIXED:
        return cls
    mixed = []
    for name, default in hooks(base).items():
        if name in dir(cls):
            continue
        if name == "rotary_dim" and callable(getattr(cls, "head_dim_for", None)):
            def default(c, cfg, d_model):  # noqa: F811
                _deprecations.warn("Mixer.head_dim_for(cfg, d_model)")
                return c.head_dim_for(cfg, d_model)
            default = classmethod(default)
        if getattr(default, "__zoo_required__", False):
            continue
        setattr(cls, name, default)
        mixed.append(name)
    _MIXED[cls] = tuple(mixed)
    return cls


def adapt_part(kind: str, obj: Any) -> Any:
    """What the registry stores for ``obj`` registered as a ``kind``: the class with its base's
    defaults mixed in (:func:`adapt`) for a module-like kind, else ``obj`` itself."""
    base = BASES.get(canonical_kind(kind))
    return adapt(obj, base) if base is not None and isinstance(obj, type) else obj


def adapt_state(state: Any) -> Any:
    """A decode state with :class:`LayerState`'s defaults (``to_static``, ``truncate``) on its class."""
    if state is not None:
        adapt(type(state), LayerState)
    return state


def is_part(module: Any) -> bool:
    """Whether ``module`` is a zoo part (inherits a base, or was adapted at registration), not a
    plain torch module inside one."""
    return isinstance(module, Part) or any(c in _MIXED for c in type(module).__mro__)


def misspelt_hooks(obj: Any, base: type) -> list[tuple[str, str]]:
    """(method, hook) for each public method of ``obj`` (a class) that is no hook of ``base`` but
    looks like one (``shrunk`` for ``shrink``, ``new_sate`` for ``new_state``)."""
    import difflib

    names = list(hooks(base))
    out = []
    for c in obj.__mro__:
        if c in _BASE_CLASSES or c in (nn.Module, object) or c.__module__.startswith("torch."):
            continue
        for name, value in vars(c).items():
            if name.startswith("_") or name in names or name in _MIXED.get(c, ()):
                continue
            if not (callable(value) or isinstance(value, (classmethod, staticmethod))):
                continue
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
            if close:
                out.append((name, close[0]))
    return out


def mixer_of(block: nn.Module) -> nn.Module:
    """A block's token mixer: its ``mixer``, or, for a block of its own written against zoo 0.2's block
    API, the ``attention`` it stores the mixer as (its parameters keep that name: ``layers.{i}.attention.*``)."""
    for name in ("mixer", "attention"):
        if block._modules.get(name) is not None:
            return block._modules[name]
    return block.mixer  # a block that makes its mixer a property


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
    "router",  # a mixture of experts' router (zoo/components/ffn/routers.py)
    "expert",  # a mixture of experts' stacked routed experts (zoo/components/ffn/experts.py)
    "kernel",  # a fast implementation behind a part (zoo.core.kernels dispatches; zoo/components/kernels/)
)

#: The base of each module-like kind: its hooks, their defaults, and its constructor context and
#: forward arguments (``CONTEXT``, ``FORWARD``). Everything below is derived from these classes.
BASES: dict[str, type] = {
    "norm": Norm, "activation": Activation, "ffn": FFN, "position": PositionEncoding,
    "rope_scaling": RopeScaling, "mixer": Mixer, "block": Block, "router": Router, "expert": Experts,
}
#: The keyword arguments the builder passes to each module-like kind's constructor
#: (``cls(config, **context)``): each base's ``CONTEXT``.
CONSTRUCTOR_CONTEXT: dict[str, tuple[str, ...]] = {k: b.CONTEXT for k, b in BASES.items()}
#: The arguments of each kind's ``forward`` (each base's ``FORWARD``). An FFN is called ``(x, ctx)``
#: when its forward takes the context (``ctx=None`` when it runs alone), else ``(x)``.
FORWARD_ARGS: dict[str, tuple[str, ...]] = {k: b.FORWARD for k, b in BASES.items() if b.FORWARD}
#: Methods of kinds that have no base class (a plugin kind's, from :func:`module_interface`; a family's).
METHODS: dict[str, tuple[str, ...]] = {"family": ("recipe", "spec", "hf_ids")}
POSITION_APPLIES_TO = ("embedding", "qk", "bias", "none")
_BASE_CLASSES = (Kernels, Part, *BASES.values(), LayerState)

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
        import warnings

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
        base = BASES.get(kind)
        required = [n for n, v in hooks(base).items() if getattr(v, "__zoo_required__", False)] if base else []
        for name in (*required, *METHODS.get(kind, ())):
            if not callable(getattr(obj, name, None)) or (base is not None and getattr(obj, name) is getattr(base, name)):
                missing.append(f"a `{name}` method")
        if kind == "position" and obj.__dict__.get("applies_to", getattr(obj, "applies_to", None)) not in POSITION_APPLIES_TO:
            missing.append(f"`applies_to` set to one of {', '.join(map(repr, POSITION_APPLIES_TO))} "
                           "(subclass zoo.core.kinds.PositionEncoding)")
        if base is not None and not missing:
            for name, hook in misspelt_hooks(obj, base):
                warnings.warn(f"{kind} {obj.__qualname__}: method {name!r} is no hook of {base.__name__}; "
                              f"did you mean {hook!r}? (zoo never calls {name!r})", UserWarning, stacklevel=4)
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
