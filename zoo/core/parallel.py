"""What a part uses to state its tensor-parallel plan: its ``tp_plan`` dict and ``tp_divides`` sizes, read by
:func:`apply_plan` (submodule name -> a style of :data:`TP_STYLES`, as transformers' ``base_model_tp_plan``
but per part), or, for a plan no dict says (packed projections, MLA's shared rotary key, experts), the
helpers below used by the part's own ``parallelize`` hook (:func:`zoo.core.kinds.parallelize`).

The engine is PyTorch's: DTensor and ``torch.distributed.tensor.parallel``. Between parts the residual
stream is a plain local tensor, this process's slice of the sequence (B, T / tp, d); a part gathers it
(``PrepareModuleInput``), shards its matrices by heads or features (``ColwiseParallel`` in,
``RowwiseParallel`` out, which reduce-scatters back to the sequence slice), and computes on local
tensors with local head counts.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn


def local_count(n: int, tp_mesh: Any, what: str, part: nn.Module) -> int:
    """``n`` (heads, kv heads, ...) split over the ``tp`` processes of ``tp_mesh``; raises, naming the part
    and the count, when they do not divide."""
    tp = tp_mesh.size()
    if n % tp:
        raise NotImplementedError(f"{type(part).__name__}: {what} = {n} does not split over tp = {tp} processes; "
                                  f"choose a tp that divides {n}")
    return n // tp


def grad_summed(t: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """``t`` unchanged, whose gradient is summed over ``tp_mesh`` in backward: for a tensor every process
    holds whole (MLA's shared rotary key) but uses only with its own heads, so that each process's share
    of the gradient reaches the parameters that made it (Megatron's "copy to the tensor-parallel region")."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


@contextlib.contextmanager
def parameters_grad_summed(modules: list[nn.Module], tp_mesh: Any) -> Iterator[None]:
    """Within it, each parameter of ``modules`` (their submodules' included) reads as :func:`grad_summed`
    of itself: for parts that run on this process's own tokens (its slice of the sequence) with their
    parameters whole on every process of ``tp_mesh`` (a mixture of experts' router and shared expert), so
    that each parameter's gradient sums every process's tokens. The parameters are put back on exit."""
    swapped = [(m, n, p) for module in modules for m in module.modules() for n, p in m._parameters.items()
               if p is not None]
    try:
        for m, n, p in swapped:
            m._parameters[n] = grad_summed(p, tp_mesh)
        yield
    finally:
        for m, n, p in swapped:
            m._parameters[n] = p


def statistic_summed(t: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """The sum of ``t`` over the processes of ``tp_mesh``, whose gradient reaches this process's ``t``
    unchanged (where :func:`summed` sums the gradient too): for statistics of this process's own tokens (a mixture of experts' expert counts and mean
    router probabilities) in a loss every process of the group then computes whole and alike, and whose
    backward each process takes for its own tokens (Megatron's "reduce from the tensor-parallel region")."""
    from torch.distributed import _functional_collectives as funcol

    total = funcol.wait_tensor(funcol.all_reduce(t.detach(), "sum", tp_mesh))
    return total + (t - t.detach())  # exactly the sum forward; the identity backward


def sequence_input(tp_mesh: Any, *, local: bool = False, extra: int = 2) -> Any:
    """The ``PrepareModuleInput`` of a mixer or FFN: its first input, the local sequence slice, gathered
    into the whole sequence (a replicated DTensor, or a plain tensor with ``local``); ``extra`` more
    inputs (ctx, pos) passed as they are."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(input_layouts=(Shard(1), *[None] * extra),
                              desired_input_layouts=(Replicate(), *[None] * extra), use_local_output=local)


def heads_in() -> Any:
    """``ColwiseParallel``: a projection into heads (or features), sharded by its output rows; local output."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def heads_out() -> Any:
    """``RowwiseParallel``: the projection out of the heads, reduce-scattered onto the sequence slice."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=Shard(1))


def replicated_norm(norm: nn.Module, tp_mesh: Any, *, shard_dim: int = 1) -> None:
    """A norm's plan (the ``tp_plan`` style ``"replicated"``): its weights replicated (DTensors), so that
    their gradient, computed from this process's slice, is summed over the processes. Split on the
    sequence or the heads (``shard_dim`` 1) it normalises its slice (``SequenceParallel``); split on the
    normalised features (``shard_dim`` -1: OLMo 2's QK-norm over a whole projection) it gathers them,
    normalises the whole row and hands back its slice."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel, parallelize_module

    if shard_dim != -1:
        parallelize_module(norm, tp_mesh, SequenceParallel(sequence_dim=shard_dim, use_local_output=True))
        return
    distribute_module(norm, tp_mesh)  # parameters replicated
    parallelize_module(norm, tp_mesh, PrepareModuleInputOutput(
        input_layouts=Shard(-1), desired_input_layouts=Replicate(), output_layouts=Replicate(),
        desired_output_layouts=Shard(-1), use_local_output=True))


def _forward_extra(part: nn.Module) -> int:
    """How many inputs ``part`` is called with after ``x`` (``ctx`` and ``pos`` for a mixer, ``ctx`` for
    an FFN that takes it): its forward's positional parameters after the first."""
    params = inspect.signature(part.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) - 1


#: What a ``tp_plan`` entry may say of the part itself (the key ``""``), with what it does.
SELF_STYLES: dict[str, Callable[..., None]] = {
    # a mixer's or an FFN's input, this process's slice of the sequence, gathered whole (:func:`sequence_input`)
    "gather_sequence": lambda part, tp_mesh, **kw: _parallelize_module(
        part, tp_mesh, sequence_input(tp_mesh, extra=_forward_extra(part))),
    # weights replicated, run on the slice it is given (a norm, :func:`replicated_norm`)
    "replicated": lambda part, tp_mesh, shard_dim=1, **kw: replicated_norm(part, tp_mesh, shard_dim=shard_dim),
}
#: What a ``tp_plan`` entry may say of a submodule: a ``torch.distributed.tensor.parallel`` style.
MODULE_STYLES: dict[str, Callable[[], Any]] = {
    "colwise": lambda: heads_in(),  # a projection into heads (or features): sharded by its output rows
    "rowwise": lambda: heads_out(),  # the projection out of them, reduce-scattered onto the sequence slice
}
#: What a ``tp_plan`` entry may say of a sub-part (a QK-norm): its own plan, its input arriving split on
#: this dimension (1: the heads of (B, heads, T, D) rows; -1: the features of a whole projection).
PART_STYLES: dict[str, int] = {"split_heads": 1, "split_features": -1}
TP_STYLES = (*SELF_STYLES, *MODULE_STYLES, *PART_STYLES)


def _parallelize_module(module: nn.Module, tp_mesh: Any, plan: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, tp_mesh, plan)


def apply_plan(part: nn.Module, tp_mesh: Any, sub_part: Callable[..., None], **kw: Any) -> None:
    """Shard ``part`` over ``tp_mesh`` as its declarative plan says (the default ``parallelize``,
    :meth:`zoo.core.kinds.Part.parallelize`): first each size named in ``part.tp_divides`` (an
    attribute: ``n_heads``, ``d_ff``) must split over ``tp`` (:func:`local_count`); then ``part.tp_plan``,
    submodule name -> style, is applied: the part's own entry (``""``, :data:`SELF_STYLES`), its
    submodules' (:data:`MODULE_STYLES`, one ``parallelize_module``), and its sub-parts' own plans
    (:data:`PART_STYLES`, through ``sub_part``, :func:`zoo.core.kinds.parallelize`). An entry naming a
    submodule this instance lacks (a QK-norm the config turned off) is skipped; a style not listed is an
    error naming the part and the entry. ``kw`` (a norm's ``shard_dim``) goes to the part's own entry."""
    plan, name = dict(part.tp_plan), type(part).__qualname__
    for what in part.tp_divides:
        local_count(getattr(part, what), tp_mesh, what, part)
    unknown = {k: v for k, v in plan.items() if v not in TP_STYLES}
    if unknown:
        raise ValueError(f"{name}.tp_plan: unknown style(s) {unknown}; the styles are {', '.join(TP_STYLES)}")
    own = plan.pop("", None)
    if own is not None:
        if own not in SELF_STYLES:
            raise ValueError(f"{name}.tp_plan['']: the part's own entry is one of {', '.join(SELF_STYLES)}, got {own!r}")
        SELF_STYLES[own](part, tp_mesh, **kw)
    present = {k: v for k, v in plan.items() if isinstance(getattr(part, k, None), nn.Module)}
    modules = {k: MODULE_STYLES[v]() for k, v in present.items() if v in MODULE_STYLES}
    if modules:
        _parallelize_module(part, tp_mesh, modules)
    for k, v in present.items():
        if v in PART_STYLES:
            sub_part(getattr(part, k), tp_mesh, k, shard_dim=PART_STYLES[v])
        elif v in SELF_STYLES:
            raise ValueError(f"{name}.tp_plan[{k!r}]: {v!r} is a style of the part itself (the key '')")


def rank_of(tp_mesh: Any) -> int:
    """This process's index in ``tp_mesh``."""
    return tp_mesh.get_local_rank()


def units_here(n: int, tp_mesh: Any) -> tuple[int, int]:
    """(first, count) of the ``n`` units (heads, groups) this process uses when a section of ``n`` units
    serves the heads split over ``tp``: ``n / tp`` consecutive units when ``tp`` divides ``n``, or the one
    unit its heads share when ``n`` divides ``tp`` (a group of B and C, a key head, held by ``tp / n``
    processes)."""
    tp, r = tp_mesh.size(), rank_of(tp_mesh)
    return r * n // tp, max(n // tp, 1)


def section_rows(sections: list[tuple[int, int]], tp_mesh: Any) -> torch.Tensor:
    """This process's rows of a packed projection whose rows are the ``sections`` one after another, each
    ``(units, width)``: ``units`` (heads, groups) of ``width`` rows; per section the units of
    :func:`units_here`."""
    rows, offset = [], 0
    for units, width in sections:
        first, count = units_here(units, tp_mesh)
        rows.append(torch.arange(offset + first * width, offset + (first + count) * width))
        offset += units * width
    return torch.cat(rows)


def shard_rows(module: nn.Module, mesh: Any) -> None:
    """``module``'s own parameters made DTensors sharded by rows (``Shard(0)`` over ``mesh``), on the meta
    device as on any other."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for n, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None),
                                                  requires_grad=p.requires_grad))


def packed_in(module: nn.Module, rows: torch.Tensor, tp_mesh: Any) -> None:
    """Tensor parallelism for a packed projection (``[z | xBC | dt]``, ``[q | k | v | z]``) or a depthwise
    convolution over packed channels, whose sections split by heads one by one: its parameters are stored
    by contiguous rows (``Shard(0)``, as ``ColwiseParallel`` stores them, so initialisation, checkpoints and
    the full state dict are those of every layout), and its forward, on a local input, gathers them and
    computes only ``rows`` (:func:`section_rows`), this process's rows of each section; their gradients
    are reduce-scattered back onto the shards (a row two processes use gets both shares)."""
    from torch.distributed.tensor import Partial

    shard_rows(module, tp_mesh)
    run = type(module).forward

    def forward(*args, **kwargs):
        saved = dict(module._parameters)
        try:
            for n, p in saved.items():
                if p is not None:
                    whole = p.full_tensor(grad_placements=[Partial()])
                    module._parameters[n] = whole.index_select(0, rows.to(whole.device))
            return run(module, *args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


def local(t: torch.Tensor) -> torch.Tensor:
    """What this process computes with from a DTensor: a sharded parameter's shard (the gradient goes to
    that shard); the whole of a replicated one, a parameter or the gathered sequence, used for this
    process's heads only (its gradient summed over the processes); ``t`` itself when it is no DTensor."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in t.placements])


def summed(t: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """``t`` summed over the processes of ``tp_mesh``; differentiable (the gradient is summed the same way,
    since each process's result feeds its own share of the loss): a norm's sum of squares over features
    several processes hold."""
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t, group=tp_mesh.get_group())


def expert_count(n_experts: int, ep_mesh: Any, part: nn.Module) -> int:
    """``n_experts`` split over the ``ep`` processes of ``ep_mesh``; raises, naming the part, when they do not divide."""
    ep = ep_mesh.size()
    if n_experts % ep:
        raise ValueError(f"{type(part).__name__}: n_experts = {n_experts} does not split over parallel.ep = {ep} "
                         f"processes; choose an ep that divides {n_experts}")
    return n_experts // ep


class ExpertParallel:
    """Expert parallelism for a module of stacked experts (:class:`zoo.components.ffn.moe.GroupedExperts`
    or any module called as ``experts(xs, counts)``: the token copies ``xs`` grouped by expert,
    ``counts[e]`` of them for expert ``e``, in expert order; the output row by row in the same order).

    Its parameters are sharded by expert (``Shard(0)`` over ``ep_mesh``, so each of the ``ep`` processes
    holds ``E / ep`` consecutive experts); around its forward:

    - dispatch: the counts are exchanged first (``all_to_all_single`` of ``E / ep`` counts to each
      process), then each process sends every token copy to the process that holds its expert
      (``all_to_all_single`` with uneven splits) and regroups what arrives (by source, then expert)
      by expert, then source, so the module runs its local experts on contiguous runs;
    - combine: the outputs go back in the received order and return to the processes they came from.

    Both exchanges are differentiable (``all_to_all_single_autograd``, as torchtitan's): the
    gradient of a received token copy returns to the process that sent it, and each expert's
    gradient sums over the tokens every process of ``ep_mesh`` routed to it. The router, the weights
    of the experts' outputs, shared experts, losses and metrics are not touched: they run on each
    process's own tokens. Apply it (``ExpertParallel().apply(experts, ep_mesh)``) on the meta device,
    after tensor parallelism and before activation checkpointing and FSDP2."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[int], list[int], torch.Tensor]] = []

    def apply(self, module: nn.Module, ep_mesh: Any) -> nn.Module:
        """Shard ``module``'s parameters over ``ep_mesh`` and attach dispatch and combine to its forward."""
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, ep_mesh, lambda name, mod, mesh: shard_rows(mod, mesh), self._dispatch,
                                 self._combine)

    def _dispatch(self, module: nn.Module, inputs: tuple, ep_mesh: Any) -> tuple:
        import torch.distributed as dist

        xs, counts = inputs[0], inputs[1]
        P, group = ep_mesh.size(), ep_mesh.get_group()
        L = counts.numel() // P
        with torch.no_grad():
            received = torch.empty_like(counts)  # received[s * L + l]: copies from process s for local expert l
            dist.all_to_all_single(received, counts.contiguous(), group=group)
        sent = counts.view(P, L).sum(1).tolist()
        got = received.view(P, L).sum(1).tolist()
        rows = _all_to_all(xs, got, sent, group)
        block = torch.repeat_interleave(torch.arange(P * L, device=xs.device), received)  # (source, expert) of each row
        order = ((block % L) * P + block // L).argsort(stable=True)  # by expert, then source
        self._pending.append((sent, got, order))
        return (rows.index_select(0, order), received.view(P, L).sum(0), *inputs[2:])

    def _combine(self, module: nn.Module, ys: torch.Tensor, ep_mesh: Any) -> torch.Tensor:
        sent, got, order = self._pending.pop()
        back = ys.index_select(0, order.argsort())  # the received order again
        return _all_to_all(back, sent, got, ep_mesh.get_group())


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Rows of ``x`` exchanged (``input_splits[p]`` rows to process ``p``, ``output_splits[p]`` from it);
    differentiable: the gradient takes the way back."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))
