"""Train any preset or recipe with Accelerate: one process, DDP or FSDP2, resumable.

    >>> import zoo
    >>> zoo.train("llama3-8b", overrides={"n_layers": 2, "d_model": 64, "vocab_size": 256, ...},
    ...           steps=300, out_dir="runs/tiny")

The defaults are the recipe of the lecture notes: AdamW (betas 0.9/0.95) with weight decay 0.1
on matrices only (not on norms, biases or embeddings), linear warmup then cosine decay, gradient
clipping at 1.0, z-loss with the spec's coefficient, dropout 0 (the spec's), gradient
accumulation to reach the global batch.

Accelerate sets up the processes (``accelerate launch`` or ``torchrun``), devices, mixed
precision (bf16 where the device supports it), DDP, the backward pass and clipping. FSDP2 is
applied here, per block: the model is built on the meta device, each ``model.layers[i]`` and
then the root are wrapped with ``fully_shard``, and only then is each process's shard allocated
and initialised, so a model larger than one device can start.

Checkpoints (``out_dir/checkpoints/step-NNNNNNN``) hold the model, optimizer, scheduler, RNG
states, step and data position; tensors are in safetensors (torch.distributed.checkpoint's Hugging
Face storage: every process writes its own shards), the rest in JSON; each is written to a
temporary directory and renamed into place, and any number of processes in any layout resumes it.
The export at the end streams the weights from the last checkpoint, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from zoo.checkpoints.sources import find
from zoo.training.checkpointer import Checkpointer, checkpoints, load_full_state_dict, read_checkpoint_state
from zoo.training.config import MESH_DIMS, ParallelConfig, TrainConfig, TrainResult
from zoo.training.data import get_tokenizer, open_data
from zoo.core import kinds as _kinds
from zoo.model.decoder import build_model
from zoo.model.recipes import get_spec
from zoo.training.resume import check_resumed_config, metrics_up_to, resume_point
from zoo.core.spec import ModelSpec


# -- the recipe -----------------------------------------------------------------------------------

def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on the weight matrices, decided by what each parameter is: a part's own parameters
    are decayed unless it names them in ``no_decay`` (:attr:`zoo.core.kinds.Part.no_decay`: norms'
    gains and offsets, biases of stacked experts, decay rates); a plain torch module inside a part
    decays only the ``weight`` of a linear or convolution layer; embedding tables are never decayed."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decided: dict[int, bool] = {}  # parameter -> decayed, by the module that holds it
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in decided or not p.requires_grad:
                continue
            decided[id(p)] = id(p) not in embeddings and _decayed(module, name, p)
    decay = [p for p in model.parameters() if decided.get(id(p))]
    rest = [p for p in model.parameters() if decided.get(id(p)) is False]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _decayed(module: nn.Module, name: str, p: torch.Tensor) -> bool:
    """Whether ``module``'s own parameter ``name`` takes weight decay (:func:`param_groups`)."""
    if _kinds.is_part(module):
        if module.no_decay is None:  # a part that does not say: zoo 0.2's rule, matrices only
            return p.ndim >= 2
        return not any(fnmatch.fnmatchcase(name, pattern) for pattern in module.no_decay)
    return name == "weight" and isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -- the loop -------------------------------------------------------------------------------------

def _on_cpu(config: TrainConfig) -> bool:
    """Accelerate sets up several CPU processes (gloo) only when asked for the CPU explicitly."""
    has_accelerator = getattr(torch, "accelerator", None)
    available = has_accelerator.is_available() if has_accelerator is not None else torch.cuda.is_available()
    return config.cpu or (int(os.environ.get("WORLD_SIZE", "1")) > 1 and not available)


def _mixed_precision(config: TrainConfig) -> Optional[str]:
    if config.mixed_precision != "auto":
        return config.mixed_precision
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None  # `accelerate launch` passes the config's choice; Accelerator reads it
    if config.cpu or not torch.cuda.is_available():
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "no"


