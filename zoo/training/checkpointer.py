"""Training checkpoints: the model, optimizer, scheduler and RNG state of a run, written by every
process and read back by any number of processes in any layout.

``step-NNNNNNN/`` holds ``model/`` and ``optimizer/``, each written with ``torch.distributed.checkpoint``
through its Hugging Face storage (safetensors files, each process writing the pieces it holds with their
offsets in the file's metadata: no pickled ``.metadata``), one ``rng-rankRRRRR.safetensors`` per
process and ``state.json`` (step, data position, spec, config, scheduler, the optimizer's param groups,
the files written). Checkpoints of the earlier layout (``model[-rankRRRRR-of-WWWWW].safetensors``)
still resume, on the layout that wrote them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zoo.checkpoints.files.io import DTYPES
from zoo.checkpoints.hf.maps import current_name, earlier_names
from zoo.core.spec import ModelSpec, differences
from zoo.training.config import TrainConfig
from zoo.training.resume import fsync_dir, fsync_tree, step_of

#: The layout ``state.json`` records as ``format``: 2 is torch.distributed.checkpoint's; without the key, the earlier one.
FORMAT = 2
PARTS = ("model", "optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``out_dir/checkpoints``, oldest (lowest step) first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) >= 0 and (p / "state.json").is_file()]
    return sorted(found, key=step_of)


def read_checkpoint_state(path: Path, spec: ModelSpec, processes: int) -> dict[str, Any]:
    """The checkpoint's ``state.json``, after checking it belongs to this model and can resume here."""
    state_file = Path(path) / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a training checkpoint (no state.json); pass a step-NNNNNNN directory")
    state = json.loads(state_file.read_text())
    diff = [f"{p}: {x!r} in the checkpoint, {y!r} now"
            for p, x, y in differences({**state["spec"], "label": None}, {**spec.to_dict(), "label": None})]
    if diff:
        raise ValueError(
            f"checkpoint {path} was written for another model ({'; '.join(diff[:3])}"
            f"{'; ...' if len(diff) > 3 else ''}); resume with the same model and overrides, or use a new out_dir"
        )
    if state.get("format", 1) == 1 and state["sharded"] and state["processes"] != processes:
        raise ValueError(
            f"checkpoint {path} holds FSDP shards of the earlier layout for {state['processes']} processes, but "
            f"{processes} are running; resume it with {state['processes']} processes (its next checkpoint reshards)"
        )
    return state


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _dcp_save(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """``tensors`` (DTensor shards or whole tensors) into ``directory`` as safetensors, every process
    writing its own pieces (a tensor every process holds whole is written once)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with warnings.catch_warnings():  # one process is the intent, not a slip
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True),
                 no_dist=not _distributed())


def _dcp_load(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Fill ``tensors`` in place from ``directory``: each process reads the pieces of its own shards,
    whichever processes wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not _distributed())


def _stored(directory: Path) -> dict[str, Any]:
    """What ``directory`` (written by :func:`_dcp_save`) holds: each tensor's size, dtype and pieces."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata


def _check_stored(path: Path, part: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse, naming the tensor, a checkpoint whose ``part`` lacks a tensor or holds it in another shape."""
    stored = _stored(path / part)
    for name, t in tensors.items():
        if name not in stored:
            raise KeyError(f"checkpoint {path} has no tensor {name!r} in {part}/; it was written by another model")
        if tuple(stored[name].size) != tuple(t.shape):
            raise ValueError(f"checkpoint {path}: {part}/ holds {name!r} as {tuple(stored[name].size)}, but the "
                             f"model's is {tuple(t.shape)}; it was written by another model")


def _optimizer_tensors(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors by ``<parameter name>.<state name>`` (``layers.0.mixer.q_proj.weight.exp_avg``)."""
    flat = {}
    for fqn, entry in osd["state"].items():
        for key, value in entry.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {fqn}.{key} is a {type(value).__name__}, not a tensor; "
                                "zoo's checkpoints hold tensor states only")
            flat[f"{fqn}.{key}"] = value
    return flat


class Checkpointer:
    def __init__(self, accelerator, out_dir: Path, keep_last: int):
        self.acc, self.root, self.keep_last = accelerator, Path(out_dir) / "checkpoints", keep_last

    def save(self, *, model, optimizer, scheduler, step: int, data_position: int, spec: ModelSpec,
             sharded: bool, config: TrainConfig) -> Path:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        acc = self.acc
        final = self.root / f"step-{step:07d}"
        tmp = self.root / f".tmp-step-{step:07d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            for part in PARTS:
                (tmp / part).mkdir(parents=True)
        acc.wait_for_everyone()
        osd = get_optimizer_state_dict(model, optimizer)
        _dcp_save(get_model_state_dict(model), tmp / "model")
        _dcp_save(_optimizer_tensors(osd), tmp / "optimizer")
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        meta = {"python": json.dumps(random.getstate())}
        save_file(rng, str(tmp / f"rng-rank{acc.process_index:05d}.safetensors"), metadata=meta)
        fsync_tree(tmp)  # each process its own files: the rename below must not outrun the data
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {
                "format": FORMAT, "step": step, "data_position": data_position, "processes": acc.num_processes,
                "sharded": sharded, "spec": spec.to_dict(), "config": dataclasses.asdict(config),
                "scheduler": scheduler.state_dict(),
                "optimizer": {"param_groups": osd["param_groups"]},
                "files": {part: sorted(p.name for p in (tmp / part).iterdir()) for part in PARTS},
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # the checkpoint appears whole or not at all
            fsync_dir(self.root)
            # Pruned by step among this run's (a corrupt later checkpoint that was skipped stays beside them).
            for old in [c for c in checkpoints(self.root.parent) if step_of(c) <= step][: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def load(self, path: Path, state: dict[str, Any], *, model, optimizer, scheduler) -> None:
        if state.get("format", 1) == 1:
            self._load_earlier(path, state, model=model, optimizer=optimizer)
        else:
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

            weights = get_model_state_dict(model)  # this layout's shards, filled in place
            _check_stored(path, "model", weights)
            _dcp_load(weights, path / "model")
            set_model_state_dict(model, weights)
            osd = get_optimizer_state_dict(model, optimizer)  # (this initialises an optimizer's state for the layout)
            tensors = _optimizer_tensors(osd)
            _check_stored(path, "optimizer", tensors)
            _dcp_load(tensors, path / "optimizer")
            set_optimizer_state_dict(model, optimizer, {"state": osd["state"],
                                                        "param_groups": state["optimizer"]["param_groups"]})
        scheduler.load_state_dict(state["scheduler"])
        # Each process's own RNG states; on more processes than wrote the checkpoint, the new ones keep the seed's.
        rng_file = path / f"rng-rank{self.acc.process_index:05d}.safetensors"
        if rng_file.is_file():
            from safetensors import safe_open
            from safetensors.torch import load_file

            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            with safe_open(str(rng_file), "pt") as f:
                py = json.loads(f.metadata()["python"])
            random.setstate((py[0], tuple(py[1]), py[2]))

    def _files(self, sharded: bool, name: str) -> str:
        rank, world = self.acc.process_index, self.acc.num_processes
        return f"{name}-rank{rank:05d}-of-{world:05d}.safetensors" if sharded else f"{name}.safetensors"

    def _load_earlier(self, path: Path, state: dict[str, Any], *, model, optimizer) -> None:
        """A checkpoint of the earlier layout: this process's ``model``/``optimizer`` file (one for all
        without FSDP or TP), the optimizer's tensors numbered by parameter, its keys in ``state.json``."""
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor

        sharded = state["sharded"]
        # A checkpoint of zoo 0.1 or 0.2 names the mixer ``layers.{i}.attention.*``, one of zoo 0.2 an moe FFN's
        # experts ``layers.{i}.ffn.w_up``: read under today's names where the model has them (a plugin's
        # own block keeps its ``attention``, found under its own name).
        weights = load_file(str(path / self._files(sharded, "model")))
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                if name not in weights:
                    name = next((old for old in earlier_names(name) if old in weights), name)
                if name not in weights:
                    raise KeyError(f"checkpoint {path} has no tensor {name!r}; it was written by another model")
                _local(t).copy_(weights[name])
        # Optimizer: tensors from safetensors, the rest from state.json; DTensor states re-wrapped like their params.
        tensors = load_file(str(path / self._files(sharded, "optimizer")))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        opt_state: dict[int, dict[str, Any]] = {}
        for i, keys in state["optimizer"]["state_keys"].items():
            p = params[int(i)]
            entry = {}
            for k in keys:
                v = tensors[f"{i}.{k}"]
                if isinstance(p, DTensor) and v.ndim:
                    v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                entry[k] = v
            opt_state[int(i)] = entry
        optimizer.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})


def read_state(path: Path) -> dict[str, Any]:
    """A training checkpoint's ``state.json`` as a dict holding a ``spec``; one that is missing, not
    JSON, not an object or without a spec is a ValueError naming the file."""
    file = Path(path) / "state.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a training checkpoint (no state.json); pass a step-NNNNNNN directory")
    try:
        state = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(state, dict) or not isinstance(state.get("spec"), dict):
        what = "has no spec" if isinstance(state, dict) else f"is a JSON {type(state).__name__}, not an object"
        raise ValueError(f"{file}: {what}; it is not a training checkpoint's state (or it is damaged)")
    return state


