"""What a part uses to state its tensor-parallel plan (the ``parallelize`` hook, :func:`zoo.core.kinds.parallelize`).

The engine is PyTorch's: DTensor and ``torch.distributed.tensor.parallel``. Between parts the residual
stream is a plain local tensor, this process's slice of the sequence (B, T / tp, d); a part gathers it
(``PrepareModuleInput``), shards its matrices by heads or features (``ColwiseParallel`` in,
``RowwiseParallel`` out, which reduce-scatters back to the sequence slice), and computes on local
tensors with local head counts.
"""

from __future__ import annotations

from typing import Any

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
