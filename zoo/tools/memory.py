"""Memory per device before a launch (``zoo describe NAME --parallel ...``): what each process holds to
train a model under a layout of data, tensor and expert parallelism, counted from the model built on the
meta device (nothing is allocated).

Per process, with AdamW and zoo's training (float32 parameters; ``dtype`` is the compute dtype, bf16 for
mixed precision):

- **parameters**: this process's shard, float32 (under mixed precision they are the master weights);
  **gradients** the same shape, float32; **optimizer**: AdamW's two moments, float32;
- the shard is exact: tensor parallelism is the parts' own plans (:meth:`~zoo.core.kinds.Part.parallelize`)
  applied on the meta device over a process group that communicates nothing; expert parallelism splits
  each part's :attr:`~zoo.core.kinds.Part.expert_parameters` by experts over ``ep``; FSDP2 then splits dim
  0 of what is left as ``torch.chunk`` does, the dense parameters over ``dp_shard x ep``, the experts over
  ``dp_shard`` (on their dim 1 when a process holds fewer experts than ``dp_shard``, as torchtitan
  places them; HSDP replicates over ``dp_replicate``). Under tensor parallelism a mixture of experts
  is whole on every process of a tp group (it runs on the process's slice of the sequence);
- **in flight** (FSDP2, its units as the trainer wraps them): the root unit (embeddings, final norm,
  head) stays gathered from forward to backward; the largest block is gathered in the compute dtype
  while it runs, and the next block's unit is prefetched; the running block's unsharded gradient is held
  in the compute dtype, and the largest unit's once more in float32 for the reduce-scatter. Under expert
  parallelism each MoE's experts are a unit of their own (over ``dp_shard``), gathered inside their
  block's while it runs: the block prefetched is then the next block's unit without its experts, and
  the float32 copy is the larger of a block's dense part and its experts. Without FSDP2 under mixed
  precision, autocast's compute-dtype copies of the weights are kept for backward;
- **activations**: what each block's parts report they keep for backward
  (:meth:`~zoo.core.kinds.Part.activation_bytes`), per token, times the micro-batch's tokens; a
  checkpointed block keeps its input only, and one block at a time is recomputed in backward;
- **logits and loss**: the head's input, the logits (this process's vocabulary columns under tensor
  parallelism) and the float32 log-probabilities the cross-entropy keeps.

Not counted: the allocator's fragmentation, communication buffers beyond FSDP2's, the CUDA context, and
the decode state (none in training).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
from torch import nn

from zoo.core.kinds import is_part
from zoo.training.config import MESH_DIMS, ParallelConfig

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                  "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
MASTER_BYTES = 4  # float32 parameters, gradients and each AdamW moment


def parse_layout(text: str) -> ParallelConfig:
    """``"dp_shard=8,tp=8,ep=1"`` -> a ParallelConfig (the sizes not named keep their defaults, dp_shard
    -1: the rest); an unknown name or a value that is no integer is an error naming it."""
    sizes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in MESH_DIMS:
            raise ValueError(f"--parallel {item!r}: write NAME=SIZE with NAME one of {', '.join(MESH_DIMS)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--parallel {name}={value!r}: the size must be an integer") from None
    return ParallelConfig(**sizes)


def coordinates(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """The mesh coordinates of ``rank`` (dimensions in :data:`MESH_DIMS` order, the last fastest), as
    ``init_device_mesh`` lays the processes out."""
    out = {}
    for name in reversed(MESH_DIMS):
        out[name] = rank % sizes[name]
        rank //= sizes[name]
    return {n: out[n] for n in MESH_DIMS}


def chunk_rows(n: int, parts: int, index: int) -> int:
    """Rows of chunk ``index`` when ``torch.chunk`` splits ``n`` rows into ``parts`` (FSDP2's shards)."""
    size = -(-n // parts) if n else 0
    return max(0, min(size, n - index * size))


@contextlib.contextmanager
def _fake_group(world: int, rank: int):
    """A process group of ``world`` processes, this one ``rank``, that communicates nothing (torch's
    ``fake`` backend): enough to lay DTensors out on the meta device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("zoo describe --parallel lays the model out over a process group of its own: "
                           "call it outside a distributed run")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_shape(p: torch.Tensor) -> torch.Size:
    from torch.distributed.tensor import DTensor

    return p.to_local().shape if isinstance(p, DTensor) else p.shape


def _units(model: nn.Module, experts_apart: bool = False) -> list[tuple[str, list[tuple[nn.Module, str, torch.Tensor]]]]:
    """FSDP2's units as zoo's trainer wraps them (``zoo.training.loop``): under expert parallelism
    (``experts_apart``) first each module holding a part's stacked experts (an MoE's ``experts``, the
    multi-token prediction modules' included), then the root holding what no block holds, then one per
    block (less its experts); each a (name, list of (owning part, parameter name, parameter)), every
    parameter once."""
    seen: set[int] = set()
    # each parameter's nearest enclosing part, and its name there (``experts.w_up`` of an MoE)
    nearest = {id(p): (part, n) for part in model.modules() if is_part(part) for n, p in part.named_parameters()}

    def expert(p):
        owner, n = nearest.get(id(p), (None, ""))
        return owner is not None and n in owner.expert_parameters

    def params(modules):
        out = []
        for m in modules:
            for n, p in m.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((*nearest.get(id(p), (m, n)), p))
        return out

    units = []
    if experts_apart:
        for name, m in model.named_modules():
            if any(expert(p) for p in m.parameters(recurse=False)):
                units.append((name, params([m])))
    in_layers = {id(m) for layer in model.layers for m in layer.modules()}
    blocks = [(f"layers.{i}", params(layer.modules())) for i, layer in enumerate(model.layers)]
    return [*units, ("root", params(m for m in model.modules() if id(m) not in in_layers)), *blocks]


def plan(
    model_or_name: Any,
    parallel: ParallelConfig | str,
    *,
    seq_len: int,
    micro_batch: int = 1,
    dtype: Any = "bf16",
    processes: Optional[int] = None,
    rank: int = 0,
    device: str = "cuda",
    overrides: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The memory of process ``rank`` training ``model_or_name`` (a preset name, a spec, or a Decoder
    built on the meta device: it is sharded in place) under ``parallel`` (a ParallelConfig, or
    ``"dp_shard=8,tp=8"``) on ``processes`` processes (default: the product of the sizes), for micro-batches
    of ``micro_batch`` sequences of ``seq_len`` tokens computed in ``dtype``. Bytes, as plain data."""
    from zoo.model.decoder import build_model
    from zoo.model.recipes import get_spec

    layout = parse_layout(parallel) if isinstance(parallel, str) else parallel
    layout.checkpointed(1)  # a bad ac is an error now
    if processes is None:
        if layout.dp_shard == -1:
            raise ValueError("--parallel: give dp_shard, or the number of processes (--processes) for dp_shard = -1")
        processes = math.prod(getattr(layout, n) for n in MESH_DIMS)
    sizes = layout.sizes(processes)
    if not 0 <= rank < processes:
        raise ValueError(f"--rank {rank}: there are {processes} processes (0 to {processes - 1})")
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"--seq-len and --micro-batch must be positive, got {seq_len} and {micro_batch}")
    key = str(dtype).lower().removeprefix("torch.")
    if key not in COMPUTE_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: the compute dtype is one of {', '.join(COMPUTE_DTYPES)}")
    cdtype = COMPUTE_DTYPES[key]
    c = cdtype.itemsize
    mixed = cdtype != torch.float32
    at = coordinates(sizes, rank)
    tp, ep, dp_shard = sizes["tp"], sizes["ep"], sizes["dp_shard"]

    if isinstance(model_or_name, nn.Module):
        model = model_or_name
    else:
        model = build_model(get_spec(model_or_name, overrides) if isinstance(model_or_name, str) else model_or_name,
                            device="meta")
    spec = model.spec
    if tp > 1:
        with _fake_group(tp, at["tp"]):
            from torch.distributed.device_mesh import init_device_mesh

            model.parallelize(init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))

    # -- parameters: this process's shard ------------------------------------------------------------
    fsdp = sizes["dp_replicate"] > 1 or dp_shard * ep > 1
    dense_group, dense_index = dp_shard * ep, at["dp_shard"] * ep + at["ep"]
    local = 0
    gathered: dict[str, int] = {}  # per FSDP unit: its parameters as gathered (tensor/expert-parallel shards)
    for unit, params in _units(model, experts_apart=fsdp and ep > 1):
        whole = 0
        for owner, name, p in params:
            shape = list(_local_shape(p))
            expert = is_part(owner) and name in owner.expert_parameters
            if expert and ep > 1:
                if shape[0] % ep:
                    raise ValueError(f"--parallel ep={ep}: {unit} ({type(owner).__name__}) has {shape[0]} experts, "
                                     f"which do not split over {ep} processes; choose an ep that divides {shape[0]}")
                shape[0] //= ep
            rest = math.prod(shape[1:])
            whole += shape[0] * rest
            if fsdp and expert and ep > 1 and shape[0] < dp_shard:  # fewer experts here than shards: by rows
                local += shape[0] * chunk_rows(shape[1], dp_shard, at["dp_shard"]) * math.prod(shape[2:])
            elif fsdp:
                group, index = (dp_shard, at["dp_shard"]) if expert else (dense_group, dense_index)
                local += chunk_rows(shape[0], group, index) * rest
            else:
                local += shape[0] * rest
        gathered[unit] = whole

    # -- activations -----------------------------------------------------------------------------------
    tokens = micro_batch * seq_len
    ckpt = set(layout.checkpointed(len(model.layers)))
    silent: list[str] = []
    per_layer: list[float] = []
    says = lambda m: m.activation_bytes(seq_len, cdtype, tp=tp, device=device) is not None  # noqa: E731
    for i, layer in enumerate(model.layers):
        b = layer.activation_bytes(seq_len, cdtype, tp=tp, device=device)
        if b is None:  # name the innermost parts that do not say (a block summing its parts is not one)
            silent += [f"layers.{i}.{n} ({type(m).__name__})" for n, m in layer.named_modules() if is_part(m)
                       and not says(m) and all(says(k) for k in m.children() if is_part(k))] or [f"layers.{i}"]
        per_layer.append(b or 0.0)
    block_input = spec.d_model * c / tp  # a checkpointed block keeps its input: the sequence slice
    kept = sum(block_input if i in ckpt else b for i, b in enumerate(per_layer)) * tokens
    recomputed = max((per_layer[i] for i in ckpt), default=0.0) * tokens
    final_norm = 0.0
    if model.final_norm is not None:
        final_norm = model.final_norm.activation_bytes(seq_len, cdtype, tp=tp, device=device) or 0.0
    V = spec.vocab_size
    softcap = c * V if spec.head.softcap else 0  # the tanh the soft-cap keeps
    # the head's input (gathered under tensor parallelism), the float32 logits and log-probabilities the
    # cross-entropy keeps and the soft-cap's tanh (this process's vocabulary columns under tensor
    # parallelism: the loss is vocabulary-parallel); the final norm's; the token ids the embedding keeps
    logits = (spec.d_model * c + (8 * V + softcap) / tp + 16 + final_norm) * tokens

    # -- in flight -----------------------------------------------------------------------------------
    # Each block's units: its own, and (under EP) its experts' units, gathered inside it while it runs.
    blocks = {f"layers.{i}": [u for u in gathered if u == f"layers.{i}" or u.startswith(f"layers.{i}.")]
              for i in range(len(model.layers))}
    running = max((sum(gathered[u] for u in us) for us in blocks.values()), default=0)
    prefetched = max((gathered[b] for b in blocks), default=0)  # the next block's own unit
    largest = max((gathered[u] for u in gathered if u != "root"), default=0)  # reduce-scattered one at a time
    block = running
    if fsdp:
        in_flight = {"root_unit": gathered["root"] * c, "blocks": (running + prefetched) * c,
                     "block_gradient": running * c + (largest * MASTER_BYTES if mixed else 0)}
    else:
        in_flight = {"compute_copies": local * c if mixed else 0}

    figures = {
        "parameters": local * MASTER_BYTES,
        "gradients": local * MASTER_BYTES,
        "optimizer": 2 * local * MASTER_BYTES,
        "in_flight": sum(in_flight.values()),
        "activations": kept + recomputed,
        "logits": logits,
    }
    return {
        "name": spec.label or (model_or_name if isinstance(model_or_name, str) else None),
        "layout": sizes,
        "processes": processes,
        "rank": rank,
        "coordinates": at,
        "fsdp": fsdp,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "dtype": key,
        "ac": str(layout.ac),
        "device": device,
        "local_parameters": local,
        "gathered_block_parameters": block,
        "units": gathered,
        "in_flight_parts": in_flight,
        "activation_bytes_per_token": per_layer,
        "activations_kept": kept,
        "activations_recomputed": recomputed,
        "not_reported": silent,
        "bytes": figures,
        "total": sum(figures.values()),
    }
