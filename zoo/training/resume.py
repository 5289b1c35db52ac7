"""What keeps a training run whole: where it resumes from, what a resume may change, checkpoints
that are complete on disk (fsynced), and a metrics log that survives a torn line.

One ``out_dir`` holds one run. A fresh run refuses a directory holding another; a resumed run
refuses changed settings that the restored state would silently override; ``resume="auto"``
skips a corrupt latest checkpoint for the last complete one, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from zoo.checkpoints.files.io import fsync_dir, regular_file


def step_of(path: Path) -> int:
    """The step of a ``step-NNNNNNN`` directory; -1 for any other name."""
    digits = path.name[len("step-"):]
    return int(digits) if path.name.startswith("step-") and digits.isdigit() else -1


# Settings a resumed run cannot change: the optimizer's restored state would silently override
# them (lr, weight decay, betas, eps) or the data position would point elsewhere (the rest).
RESUME_FIXED = ("data", "packing", "sft", "tokenizer", "seq_len", "global_batch", "seed", "lr", "weight_decay", "beta1", "beta2", "eps", "lora")
# Settings a resumed run applies on purpose: the schedule and clipping read the new values.
RESUME_APPLIED = ("steps", "warmup_steps", "min_lr_ratio", "grad_clip")


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be resumed from (unreadable state.json, a missing or
    truncated tensor file), or None when it is complete."""
    from safetensors import safe_open

    try:
        state = json.loads((Path(path) / "state.json").read_text())
        sharded, processes = bool(state["sharded"]), int(state["processes"])
        missing = [k for k in ("step", "data_position", "spec", "scheduler", "optimizer") if k not in state]
        if missing:
            return f"state.json lacks {', '.join(missing)}"
        files = state["files"] if state.get("format", 1) >= 2 else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"state.json is unreadable ({type(exc).__name__}: {exc})"
    names = [f"rng-rank{r:05d}.safetensors" for r in range(processes)]
    if files is not None:  # torch.distributed.checkpoint's files, as state.json lists them
        names += [f"{part}/{name}" for part, listed in files.items() for name in listed]
    else:
        for kind in ("model", "optimizer"):
            names += ([f"{kind}-rank{r:05d}-of-{processes:05d}.safetensors" for r in range(processes)] if sharded
                      else [f"{kind}.safetensors"])
    for name in names:
        try:  # a FIFO (or device) named like the file would block the open: refused first
            with safe_open(str(regular_file(Path(path) / name, "checkpoint file")), "pt"):  # checks the header against the size
                pass
        except Exception as exc:  # missing, not a regular file (CheckpointError) or torn (SafetensorError)
            return f"{name}: {exc}"
    return None


def resume_point(config: Any, out_dir: Path, found: list[Path]) -> Optional[Path]:
    """The checkpoint a run continues from (None: a fresh run), given the complete checkpoints
    ``found`` in ``out_dir`` (oldest first), after checking that the run will not mix with another
    one there. ``resume="auto"`` skips a corrupt latest checkpoint (warning with its name) for the
    last complete one."""
    if config.resume is None:
        if found:
            raise ValueError(
                f"{out_dir} already holds a run (checkpoints {', '.join(p.name for p in found)}); a fresh run "
                "(resume=None) there would mix with it. Resume it (resume='auto'), choose another out_dir, "
                f"or delete {out_dir / 'checkpoints'} to start over"
            )
        return None
    if config.resume != "auto":
        path = Path(config.resume)
        problem = checkpoint_problem(path) if (path / "state.json").is_file() else None
        if problem:
            raise ValueError(f"checkpoint {path} is incomplete or corrupt: {problem}; resume from another one")
        later = [p.name for p in found if step_of(p) > step_of(path)] if step_of(path) >= 0 else []
        if later:
            raise ValueError(
                f"{out_dir} holds checkpoints after {path.name} ({', '.join(later)}), from a run this one would "
                "mix with; delete them to continue from the earlier step, or choose another out_dir"
            )
        return path
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warnings.warn(f"checkpoint {path} is incomplete or corrupt ({problem}); skipping it for an earlier one",
                      stacklevel=3)
    if found:
        raise ValueError(f"no complete checkpoint in {out_dir / 'checkpoints'}: every one is corrupt (see the "
                         "warnings); delete them to start afresh")
    return None


def check_resumed_config(path: Path, state: dict[str, Any], config: Any, log: Callable[[str], None]) -> None:
    """Refuse a resume that changes a setting in :data:`RESUME_FIXED`, naming each difference; log
    the changes of :data:`RESUME_APPLIED`, which the resumed run follows."""
    saved = state.get("config")
    if not saved:
        return
    now = json.loads(json.dumps(dataclasses.asdict(config)))  # tuples as lists, like the saved JSON

    def changed(names):
        return [f"{n}: {saved[n]!r} in the checkpoint, {now[n]!r} now" for n in names if n in saved and saved[n] != now[n]]

    refused = changed(RESUME_FIXED)
    if refused:
        raise ValueError(
            f"checkpoint {path} was written with other training settings ({'; '.join(refused)}); a resumed run keeps "
            "them. Resume with the same settings, or start a new run in another out_dir"
        )
    applied = changed(RESUME_APPLIED)
    if applied:
        log(f"resuming {path} with changed settings, which apply from here: {'; '.join(applied)}")


def metrics_up_to(metrics_file: Path, step: int) -> list[str]:
    """The lines of ``metrics.jsonl`` up to ``step``; a torn line (a write cut short) is dropped with a warning."""
    kept = []
    lines = metrics_file.read_text().splitlines() if metrics_file.is_file() else []
    for n, line in enumerate(lines, 1):
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            warnings.warn(f"{metrics_file}, line {n}: not a complete record ({line[:40]!r}); dropped", stacklevel=3)
            continue
        if row_step <= step:
            kept.append(line)
    return kept


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and each directory, to the disk."""
    for p in directory.iterdir():
        if p.is_dir():
            fsync_tree(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)
