"""The model's two parallel plans, asked of each part: tensor (and sequence) parallelism, and expert
parallelism; and the head's logits under tensor parallelism.

torch.distributed.tensor is imported where a plan runs: importing it costs half a second, which a
process that never shards does not pay.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kinds as _kinds
from zoo.model.init import module_name


def parallelize(model: nn.Module, tp_mesh) -> None:
    """Tensor and sequence parallelism over ``tp_mesh`` (torch.distributed.tensor.parallel), asked of
    each part (:func:`zoo.core.kinds.parallelize`): call it on the meta device, before activation
    checkpointing and FSDP2, then materialise and ``init_weights``. The embedding is sharded by
    vocabulary rows and hands the blocks this process's slice of the sequence; that slice is the
    residual stream all through; the head (the embedding's rows when tied) computes this process's
    vocabulary columns from the whole sequence; the loss keeps them sharded (vocabulary-parallel),
    and a forward without labels gathers the logits whole. A part without a plan is an error naming it."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model._tp = tp_mesh.size()
    parallelize_module(model.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    for key, module in model.positions.items():
        _kinds.parallelize(module, tp_mesh, f"positions.{key} ({type(module).__name__})")
    for i, layer in enumerate(model.layers):
        _kinds.parallelize(layer, tp_mesh, f"layers.{i}", prefix=f"layers.{i}")
    if model.final_norm is not None:
        _kinds.parallelize(model.final_norm, tp_mesh, "final_norm", shard_dim=1)
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    elif model.head_bias is not None:  # tied: the embedding's rows are the head's; its bias follows them
        model.head_bias = nn.Parameter(distribute_tensor(model.head_bias, tp_mesh, [Shard(0)]))
    if model.mtp is not None:  # its modules; the embedding and the head are those above
        model.mtp.parallelize(tp_mesh)


def parallelize_experts(model: nn.Module, ep_mesh) -> list[nn.Module]:
    """Expert parallelism over ``ep_mesh``, asked of each FFN (``parallelize_experts``, the MTP modules'
    included): call it on the meta device after :func:`parallelize` and before activation checkpointing
    and FSDP2. Returns the modules whose parameters are now sharded by expert. A model with no part
    that shards its experts (no ``moe`` FFN) is an error."""
    sharded: list[nn.Module] = []
    for name, module in model.named_modules():
        if module is model or not (_kinds.is_part(module) and _kinds.implements(module, "parallelize_experts")):
            continue
        try:
            sharded += module.parallelize_experts(ep_mesh)
        except (ValueError, NotImplementedError) as exc:
            raise type(exc)(f"{module_name(name)}: {exc}") from None
    if not sharded:
        raise ValueError(f"parallel.ep = {ep_mesh.size()}: this model has no routed experts to shard (no FFN "
                         "implements parallelize_experts, as the moe FFN does); set ep = 1")
    return sharded


def tied_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits from the embedding matrix. Under tensor parallelism (a DTensor sharded by vocabulary rows)
    ``x`` is this process's slice of the sequence: it is gathered, each process computes its
    vocabulary columns, and the logits are gathered whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return F.linear(x, weight, bias)
    mesh = weight.device_mesh
    x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    return F.linear(x, weight, bias).full_tensor()


def local_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
    """Under tensor parallelism: this process's vocabulary columns of the logits of the whole
    sequence (``x`` is the sequence slice; it is gathered, and its gradient is summed and
    scattered back), the first column's index, and the mesh. Padding columns beyond the
    vocabulary are -inf, which the loss ignores as it ignores the columns cut off without TP."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    weight, bias = model.head()
    mesh = weight.device_mesh
    x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    logits = F.linear(x.to_local(grad_placements=[Partial()]), weight.to_local(),
                      None if bias is None else bias.to_local())
    rows = -(-weight.shape[0] // mesh.size())  # DTensor's Shard(0): chunks of ceil(V / tp) rows
    start = mesh.get_local_rank() * rows
    logits = model._head_scaled(logits)
    vocab = model.spec.vocab_size
    if start + logits.shape[-1] > vocab:
        padding = torch.arange(start, start + logits.shape[-1], device=logits.device) >= vocab
        logits = logits.masked_fill(padding, float("-inf"))
    return logits, start, mesh