@contextlib.contextmanager
def _open(file: str):
    """``safe_open``, with a torn or unreadable file a ValueError naming it instead of a SafetensorError."""
    from safetensors import safe_open

    try:
        f = safe_open(file, "pt")
    except Exception as exc:
        raise ValueError(f"{file}: not a readable safetensors file, or cut short ({type(exc).__name__}: {exc}); "
                         "the checkpoint is damaged") from None
    with f:
        yield f


class CheckpointWeights(Mapping):
    """The whole weights of a training checkpoint by name, each tensor assembled from the pieces its
    files hold when it is asked for: a reader of one tensor at a time, for :func:`zoo.save_pretrained`
    (``state=``) and ``zoo export``. ``dtype`` casts the floating tensors as they are read."""

    def __init__(self, path: str | Path, dtype: Optional[torch.dtype] = None):
        self.path, self.dtype = Path(path), dtype
        state = read_state(self.path)
        # name -> (size, dtype, its pieces: (file, offsets, sizes, the name in the file))
        self.index: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[str, tuple, tuple, str]]]] = {}
        if state.get("format", 1) == 1:
            if state["sharded"]:
                raise ValueError(f"checkpoint {self.path} holds per-process shards of the earlier layout, which "
                                 f"only {state['processes']} processes read; resume it on them, and export the "
                                 "checkpoint that run writes")
            from safetensors import safe_open

            file = str(self.path / "model.safetensors")
            with _open(file) as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    shape = tuple(piece.get_shape())
                    dtype = DTYPES[piece.get_dtype()]
                    self.index[current_name(name)] = (shape, dtype, [(file, (0,) * len(shape), shape, name)])
            return
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint.metadata import MetadataIndex

        directory = self.path / "model"
        try:
            metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
        except Exception as exc:  # safetensors' SafetensorError, OSError, ... on a torn or missing shard
            raise ValueError(f"checkpoint {self.path}: its weights in {directory} cannot be read, a file is missing "
                             f"or cut short ({type(exc).__name__}: {exc})") from None
        for name, md in metadata.state_dict_metadata.items():
            pieces = []
            for chunk in md.chunks:
                where = metadata.storage_data[MetadataIndex(name, chunk.offsets)]
                file = str(directory / Path(where.relative_path).name)
                pieces.append((file, tuple(chunk.offsets), tuple(chunk.sizes), name))
            self.index[name] = (tuple(md.size), md.properties.dtype, pieces)

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def meta(self, name: str) -> torch.Tensor:
        size, dtype, _ = self.index[name]
        return torch.empty(size, dtype=self._dtype(dtype), device="meta")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        size, dtype, pieces = self.index[name]
        if len(pieces) == 1 and pieces[0][2] == size:  # written whole (one process, or a replicated tensor)
            with _open(pieces[0][0]) as f:
                return f.get_tensor(pieces[0][3]).to(self._dtype(dtype))
        whole = torch.empty(size, dtype=dtype)
        covered = 0
        for file, offsets, sizes, stored in pieces:
            with _open(file) as f:
                piece = f.get_tensor(stored)
            whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = piece
            covered += piece.numel()
        if covered != whole.numel():
            raise ValueError(f"checkpoint {self.path}: the pieces of {name!r} cover {covered} of its {whole.numel()} "
                             "elements; the checkpoint is incomplete")
        return whole.to(self._dtype(dtype))

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def full_state_dict(model: nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU (gathered from every process under FSDP2)."""
    if not sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], sharded: bool) -> None:
    """Copy whole weights into the model (each process keeps its own shard under FSDP2)."""
    if not sharded:
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
