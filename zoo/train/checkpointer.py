"""Training checkpoints: write and restore the model, optimizer, scheduler and RNG state of a run."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.checkpoints.maps import current_name, moved_expert_name
from zoo.core.spec import ModelSpec, differences
from zoo.train.config import TrainConfig
from zoo.train.resume import fsync_dir, fsync_tree, step_of


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return _local(t).detach().to("cpu").contiguous()


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
    if state["sharded"] and state["processes"] != processes:
        raise ValueError(
            f"checkpoint {path} holds FSDP shards for {state['processes']} processes, but {processes} are running; "
            "resume with the same number of processes"
        )
    return state


class Checkpointer:
    def __init__(self, accelerator, out_dir: Path, keep_last: int):
        self.acc, self.root, self.keep_last = accelerator, Path(out_dir) / "checkpoints", keep_last

    def _files(self, sharded: bool, name: str) -> str:
        rank, world = self.acc.process_index, self.acc.num_processes
        return f"{name}-rank{rank:05d}-of-{world:05d}.safetensors" if sharded else f"{name}.safetensors"

    def save(self, *, model, optimizer, scheduler, step: int, data_position: int, spec: ModelSpec,
             sharded: bool, config: TrainConfig) -> Path:
        from safetensors.torch import save_file

        acc = self.acc
        final = self.root / f"step-{step:07d}"
        tmp = self.root / f".tmp-step-{step:07d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        writer = sharded or acc.is_main_process
        if writer:
            save_file({k: _cpu(v) for k, v in model.state_dict().items()}, str(tmp / self._files(sharded, "model")))
            opt_state = optimizer.state_dict()
            tensors = {f"{i}.{k}": _cpu(v) for i, s in opt_state["state"].items() for k, v in s.items()
                       if torch.is_tensor(v)}
            save_file(tensors, str(tmp / self._files(sharded, "optimizer")))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        meta = {"python": json.dumps(random.getstate())}
        save_file(rng, str(tmp / f"rng-rank{acc.process_index:05d}.safetensors"), metadata=meta)
        if acc.is_main_process:
            state = {
                "step": step, "data_position": data_position, "processes": acc.num_processes,
                "sharded": sharded, "spec": spec.to_dict(), "config": dataclasses.asdict(config),
                "scheduler": scheduler.state_dict(),
                "optimizer": {"param_groups": opt_state["param_groups"],
                              "state_keys": {str(i): sorted(k for k, v in s.items() if torch.is_tensor(v))
                                             for i, s in opt_state["state"].items()}},
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
        fsync_tree(tmp)  # each process its own files: the rename below must not outrun the data
        acc.wait_for_everyone()
        if acc.is_main_process:
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
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor

        sharded = state["sharded"]
        # A checkpoint of zoo 0.1 names the mixer ``layers.{i}.attention.*``: read it under today's names.
        weights = {current_name(k): v for k, v in load_file(str(path / self._files(sharded, "model"))).items()}
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                old = name.replace(".experts.w_", ".w_") if name not in weights else name
                if old != name and old in weights and moved_expert_name(old) == name:  # zoo 0.2's MoE names
                    weights[name] = weights.pop(old)
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
        scheduler.load_state_dict(state["scheduler"])
        rng_file = path / f"rng-rank{self.acc.process_index:05d}.safetensors"
        if rng_file.is_file():
            from safetensors import safe_open

            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            with safe_open(str(rng_file), "pt") as f:
                py = json.loads(f.metadata()["python"])
            random.setstate((py[0], tuple(py[1]), py[2]))


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