def _check_fsdp_launch(use_fsdp: bool) -> None:
    """FSDP2 needs a process group: say so before any compute, not after building the model."""
    import torch.distributed as dist

    if use_fsdp and not dist.is_initialized():
        raise ValueError("fsdp: FSDP2 needs a process group; launch with `accelerate launch` (an FSDP config) or "
                         "`torchrun`, or leave fsdp off for one process")


def _shard(model: nn.Module, accelerator, mesh=None, experts: tuple = ()) -> None:
    """FSDP2, one unit per block and one for the root (embeddings, final norm, head), over the mesh's
    data-parallel dimensions: sharded over ``dp_shard`` (and ``ep``) and, with ``dp_replicate`` > 1,
    replicated across it (HSDP). Each module of ``experts`` (sharded by expert over ``ep``) is a unit of
    its own over ``dp_shard`` (and ``dp_replicate``) alone, its gradient divided by every data-parallel
    process (``dp_replicate x dp_shard x ep``): each process's loss is its own tokens' mean, the
    all-to-all already summed the ``ep`` processes' shares into the expert's gradient, and FSDP2 sums
    the rest, so the gradient is one process's over the whole batch, as the dense parameters' is."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError(
            "FSDP2 needs a process group: launch with `accelerate launch` (an FSDP config) or `torchrun`, "
            "or leave fsdp off for one process"
        )
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "fsdp_version", 2) != 2:
        raise ValueError("zoo trains with FSDP2: set fsdp_version: 2 in the accelerate config")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    mp = MixedPrecisionPolicy(param_dtype=dtypes.get(accelerator.mixed_precision), reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {
        "mesh": _data_parallel_mesh(mesh) if mesh is not None else init_device_mesh(accelerator.device.type,
                                                                                     (accelerator.num_processes,)),
        "mp_policy": mp,
        "reshard_after_forward": getattr(plugin, "reshard_after_forward", True) if plugin is not None else True,
    }
    if plugin is not None and isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        kwargs["offload_policy"] = plugin.cpu_offload
    if experts:
        expert_kwargs = {**kwargs, "mesh": _data_parallel_mesh(mesh, experts=True)}
        world = math.prod(mesh[n].size() for n in ("dp_replicate", "dp_shard", "ep"))
        for module in experts:
            fully_shard(module, **expert_kwargs)
            module.set_gradient_divide_factor(float(world))
            if mesh["dp_shard"].size() > 1:  # a plain sum, then the divide (gloo has no pre-multiplied sum)
                module.set_force_sum_reduction_for_comms(True)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def start_model(spec: ModelSpec, accelerator, *, seed: int, sharded: bool,
                parallel: Optional[ParallelConfig] = None) -> nn.Module:
    """The model to train, on the accelerator's device, with the weights ``build_model(spec, seed=seed)``
    gives on one process, its blocks checkpointed as ``parallel.ac`` says. Sharded (or ``parallel.tp`` > 1):
    built on the meta device, sharded by tensor parallelism over the mesh's ``tp`` dimension
    (``Decoder.parallelize``), checkpointed, wrapped with FSDP2 per block over its data-parallel
    dimensions (torchtitan's order: TP, EP, activation checkpointing, FSDP), then each process allocates
    and initialises only its shard (one module's whole parameters at a time). With ``parallel.ep`` > 1
    (which needs ``sharded``) the routed experts are sharded by expert over the mesh's ``ep`` dimension
    (``Decoder.parallelize_experts``) after tensor parallelism."""
    parallel = parallel or ParallelConfig()
    if not sharded and parallel.tp == 1 and parallel.ep == 1:
        net = build_model(spec, device=accelerator.device, seed=seed)
        checkpoint_blocks(net, parallel.checkpointed(len(net.layers)))
        return net
    if parallel.ep > 1 and not sharded:
        raise ValueError(f"parallel: ep = {parallel.ep} trains with FSDP2 (the parameters other than the experts "
                         "are data-parallel over dp_shard x ep); turn fsdp on")
    net = build_model(spec, device="meta")
    mesh = device_mesh(parallel, accelerator)
    if parallel.tp > 1:
        net.parallelize(mesh["tp"])
    experts = net.parallelize_experts(mesh["ep"]) if parallel.ep > 1 else []
    checkpoint_blocks(net, parallel.checkpointed(len(net.layers)))
    if sharded:
        _shard(net, accelerator, mesh, tuple(experts))
    net.to_empty(device=accelerator.device)
    net.init_weights(seed=seed)
    return net


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients to a global norm of ``max_norm`` over every process; returns the norm before
    clipping. For gradients that live on several meshes (tensor parallelism's DTensors on ``tp``, FSDP2 x
    TP's on ``dp_shard x tp``, and the whole tensors every process holds), which
    ``torch.nn.utils.clip_grad_norm_`` cannot stack: each gradient's norm is made whole
    (``full_tensor``: the shards' squares summed, a pending sum reduced) before they are added."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    squares = []
    for g in grads:
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        squares.append((n.full_tensor() if isinstance(n, DTensor) else n) ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def device_mesh(parallel: ParallelConfig, accelerator):
    """The DeviceMesh of ``parallel`` over the launched processes, dimensions named as in :data:`MESH_DIMS`."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = parallel.sizes(accelerator.num_processes)
    return init_device_mesh(accelerator.device.type, tuple(sizes[n] for n in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def checkpoint_blocks(model: nn.Module, blocks: list[int]) -> None:
    """Recompute the activations of ``model.layers[i]`` for each ``i`` in ``blocks`` during backward
    (``torch.utils.checkpoint``, non-reentrant, as torchtitan wraps its blocks): a block then keeps
    only its inputs. Losses, metrics and counters the block's parts add are not added again when it is
    recomputed (:func:`zoo.core.context.recomputing`). State-dict keys do not change (``named_parameters``
    shows the wrapper's ``_checkpoint_wrapped_module``, which ``init_weights`` looks through)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from zoo.core.context import recomputation

    for i in blocks:
        model.layers[i] = checkpoint_wrapper(model.layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                             context_fn=lambda: (nullcontext(), recomputation()))


def _data_parallel_mesh(mesh, *, experts: bool = False):
    """FSDP2's mesh: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP. With expert parallelism the
    parameters other than the experts shard over ``dp_shard x ep`` (the ``ep`` processes read different
    data), the experts (``experts=True``, already sharded over ``ep``) over ``dp_shard`` alone."""
    shard = "dp_shard"
    if mesh["ep"].size() > 1 and not experts:
        shard = "dp_shard_ep"
        flat = mesh["dp_shard", "ep"]._flatten(shard)
        if mesh["dp_replicate"].size() == 1:
            return flat
    return mesh[shard] if mesh["dp_replicate"].size() == 1 else mesh["dp_replicate", shard]


def train(model: Any = None, config: Optional[TrainConfig] = None, *, overrides: Optional[dict[str, Any]] = None,
          on_step: Optional[Callable[[dict[str, Any], nn.Module], None]] = None, **fields: Any) -> TrainResult:
    """Train a preset name, recipe file, dict or :class:`ModelSpec` (with spec ``overrides``), from
    random weights or from a checkpoint's (``init_from=``; the model may then be omitted).

    ``on_step(metrics, model)`` is called after every optimizer step, on every process, with the
    step's metrics dict (it may add entries, which are logged with the rest; raising stops the run).
    Keyword ``fields`` set :class:`TrainConfig` fields (``steps=300``). Run under
    ``accelerate launch`` or ``torchrun`` for several processes; every process calls this.
    """
    from zoo.core.extras import import_extra

    Accelerator = import_extra("accelerate", "training needs", "train").Accelerator
    from accelerate.utils import DistributedType

    config = dataclasses.replace(config or TrainConfig(), **fields)
    config = dataclasses.replace(config, parallel=config.parallel.with_accelerate())
    config.check()
    # zoo builds its own meshes from those sizes: Accelerate's own mesh (from its parallelism_config)
    # refuses CPU processes, and its FSDP2 + TP path does not run with this transformers.
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    # The scheduler steps once per optimizer step, whatever the number of processes.
    acc = Accelerator(mixed_precision=_mixed_precision(config), cpu=_on_cpu(config), step_scheduler_with_optimizer=False)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if acc.num_processes != launched:
        raise RuntimeError(f"{launched} processes were launched but Accelerate sees {acc.num_processes}; "
                           "check the launcher's environment (WORLD_SIZE, RANK, MASTER_ADDR)")
    layout = config.parallel.sizes(acc.num_processes)  # before any compute: the sizes must fit the processes
    tp = layout["tp"]
    # Data parallelism is over dp_replicate x dp_shard: the processes of one tensor-parallel group read one batch.
    dp_size, dp_rank = acc.num_processes // tp, acc.process_index // tp
    accum = config.accumulation(dp_size)

    # Every check before any compute: model, tokenizer, checkpoint.
    pretrained = None
    if config.init_from:
        from zoo.checkpoints import from_pretrained

        pretrained = from_pretrained(config.init_from)
        spec = get_spec(model if model is not None else pretrained.spec, overrides)
    elif model is None:
        raise ValueError("train needs a model: a preset name, a recipe file or a spec, or init_from=a checkpoint")
    else:
        spec = get_spec(model, overrides)
    config.parallel.check_model(spec)
    if config.z_loss is not None:
        spec = spec.with_overrides(z_loss=config.z_loss)
    if config.seq_len > spec.max_seq_len:
        raise ValueError(f"seq_len {config.seq_len} exceeds the model's max_seq_len {spec.max_seq_len}")
    tok_source = config.tokenizer
    if tok_source is None and config.init_from:
        found = find(config.init_from)  # a local checkpoint (a run directory: its export); a GGUF file's is in it
        if found is not None and found.holds_tokenizer():
            tok_source = found
    tokenizer = get_tokenizer(tok_source)
    if tokenizer.vocab_size > spec.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {spec.vocab_size}; "
            f"set vocab_size={tokenizer.vocab_size} (or more) in the overrides"
        )
    out_dir = Path(config.out_dir)
    resume_from = resume_point(config, out_dir, checkpoints(out_dir))
    # asked for HSDP or FSDP, or for expert parallelism (whose other parameters are data-parallel with FSDP2)
    sharding = config.parallel.dp_replicate > 1 or config.parallel.dp_shard > 1 or layout["ep"] > 1
    if config.fsdp is False and sharding:
        raise ValueError(f"parallel: dp_replicate {config.parallel.dp_replicate} x dp_shard {config.parallel.dp_shard} "
                         f"x ep {layout['ep']} shards with FSDP2, but fsdp is off; turn fsdp on or leave dp_replicate, "
                         "dp_shard and ep unset")
    use_fsdp = config.fsdp if config.fsdp is not None else (acc.distributed_type == DistributedType.FSDP or sharding)
    if tp > 1 and dp_size > 1 and not use_fsdp:
        raise ValueError(f"parallel: tp {tp} on {acc.num_processes} processes leaves {dp_size} data-parallel "
                         "groups, which zoo shards with FSDP2 (x TP), but fsdp is off; turn fsdp on, or set tp to "
                         "the number of processes")
    fmt = getattr(pretrained, "checkpoint_format", None)  # export in the format the weights came in
    if config.lora is not None:
        _check_lora(config, spec, config.export_format or fmt, tp=tp, ep=layout["ep"], fsdp=use_fsdp)
    _check_fsdp_launch(use_fsdp)
    # Each process writes its own shard of the weights under FSDP2 or TP.
    per_process = use_fsdp or tp > 1
    ckpt_state = read_checkpoint_state(resume_from, spec, acc.num_processes) if resume_from else None
    if ckpt_state is not None:
        check_resumed_config(resume_from, ckpt_state, config, acc.print)
    earlier = ckpt_state is not None and ckpt_state.get("format", 1) == 1  # per-process files: not resharded
    saved_layout = (ckpt_state or {}).get("config", {}).get("parallel")
    if earlier and per_process and saved_layout is not None and ckpt_state["sharded"]:
        before = ParallelConfig(**saved_layout).sizes(ckpt_state["processes"])
        if before != layout:
            raise ValueError(f"checkpoint {resume_from} holds shards of the earlier layout for {before}, not "
                             f"{layout}; resume it with the same parallel sizes (its next checkpoint reshards)")
    if earlier and ckpt_state["sharded"] != per_process:
        raise ValueError(
            f"checkpoint {resume_from} (of the earlier layout) was written {'with' if ckpt_state['sharded'] else 'without'}"
            f" FSDP or TP; resume it the same way (fsdp={ckpt_state['sharded']}, or the same tp)"
        )
    data, val_data = open_data(config, tokenizer)

    # Model: meta first; FSDP2 shards before anything is allocated.
    torch.manual_seed(config.seed)
    net = start_model(spec, acc, seed=config.seed, sharded=use_fsdp, parallel=config.parallel)
    hf_config = dict(getattr(pretrained, "hf_config", {}))  # and with its token ids and kept config fields
    if pretrained is not None and ckpt_state is None:
        load_full_state_dict(net, pretrained.state_dict(), sharded=per_process)
    del pretrained
    lora_counts = _add_lora(net, config, acc.print) if config.lora is not None else None
    net.train()
    optimizer = torch.optim.AdamW(param_groups(net, config.weight_decay), lr=config.lr,
                                  betas=(config.beta1, config.beta2), eps=config.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, warmup=config.warmup_steps, total=config.steps, min_ratio=config.min_lr_ratio))
    if per_process and acc.distributed_type != DistributedType.FSDP:
        # Launched without an accelerate FSDP config (torchrun, CPU): Accelerate would wrap the model in DDP.
        optimizer, schedule = acc.prepare(optimizer, schedule)
        wrapped = net
    else:  # one process, DDP, or FSDP2 under accelerate (which keeps an already sharded model as it is)
        wrapped, optimizer, schedule = acc.prepare(net, optimizer, schedule)

    ckpt = Checkpointer(acc, out_dir, config.keep_last)
    step, position = 0, 0
    if ckpt_state is not None:
        ckpt.load(resume_from, ckpt_state, model=net, optimizer=optimizer.optimizer, scheduler=schedule.scheduler)
        step, position = ckpt_state["step"], ckpt_state["data_position"]
        acc.print(f"resumed from {resume_from} at step {step}")
    metrics_file = out_dir / "metrics.jsonl"
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in (out_dir / "checkpoints").glob(".tmp-step-*"):  # left by a save that was cut short
            shutil.rmtree(stale, ignore_errors=True)
        kept = metrics_up_to(metrics_file, step) if step else []
        metrics_file.write_text("".join(line + "\n" for line in kept))

    last = config.steps if config.stop_after is None else min(config.steps, step + config.stop_after)
    tokens_per_step = config.global_batch * config.seq_len
    per_rank = config.micro_batch * accum
    result = TrainResult(step=step, losses=[], ce=[], z=[], out_dir=out_dir, main_process=acc.is_main_process)
    if lora_counts is not None:
        result.extra["lora"] = lora_counts
    from tqdm.auto import tqdm

    bar = tqdm(total=config.steps, initial=step, disable=not (config.progress and acc.is_local_main_process),
               desc="train", unit="step", dynamic_ncols=True)
    if val_data is not None and step == 0 and last > 0:  # where a fresh run starts from
        result.val.append({"step": 0, "val_loss": evaluate(wrapped, val_data, config, acc, dp_rank, dp_size)})
        acc.print(f"step 0: val_loss {result.val[-1]['val_loss']:.4f}")
    started, tokens_seen = time.perf_counter(), 0
    saved: Optional[Path] = None
    while step < last:
        t0 = time.perf_counter()
        batch = data.batch(position + dp_rank * per_rank, per_rank)
        sums: dict[str, torch.Tensor] = {}
        for m in range(accum):
            part = batch.rows(m * config.micro_batch, (m + 1) * config.micro_batch, acc.device)
            sync = m == accum - 1
            if use_fsdp:
                wrapped.set_requires_gradient_sync(sync)
            with acc.no_sync(wrapped) if not (sync or use_fsdp) else nullcontext():
                with acc.autocast():
                    # the model's own loss: fused where a fast path runs
                    out = wrapped(part.ids, labels=part.labels, **_documents(part))
                acc.backward(out.loss / accum)  # outside autocast, as PyTorch advises
            for name, value in out.terms().items():
                sums[name] = sums.get(name, 0.0) + value.detach().float() / accum
        if tp > 1 or layout["ep"] > 1:  # gradients on several meshes (DTensors of tp, dp x tp, dp x ep) and whole ones
            acc.unscale_gradients()
            grad_norm = clip_grad_norm(net.parameters(), config.grad_clip or math.inf)
        else:
            grad_norm = acc.clip_grad_norm_(wrapped.parameters(), config.grad_clip or math.inf)  # inf: measure only
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        after_optimizer_step(net, acc)
        terms = step_terms(sums, acc)
        loss, ce, z = terms["loss"], terms["ce"], terms["z"]
        step += 1
        position += config.global_batch
        tokens_seen += tokens_per_step
        tps = tokens_per_step / max(time.perf_counter() - t0, 1e-9)
        result.losses.append(loss), result.ce.append(ce), result.z.append(z)
        result.terms.append(terms)
        row = {"step": step, **terms, "lr": schedule.get_last_lr()[0], "tokens_per_s": tps,
               "grad_norm": float(grad_norm)}
        if val_data is not None and (step % config.val.every == 0 or step == config.steps):
            row["val_loss"] = evaluate(wrapped, val_data, config, acc, dp_rank, dp_size)
            result.val.append({"step": step, "val_loss": row["val_loss"]})
            acc.print(f"step {step}: val_loss {row['val_loss']:.4f}")
        if on_step is not None:
            on_step(row, net)
        if acc.is_main_process:
            with metrics_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
        bar.update(1)
        if step % config.log_every == 0 or step == last:
            bar.set_postfix(loss=f"{loss:.4f}", z=f"{z:.3g}", tok_s=f"{tps:,.0f}",
                            **({"val": f"{result.val[-1]['val_loss']:.4f}"} if result.val else {}))
        if config.save_every and step % config.save_every == 0 and step < last:
            saved = ckpt.save(model=net, optimizer=optimizer.optimizer, scheduler=schedule.scheduler, step=step,
                              data_position=position, spec=spec, sharded=per_process, config=config)
    bar.close()
    elapsed = time.perf_counter() - started
    result.step = step
    result.tokens_per_s = tokens_seen / elapsed if elapsed > 0 and tokens_seen else 0.0
    if result.losses and (saved is None or not saved.name.endswith(f"{step:07d}")):
        saved = ckpt.save(model=net, optimizer=optimizer.optimizer, scheduler=schedule.scheduler, step=step,
                          data_position=position, spec=spec, sharded=per_process, config=config)
    if saved is None and config.export and step >= config.steps and earlier:  # export reads this layout only
        saved = ckpt.save(model=net, optimizer=optimizer.optimizer, scheduler=schedule.scheduler, step=step,
                          data_position=position, spec=spec, sharded=per_process, config=config)
    result.checkpoint = saved or resume_from
    if step >= config.steps:
        if config.plot and acc.is_main_process:
            result.plot = plot_losses(metrics_file, out_dir / "loss.png")
        if config.export and acc.is_main_process and config.lora is not None:
            from zoo.checkpoints.adapter import save_adapter

            result.adapter = save_adapter(net, out_dir / "adapter", model_type=config.export_format or fmt,
                                          base=config.init_from)
        if config.export and acc.is_main_process and (config.lora is None or config.lora.merge):
            result.export = export(result.checkpoint, out_dir / "final", model_type=config.export_format or fmt,
                                   tokenizer=tokenizer, hf_config=hf_config, source_format=fmt, log=acc.print)
    acc.wait_for_everyone()
    return result


def _check_lora(config: TrainConfig, spec: ModelSpec, model_type: Optional[str], *, tp: int, ep: int,
                fsdp: bool) -> None:
    """Before any compute: LoRA trains on one process or data-parallel (DDP), its targets name linear
    modules of the model, and the format the adapter is written in can name each of them."""
    from zoo.checkpoints.adapter import require_peft, hf_module_names, lora_targets

    require_peft()
    if tp > 1 or ep > 1 or fsdp:
        raise ValueError(f"lora: LoRA trains on one process or data-parallel (DDP), not with "
                         f"{'tensor parallelism (tp)' if tp > 1 else 'expert parallelism (ep)' if ep > 1 else 'FSDP2'}; "
                         "set tp = 1 and ep = 1, and leave fsdp, dp_shard and dp_replicate unset")
    plain = build_model(spec, device="meta")
    if config.export:
        hf_module_names(plain, lora_targets(plain, config.lora.targets), model_type)
    else:
        lora_targets(plain, config.lora.targets)


def _add_lora(net: nn.Module, config: TrainConfig, log: Callable[[str], None]) -> dict[str, Any]:
    """Wrap the targets with LoRA (only the adapter trains) and log what trains; returns the counts."""
    from zoo.checkpoints.adapter import add_lora, lora_layers, trainable

    lora = config.lora
    add_lora(net, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets, rslora=lora.rslora,
             seed=config.seed)
    count, total = trainable(net)
    layers = lora_layers(net)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in layers})
    log(f"LoRA r={lora.r} alpha={lora.alpha:g} on {len(layers)} modules ({', '.join(leaves)}): {count:,} trainable "
        f"parameters of {total:,} ({100 * count / total:.3f}%)")
    return {"trainable": count, "total": total, "percent": 100 * count / total, "modules": sorted(layers)}


def _documents(batch) -> dict[str, Any]:
    return {} if batch.documents is None else {"document_ids": batch.documents}


@torch.no_grad()
def evaluate(model: nn.Module, val, config: TrainConfig, accelerator, dp_rank: int, dp_size: int) -> float:
    """The mean next-token cross-entropy over the first ``config.val.samples`` validation sequences
    (every token that counts: labels not -100), each data-parallel process scoring its share in
    micro-batches; every process runs the same number of forwards (FSDP2 gathers in each), a share
    that runs short repeating its first sequence with no weight."""
    n = min(val.n_samples, config.val.samples)
    share = -(-n // dp_size)
    mine = range(dp_rank * share, min(n, (dp_rank + 1) * share))
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for a in range(0, share, config.micro_batch):
        rows = [i for i in mine[a:a + config.micro_batch]]
        batch = val.batch(rows[0], len(rows)) if rows else val.batch(0, 1)
        batch = batch.rows(0, len(batch.ids), accelerator.device)
        with accelerator.autocast():
            out = model(batch.ids, labels=batch.labels, **_documents(batch))
        counted = (batch.labels[:, 1:] != -100).sum()
        if rows:
            total += torch.stack([out.ce.double() * counted, counted.double()])
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return float(total[0] / total[1].clamp(min=1))


def step_terms(sums: dict[str, torch.Tensor], accelerator) -> dict[str, float]:
    """One step's loss terms (loss, ce, z, then each auxiliary loss and metric by name), averaged
    over the processes. Every process has the same names: they come from the same model."""
    names = ["loss", "ce", "z"] + sorted(k for k in sums if k not in ("loss", "ce", "z"))
    values = accelerator.reduce(torch.stack([sums[k] for k in names]), reduction="mean")
    return dict(zip(names, (float(v) for v in values)))


@torch.no_grad()
def after_optimizer_step(model: nn.Module, accelerator) -> None:
    """Call ``after_optimizer_step(reduce=...)`` on every part that defines it (an aux-loss-free
    expert bias update), after each optimizer step, on every process. ``reduce(t)`` sums a tensor
    over the processes (identity on one), so a part that updates from it updates identically
    everywhere, under DDP and FSDP2 alike."""
    hooks = [m.after_optimizer_step for m in model.modules()
             if m is not model and _kinds.is_part(m) and _kinds.implements(m, "after_optimizer_step")]
    if not hooks:
        return
    if accelerator.num_processes > 1:
        def reduce(t):
            return accelerator.reduce(t.clone(), reduction="sum")
    else:
        def reduce(t):
            return t
    for hook in hooks:
        hook(reduce=reduce)


def export(checkpoint: Path, path: Path, *, model_type: Optional[str] = None, tokenizer=None,
           dtype: Optional[torch.dtype] = None, hf_config: Optional[dict] = None,
           source_format: Optional[str] = None, log: Callable[[str], None] = print) -> Path:
    """Write the weights of a training checkpoint with ``zoo.save_pretrained``, tensor by tensor: each
    is assembled from the pieces the processes wrote, converted and written before the next is read,
    so no host holds more than about one tensor (not the whole model). The tokenizer (its chat
    template and token ids) goes with it and, for a run started from a checkpoint
    (``source_format``), that checkpoint's token ids and kept config fields (``hf_config``).

    Without ``model_type``, the first registered checkpoint format that describes the checkpoint's
    spec exactly is used; when none does, the model is written in zoo's own layout (``spec.toml`` and
    ``model.safetensors``, :mod:`zoo.checkpoints.files.native`), which ``zoo.from_pretrained`` loads.
    A LoRA run's checkpoint is written as the merged model (:class:`zoo.checkpoints.adapter.MergedWeights`).
    """
    from zoo.checkpoints import save_pretrained, save_tokenizer
    from zoo.checkpoints.hf.format import CheckpointError
    from zoo.checkpoints.files.native import save_native
    from zoo.core.registry import list_components
    from zoo.core.spec import SpecError
    from zoo.training.checkpointer import CheckpointWeights, read_state

    state = read_state(checkpoint)
    try:
        spec = ModelSpec.from_dict(state["spec"])
    except SpecError as exc:
        raise ValueError(f"{Path(checkpoint) / 'state.json'}: its spec does not describe a model ({exc})") from None
    lora = (state.get("config") or {}).get("lora")
    if lora:  # a LoRA run's: the merged model, each adapted weight merged as it is read
        from zoo.checkpoints.adapter import MergedWeights

        weights = MergedWeights(CheckpointWeights(checkpoint), lora, dtype=dtype)
    else:
        weights = CheckpointWeights(checkpoint, dtype=dtype)
    plain = build_model(spec, device="meta")  # names, shapes and heads for the weight-name map; no data
    check_stored_shapes(checkpoint, plain, weights)
    plain.checkpoint_format, plain.hf_config = source_format, dict(hf_config or {})
    tokenizer = tokenizer if hasattr(tokenizer, "save") else None
    errors = []
    for fmt in [model_type] if model_type else list_components("checkpoint_format"):
        try:
            return save_pretrained(plain, path, model_type=fmt, state=weights, tokenizer=tokenizer)
        except CheckpointError as exc:  # this format cannot describe this spec
            if model_type:
                raise
            errors.append(f"{fmt}: {str(exc)[:120]}")
    save_native(plain, path, state=weights)  # zoo's own layout, streamed as the HF formats are
    save_tokenizer(plain, path, tokenizer)
    log(f"no Hugging Face checkpoint format describes this model ({'; '.join(errors[:2])}); "
        f"wrote it in zoo's own layout to {path} (spec.toml, model.safetensors), which zoo.from_pretrained loads")
    return Path(path)


def check_stored_shapes(checkpoint: Path, model: nn.Module, weights) -> None:
    """The checkpoint's stored tensors (``weights``, with ``meta(name)``) against the model its
    state.json's spec builds, as resume compares them: a missing, extra or differently shaped tensor is
    a ValueError naming it, before anything is written."""
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    stored = set(weights)
    problems = [f"{n} is missing" for n in want if n not in stored]
    problems += [f"{n} is not in the model" for n in sorted(stored - set(want))]
    problems += [f"{n} is {tuple(weights.meta(n).shape)}, the spec's model has {want[n]}"
                 for n in want if n in stored and tuple(weights.meta(n).shape) != want[n]]
    if problems:
        raise ValueError(f"checkpoint {checkpoint}: its weights are not those of the model its state.json describes "
                         f"({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}); the state.json belongs "
                         "to another run, or the checkpoint is damaged")


def plot_losses(metrics_file: Path, png: Path) -> Path:
    """A PNG of loss, cross-entropy and (where evaluated) validation cross-entropy against step, from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="loss (ce + z-loss)")
    ax.plot([r["step"] for r in rows], [r["ce"] for r in rows], label="cross-entropy", alpha=0.7)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation cross-entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
