"""Ablations as data: train every variant x learning rate x seed of a base recipe and compare.

An ablation file (TOML) names a base recipe, the variants as overrides of it, a learning-rate grid,
seeds, and the training settings (``zoo.TrainConfig`` fields: steps, batch, data, ...)::

    [ablation]
    claim = "QK-norm prevents attention-logit growth at high learning rates"
    base = "llama3-8b"             # a preset or a recipe file (relative to this file)
    lrs = [1e-3, 1e-2, 1e-1]
    seeds = [0, 1]

    [set]                          # overrides of the base, shared by every variant
    n_layers = 2
    d_model = 64

    [train]                        # zoo.TrainConfig fields
    steps = 100

    [variants.baseline]            # no overrides
    [variants.qk-norm]
    "layers.*.mixer.qk_norm" = "head"
    [variants.qk-norm.train]       # optional: training settings of this variant only
    warmup_steps = 0

    [larger]                       # `zoo ablate FILE --larger`: replaces these entries
    lrs = [...]
    set = { ... }

Each run goes through :func:`zoo.train` (one process, or DDP/FSDP2 under ``accelerate launch``)
and leaves ``runs/VARIANT/lr=LR/seed=SEED/result.json``; a run whose result file exists for the
same settings is skipped. A run whose loss is not finite or exceeds ``diverge_loss`` stops there
and is recorded as diverged at that step. The summary (``summary.md``, ``summary.json``) and the
plots (PNG, when matplotlib is installed) are written from the result files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from zoo.core.spec import ModelSpec

# What a run's TrainConfig takes from the sweep, not from the file.
_SWEEP_OWNED = ("lr", "seed", "out_dir", "resume", "stop_after", "export", "export_format", "plot", "progress",
                "init_from", "save_every", "keep_last")
_TABLES = {"ablation", "set", "train", "variants", "larger"}
_ABLATION_KEYS = {"name", "claim", "source", "base", "lrs", "seeds", "diverge_loss"}


class AblationError(ValueError):
    """An ablation file that cannot run: the message names the file, the variant and the field."""


@dataclass(frozen=True)
class Ablation:
    name: str
    base: str
    variants: dict[str, dict[str, Any]]  # variant -> overrides of the base (after ``shared``)
    lrs: tuple[float, ...]
    seeds: tuple[int, ...] = (0,)
    shared: dict[str, Any] = field(default_factory=dict)  # the [set] table
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields
    variant_train: dict[str, dict[str, Any]] = field(default_factory=dict)  # per variant, over ``train``
    claim: str = ""
    source: str = ""
    diverge_loss: float = 10.0  # nats; a byte-level model starts at ln 256 = 5.55
    path: Optional[Path] = None

    def overrides(self, variant: str) -> dict[str, Any]:
        return {**self.shared, **self.variants[variant]}

    def train_for(self, variant: str) -> dict[str, Any]:
        return {**self.train, **self.variant_train.get(variant, {})}

    def runs(self) -> list[tuple[str, float, int]]:
        return [(v, lr, s) for v in self.variants for lr in self.lrs for s in self.seeds]


def _where(path: Optional[Path]) -> str:
    return f"{path}: " if path else ""


def _folder_name(value: Any, field: str, where: str) -> str:
    """``value`` if it is one plain folder name (a variant, the ablation's name): nothing that leads out
    of the output directory (``..``, a path, an absolute path) or hides there (a leading dot)."""
    if not isinstance(value, str) or not value or value.startswith(".") or "/" in value or "\\" in value \
            or Path(value).is_absolute() or Path(value).name != value:
        raise AblationError(f"{where}{field} {value!r}: must be a plain folder name (no '/', no leading '.'): "
                            "the runs are written in a folder of that name under the output directory")
    return value


def _distinct(values: list, field: str, where: str) -> None:
    """Refuse a grid that lists one value twice (each run would be counted twice)."""
    seen = set()
    for v in values:
        if v in seen:
            raise AblationError(f"{where}{field} lists {v!r} twice ({values}); give each value once")
        seen.add(v)


def load(path: str | Path, *, larger: bool = False) -> Ablation:
    """Read an ablation file; ``larger`` applies its ``[larger]`` table. Checks the layout only;
    :func:`check` checks that every variant builds."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ablation file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AblationError(f"{path}: not valid TOML: {exc}") from None
    if larger:
        if "larger" not in data:
            raise AblationError(f"{path}: --larger asks for a [larger] table, and the file has none")
        extra = data["larger"]
        unknown = set(extra) - (_ABLATION_KEYS | {"set", "train", "variants"})
        if unknown:
            raise AblationError(f"{path}: [larger] has unknown keys {sorted(unknown)}")
        for table in ("set", "train"):
            data[table] = {**data.get(table, {}), **extra.get(table, {})}
        if "variants" in extra:
            data["variants"] = extra["variants"]
        data["ablation"] = {**data.get("ablation", {}), **{k: v for k, v in extra.items() if k in _ABLATION_KEYS}}
    return from_dict(data, path=path)


def from_dict(data: dict[str, Any], *, path: Optional[Path] = None) -> Ablation:
    where = _where(path)
    unknown = set(data) - _TABLES
    if unknown:
        raise AblationError(f"{where}unknown tables {sorted(unknown)}; an ablation file has {sorted(_TABLES)}")
    head = data.get("ablation", {})
    unknown = set(head) - _ABLATION_KEYS
    if unknown:
        raise AblationError(f"{where}[ablation] has unknown keys {sorted(unknown)}; it takes {sorted(_ABLATION_KEYS)}")
    if "base" not in head:
        raise AblationError(f"{where}[ablation].base is missing: name a preset or a recipe file")
    lrs, seeds = head.get("lrs", []), head.get("seeds", [0])
    if not isinstance(lrs, list) or not lrs:
        raise AblationError(f"{where}[ablation].lrs: the learning-rate grid is empty; give at least one learning rate")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in lrs):
        raise AblationError(f"{where}[ablation].lrs: every learning rate must be a positive number, got {lrs}")
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise AblationError(f"{where}[ablation].seeds: give a non-empty list of integer seeds, got {seeds!r}")
    _distinct([float(x) for x in lrs], "[ablation].lrs", where)
    _distinct(seeds, "[ablation].seeds", where)
    diverge = head.get("diverge_loss", 10.0)
    if isinstance(diverge, bool) or not isinstance(diverge, (int, float)) or not (math.isfinite(diverge) and diverge > 0):
        raise AblationError(f"{where}[ablation].diverge_loss: must be a positive finite loss (nats), got {diverge!r}")
    name = _folder_name(head["name"], "[ablation].name", where) if "name" in head else None
    if not data.get("variants"):
        raise AblationError(f"{where}[variants] is empty: give at least one variant table")
    variants, variant_train = {}, {}
    for variant, table in data.get("variants", {}).items():
        _folder_name(variant, "variant", where)
        if not isinstance(table, dict):
            raise AblationError(f"{where}variant {variant!r}: must be a table of overrides, got {table!r}")
        variants[variant] = {k: v for k, v in table.items() if k != "train"}
        if "train" in table:
            variant_train[variant] = _train_table(table["train"], f"{where}variant {variant!r}: train", path)
    train = _train_table(data.get("train", {}), f"{where}[train]", path)
    base = head["base"]
    if path is not None and base.endswith((".toml", ".json")) and not Path(base).is_absolute():
        base = str(path.parent / base)
    return Ablation(
        name=name or (path.stem if path else "ablation"), base=base, variants=variants,
        lrs=tuple(float(x) for x in lrs), seeds=tuple(seeds), shared=dict(data.get("set", {})), train=train,
        variant_train=variant_train,
        claim=head.get("claim", ""), source=head.get("source", ""),
        diverge_loss=float(diverge), path=path,
    )


def _train_table(table: Any, where: str, path: Optional[Path]) -> dict[str, Any]:
    from zoo.training.config import TrainConfig

    if not isinstance(table, dict):
        raise AblationError(f"{where}: must be a table of zoo.TrainConfig fields, got {table!r}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in table:
        if key not in fields:
            raise AblationError(f"{where}.{key}: not a zoo.TrainConfig field; it takes {sorted(fields)}")
        if key in _SWEEP_OWNED:
            raise AblationError(f"{where}.{key}: set by the sweep (the grid, the output directory), not the file")
    table = dict(table)
    if "data" in table:  # relative to the ablation file
        if not isinstance(table["data"], list) or not all(isinstance(d, str) for d in table["data"]):
            raise AblationError(f"{where}.data: must be a list of file paths, got {table['data']!r}")
        table["data"] = tuple(str(path.parent / d if path and not Path(d).is_absolute() else d) for d in table["data"])
    return table


def check(ablation: Ablation) -> dict[str, ModelSpec]:
    """Every variant's spec, after building each on the meta device; refuses (naming the variant and
    the field) an unknown override path, a wrong value, a variant that fails to build, or training
    settings that cannot run. Nothing is trained."""
    from zoo.model.recipes import build, get_spec
    from zoo.core.registry import RegistryError
    from zoo.core.spec import SpecError
    from zoo.training.config import TrainConfig

    where = _where(ablation.path)
    specs = {}
    for variant in ablation.variants:
        config = TrainConfig(**ablation.train_for(variant), lr=max(ablation.lrs))
        try:
            config.check()
            config.accumulation(int(os.environ.get("WORLD_SIZE", "1")))  # the batch divides over the processes
        except ValueError as exc:
            raise AblationError(f"{where}variant {variant!r}: {exc}") from None
        try:
            spec = get_spec(ablation.base, ablation.overrides(variant))
            build(spec, device="meta")
        except (SpecError, RegistryError, ValueError, TypeError) as exc:
            raise AblationError(f"{where}variant {variant!r}: {exc}") from None
        if config.seq_len > spec.max_seq_len:
            raise AblationError(f"{where}variant {variant!r}: max_seq_len {spec.max_seq_len} is below "
                                f"[train].seq_len {config.seq_len}")
        specs[variant] = spec
    return specs


# -- what a run measures beyond the trainer's own metrics -----------------------------------------

class AttentionLogits:
    """The largest attention logit (the score fed to the softmax, after scaling and any soft-cap) of
    each layer, over the forwards since the last :meth:`take`.

    Within the block, forward contexts ask for the metric ``attn_logit_max``
    (:func:`zoo.core.context.asking`): attention reports ``attn_logit_max/layer{i}`` through
    ``ctx.add_metric`` and this reads each forward's metrics. Layers whose mixer reports none (a
    recurrent mixer) give None.
    """

    def __init__(self) -> None:
        self.values: dict[int, float] = {}
        self._n_layers = 0
        self._scope = None

    def __enter__(self) -> "AttentionLogits":
        from zoo.core.context import asking

        self._scope = asking(("attn_logit_max",), self._read)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._scope.__exit__(*exc)

    def _read(self, ctx) -> None:
        if ctx.n_layers is None:  # a context of something else than the model's own layers (MTP)
            return
        self._n_layers = ctx.n_layers
        for name, value in ctx.metrics.items():
            prefix, _, layer = name.partition("/layer")
            if prefix == "attn_logit_max" and layer.isdigit():
                i = int(layer)
                self.values[i] = max(float(value), self.values.get(i, float("-inf")))

    def take(self, device: Any = "cpu") -> list[Optional[float]]:
        """Per layer, the largest logit since the last call, over every process of a distributed run
        (``device``: where the process group's collectives run, the model's device)."""
        out = [self.values.get(i) for i in range(self._n_layers)]
        self.values = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and out:
            t = torch.tensor([float("-inf") if v is None else v for v in out], device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            out = [None if math.isinf(v) else v for v in t.tolist()]
        return out


def param_norm(model: nn.Module) -> float:
    with torch.no_grad():
        return float(torch.linalg.vector_norm(torch.stack([p.detach().float().norm() for p in model.parameters()])))


class Diverged(Exception):
    def __init__(self, step: int, loss: float):
        super().__init__(f"diverged at step {step} (loss {loss})")
        self.step, self.loss = step, loss


# -- trackers (Accelerate's) ----------------------------------------------------------------------

def check_trackers(log_with: Sequence[str]) -> None:
    """Refuse, before any run, a tracker Accelerate does not know or whose package is not installed."""
    if not log_with:
        return
    from accelerate.tracking import filter_trackers

    found = {str(t) for t in filter_trackers(list(log_with), logging_dir=".")}
    missing = [t for t in log_with if t not in found]
    if missing:
        raise ValueError(f"--log-with {' '.join(missing)}: Accelerate cannot log there (not installed, or not a "
                         "tracker it knows; install the package, e.g. `pip install tensorboard`)")


def open_trackers(log_with: Sequence[str], logging_dir: Path, run_name: str, config: dict[str, Any]) -> list:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, filter_trackers

    trackers = []
    for kind in filter_trackers(list(log_with), logging_dir=str(logging_dir)):
        cls = LOGGER_TYPE_TO_CLASS[str(kind)]
        tracker = cls(run_name, str(logging_dir)) if cls.requires_logging_directory else cls(run_name)
        tracker.start()
        tracker.store_init_configuration(config)
        trackers.append(tracker)
    return trackers


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, list):
            out.update({f"{k}/layer{i}": x for i, x in enumerate(v) if x is not None})
        elif isinstance(v, (int, float)) and k != "step":
            out[k] = v
    return out


# -- the sweep ------------------------------------------------------------------------------------

def is_main_process() -> bool:
    """Decided before zoo.train sets up the processes: the launcher's RANK (0 when not launched)."""
    return int(os.environ.get("RANK", "0")) == 0


def run_dir(out_dir: Path, variant: str, lr: float, seed: int) -> Path:
    """Where a run's files go. The learning rate is spelt exactly (``repr``): two that print alike
    with ``%g`` (1e-3 and 1.0000001e-3) are two runs."""
    return Path(out_dir) / "runs" / variant / f"lr={float(lr)!r}" / f"seed={seed}"


def run_settings(ablation: Ablation, variant: str, spec: ModelSpec, lr: float, seed: int) -> dict[str, Any]:
    """What makes a run: a stored result is reused only when these match."""
    train = {k: list(v) if isinstance(v, tuple) else v for k, v in ablation.train_for(variant).items()}
    return {"spec": spec.to_dict(), "train": train, "lr": lr, "seed": seed, "diverge_loss": ablation.diverge_loss}


def read_result(path: Path) -> Optional[dict[str, Any]]:
    f = path / "result.json"
    return json.loads(f.read_text()) if f.is_file() else None


def plan(ablation: Ablation, specs: dict[str, ModelSpec], out_dir: str | Path) -> list[tuple]:
    """(variant, lr, seed, run directory, state, stored result) for every run; state is ``done`` (a
    result made with the same settings), ``stale`` (made with other settings) or ``todo``."""
    rows = []
    for variant, lr, seed in ablation.runs():
        out = run_dir(Path(out_dir), variant, lr, seed)
        stored = read_result(out)
        same = json.loads(json.dumps(run_settings(ablation, variant, specs[variant], lr, seed)))
        state = "todo" if stored is None else "done" if stored.get("settings") == same else "stale"
        rows.append((variant, lr, seed, out, state, stored))
    return rows


def train_one(ablation: Ablation, spec: ModelSpec, variant: str, lr: float, seed: int, out: Path, *,
              facts: dict[str, Any], log_with: Sequence[str] = (), logging_dir: Optional[Path] = None
              ) -> dict[str, Any]:
    """One run through zoo.train; returns (and, on the main process, writes) its result."""
    from zoo.training.loop import train

    settings = run_settings(ablation, variant, spec, lr, seed)
    history: list[dict[str, Any]] = []
    main = is_main_process()
    trackers = open_trackers(log_with, logging_dir or out / "logs", f"{variant}/lr={lr:g}/seed={seed}",
                             {"variant": variant, "lr": lr, "seed": seed}) if log_with and main else []
    probe = AttentionLogits()

    def on_step(row: dict[str, Any], model: nn.Module) -> None:
        row["attn_logit_max"] = probe.take(device=next(model.parameters()).device)
        row["log_z_rms"] = math.sqrt(row["z"]) if row["z"] >= 0 else float("nan")
        row["param_norm"] = param_norm(model)
        history.append(dict(row))
        for t in trackers:
            t.log(_scalars(row), step=row["step"])
        if not math.isfinite(row["loss"]) or row["loss"] > ablation.diverge_loss:
            raise Diverged(row["step"], row["loss"])

    diverged = None
    # Without result.json the run is not done: what a killed attempt left (its last checkpoint, written
    # before the sweep removes it) would make the fresh run refuse the folder.
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    try:
        with probe:
            train(ablation.base, overrides=ablation.overrides(variant), on_step=on_step, **ablation.train_for(variant),
                  lr=lr, seed=seed, out_dir=str(out), resume=None, export=False, plot=False, progress=False,
                  save_every=0, keep_last=1)
    except Diverged as exc:
        diverged = exc
    finally:
        for t in trackers:
            t.finish()
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the sweep keeps metrics, not weights
    result = {
        "variant": variant, "lr": lr, "seed": seed,
        "status": "diverged" if diverged else "ok",
        "diverged_step": diverged.step if diverged else None,
        **facts,
        "history": history,
        "settings": settings,
    }
    if main:
        tmp = out / "result.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out / "result.json")  # present means complete
    return result


def _say(line: str) -> None:
    print(line, flush=True)


def _quiet(line: str) -> None:
    pass


def sweep(ablation: Ablation, out_dir: str | Path, *, log_with: Sequence[str] = (), report: bool = True,
          echo=_say) -> dict[str, Any]:
    """Run what is not done yet (after checking everything), then write the summary and plots.
    Returns the summary."""
    from zoo.tools.accounting import account

    specs = check(ablation)
    check_trackers(log_with)
    out_dir = Path(out_dir)
    if not is_main_process():
        echo = _quiet
    facts = {}
    for variant, spec in specs.items():  # the model's own accounting (KV cache in bf16, as served)
        figures = account(spec, dtype="bf16")
        facts[variant] = {"params": figures["params"]["total"],
                          "kv_bytes_per_token": figures["decode_state"]["bytes_per_token"]}
    todo, results = [], []
    for variant, lr, seed, out, state, done in plan(ablation, specs, out_dir):  # up front: every process agrees
        if state == "done":
            results.append(done)
        else:
            todo.append((variant, lr, seed, out, state == "stale"))
    echo(f"{ablation.name}: {len(ablation.runs())} runs, {len(results)} already done, {len(todo)} to run")
    for i, (variant, lr, seed, out, stale) in enumerate(todo, 1):
        if stale:
            echo(f"  {variant} lr={lr:g} seed={seed}: the stored result was made with other settings; running again")
        r = train_one(ablation, specs[variant], variant, lr, seed, out, facts=facts[variant],
                      log_with=log_with, logging_dir=out_dir / "logs")
        # the number the summary's table shows for this run, and what it is
        state = (f"diverged at step {r['diverged_step']}" if r["status"] == "diverged" else
                 f"final loss {final_loss(r['history']):.4f} ({FINAL_LOSS})" if r["history"] else "no steps")
        echo(f"  [{i}/{len(todo)}] {variant} lr={lr:g} seed={seed}: {state}")
        results.append(r)
    summary = summarise(ablation, results)
    if report and is_main_process():
        write_report(ablation, summary, results, out_dir, echo=echo)
    return summary


# -- summary --------------------------------------------------------------------------------------

FINAL_LOSS = "cross-entropy, mean of the last tenth of the steps"


def final_loss(history: list[dict[str, Any]]) -> float:
    """Cross-entropy averaged over the last tenth of the steps (at least one): :data:`FINAL_LOSS`."""
    tail = history[-max(1, len(history) // 10):]
    return sum(r["ce"] for r in tail) / len(tail)


def _last(history, key):
    return history[-1][key] if history else None


def summarise(ablation: Ablation, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant and learning rate: final loss over seeds (mean, min, max), divergences; per
    variant: best learning rate, and LR sensitivity as Wortsman et al. (2023) define it: the mean over
    the grid of ``min(loss(lr), loss at init) - min over the grid``, a diverged run counting as the
    loss at initialisation."""
    from zoo.training.config import TrainConfig

    variants = {}
    for variant in ablation.variants:
        runs = [r for r in results if r["variant"] == variant]
        starts = [r["history"][0]["ce"] for r in runs if r["history"] and math.isfinite(r["history"][0]["ce"])]
        init = sum(starts) / len(starts) if starts else float("nan")
        per_lr = []
        for lr in ablation.lrs:
            at = [r for r in runs if r["lr"] == lr]
            ok = [final_loss(r["history"]) for r in at if r["status"] == "ok"]
            capped = [min(final_loss(r["history"]), init) if r["status"] == "ok" else init for r in at]
            per_lr.append({
                "lr": lr,
                "final_loss": sum(ok) / len(ok) if ok else None,
                "min": min(ok) if ok else None, "max": max(ok) if ok else None,
                "capped": sum(capped) / len(capped) if capped else None,
                "diverged": [{"seed": r["seed"], "step": r["diverged_step"]} for r in at if r["status"] == "diverged"],
                "attn_logit_max": _mean([_top(_last(r["history"], "attn_logit_max")) for r in at]),
                "log_z_rms": _mean([_last(r["history"], "log_z_rms") for r in at]),
                "tokens_per_s": _mean([_mean([h["tokens_per_s"] for h in r["history"][1:]]) for r in at]),
            })
        clean = [p for p in per_lr if p["final_loss"] is not None and not p["diverged"]]
        best = min(clean, key=lambda p: p["final_loss"]) if clean else None
        capped = [p["capped"] for p in per_lr if p["capped"] is not None]
        sensitivity = (sum(capped) / len(capped) - min(capped)) if capped else None
        variants[variant] = {
            "overrides": ablation.variants[variant],
            "best_lr": best["lr"] if best else None,
            "best_loss": best["final_loss"] if best else None,
            "lr_sensitivity": sensitivity,
            "initial_loss": init,
            "diverged_runs": sum(len(p["diverged"]) for p in per_lr),
            "runs": len(runs),
            "params": runs[0]["params"] if runs else None,
            "kv_bytes_per_token": runs[0]["kv_bytes_per_token"] if runs else None,
            "per_lr": per_lr,
        }
    return {"name": ablation.name, "claim": ablation.claim, "source": ablation.source, "base": ablation.base,
            "lrs": list(ablation.lrs), "seeds": list(ablation.seeds), "diverge_loss": ablation.diverge_loss,
            "steps": {v: TrainConfig(**ablation.train_for(v)).steps for v in ablation.variants}, "variants": variants}


def _top(values):
    values = [v for v in values or [] if v is not None]
    return max(values) if values else None


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['name']}", ""]
    if summary["claim"]:
        lines += [f"Claim: {summary['claim']}", ""]
    steps = sorted(set(summary["steps"].values()))
    lines += [f"Base `{summary['base']}`, {'/'.join(map(str, steps))} steps, learning rates "
              f"{', '.join(f'{x:g}' for x in summary['lrs'])}, seeds {summary['seeds']}. "
              "Final loss: training cross-entropy averaged over the last tenth of the steps (mean over seeds).", "",
              "| variant | best LR | final loss at best LR | LR sensitivity | diverged runs | params "
              "| KV bytes/token (bf16) |",
              "|---|---|---|---|---|---|---|"]
    for name, v in summary["variants"].items():
        lines.append(f"| {name} | {_fmt(v['best_lr'], 'g')} | {_fmt(v['best_loss'])} | {_fmt(v['lr_sensitivity'])} "
                     f"| {v['diverged_runs']} of {v['runs']} | {v['params']:,} | {_fmt(v['kv_bytes_per_token'], ',.0f')} |")
    lines += ["", "Per learning rate: final loss (min-max over seeds); the largest attention logit and the RMS of "
              "log Z at the last step; tokens/s.", "",
              "| variant | LR | final loss | spread | diverged (seed@step) | max attention logit | RMS log Z "
              "| tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for name, v in summary["variants"].items():
        for p in v["per_lr"]:
            spread = f"{p['min']:.4f}-{p['max']:.4f}" if p["min"] is not None else "-"
            div = ", ".join(f"{d['seed']}@{d['step']}" for d in p["diverged"]) or "-"
            lines.append(f"| {name} | {p['lr']:g} | {_fmt(p['final_loss'])} | {spread} | {div} "
                         f"| {_fmt(p['attn_logit_max'], '.2f')} | {_fmt(p['log_z_rms'], '.3f')} "
                         f"| {_fmt(p['tokens_per_s'], ',.0f')} |")
    return "\n".join(lines) + "\n"


def write_report(ablation: Ablation, summary: dict[str, Any], results: list[dict[str, Any]], out_dir: Path,
                 echo=_say) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "summary.json", out_dir / "summary.md"]
    written[0].write_text(json.dumps(summary, indent=1))
    written[1].write_text(markdown(summary))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        echo("matplotlib is not installed: tables written, no plots (pip install matplotlib)")
    else:
        written += [fig_path for fig_path in plot_all(ablation, summary, results, out_dir)]
    echo("wrote " + ", ".join(str(p) for p in written))
    return written


# -- plots ----------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean_curve(runs: list[dict[str, Any]], key: str, reduce=None) -> tuple[list[int], list[float]]:
    """The seeds' mean of ``key`` per step, over the steps every seed reached."""
    length = min(len(r["history"]) for r in runs)
    steps, values = [], []
    for i in range(length):
        vals = [r["history"][i][key] for r in runs]
        if reduce is not None:
            vals = [reduce(v) for v in vals]
        vals = [v for v in vals if v is not None and math.isfinite(v)]
        if vals:
            steps.append(runs[0]["history"][i]["step"])
            values.append(sum(vals) / len(vals))
    return steps, values


LEGEND = 9  # points: legends and panel titles that read at the saved size
DPI = 110


def _title(fig, name: str, claim: str, what: str) -> None:
    """The figure's title: the claim the ablation tests (wrapped), then what the figure shows."""
    import textwrap

    head = textwrap.fill(claim, 110) if claim else name
    fig.suptitle(f"{head}\n{what} ({name})", fontsize=LEGEND + 1)


def _seeds(seeds) -> str:
    return f"{len(seeds)} seeds" if len(seeds) != 1 else "1 seed"


def curves_figure(ablation: Ablation, results: list[dict[str, Any]], key: str, ylabel: str, *, reduce=None,
                  log_y: bool = False):
    """One panel per variant, one line per learning rate (mean over seeds) of ``key`` against step."""
    plt = _pyplot()
    n = len(ablation.variants)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 1.0, 4.2), sharey=True, squeeze=False)
    colours = plt.get_cmap("viridis")
    for ax, variant in zip(axes[0], ablation.variants):
        for j, lr in enumerate(ablation.lrs):
            runs = [r for r in results if r["variant"] == variant and r["lr"] == lr and r["history"]]
            if not runs:
                continue
            steps, values = _mean_curve(runs, key, reduce)
            diverged = any(r["status"] == "diverged" for r in runs)
            ax.plot(steps, values, color=colours(j / max(1, len(ablation.lrs) - 1)),
                    label=f"lr={lr:g}" + (" (diverged)" if diverged else ""), linewidth=1.2)
        ax.set_title(variant, fontsize=LEGEND + 1)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log_y:
            ax.set_yscale("log")
        ax.legend(fontsize=LEGEND)
    axes[0][0].set_ylabel(ylabel)
    _title(fig, ablation.name, ablation.claim, f"{ylabel} against step, each line the mean over "
           f"{_seeds(ablation.seeds)}")
    fig.tight_layout()
    return fig


def lr_figure(summary: dict[str, Any]):
    """Against learning rate (log scale), one line per variant: final loss with the min-max band over
    seeds (a diverged learning rate is an x at the loss at initialisation), the largest attention logit
    and the RMS of log Z at the end."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    panels = [("final_loss", "final loss (cross-entropy)"), ("attn_logit_max", "largest attention logit"),
              ("log_z_rms", "RMS log Z (output)")]
    titles = [f"final loss: {FINAL_LOSS}", "at the last step", "at the last step"]
    seeds = summary.get("seeds") or []
    for name, v in summary["variants"].items():
        ok = [p for p in v["per_lr"] if p["final_loss"] is not None and not p["diverged"]]
        line = axes[0].plot([p["lr"] for p in ok], [p["final_loss"] for p in ok], marker="o", label=name)[0]
        if len(seeds) != 1:
            axes[0].fill_between([p["lr"] for p in ok], [p["min"] for p in ok], [p["max"] for p in ok],
                                 color=line.get_color(), alpha=0.2)
        bad = [p["lr"] for p in v["per_lr"] if p["diverged"]]
        if bad:
            axes[0].plot(bad, [v["initial_loss"]] * len(bad), linestyle="none", marker="x", markersize=8,
                         color=line.get_color(), label=f"{name} diverged")
        for ax, (key, _) in zip(axes[1:], panels[1:]):
            pts = [p for p in v["per_lr"] if p[key] is not None]
            ax.plot([p["lr"] for p in pts], [p[key] for p in pts], marker="o", color=line.get_color(), label=name)
    axes[1].set_yscale("log")  # logit growth spans orders of magnitude
    for ax, (_, label), title in zip(axes, panels, titles):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=LEGEND)
        ax.grid(alpha=0.3)
    band = (f"line: mean over {_seeds(seeds)}; band: min to max" if len(seeds) > 1 else
            "one seed (no band)" if seeds else "line: mean over seeds; band: min to max")
    axes[0].legend(fontsize=LEGEND, title=band, title_fontsize=LEGEND)
    _title(fig, summary["name"], summary.get("claim", ""), "against learning rate")
    fig.tight_layout()
    return fig


def plot_all(ablation: Ablation, summary: dict[str, Any], results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    figures = {
        "lr_sensitivity.png": lr_figure(summary),
        "loss_curves.png": curves_figure(ablation, results, "ce", "cross-entropy (nats/token)"),
        "attention_logits.png": curves_figure(ablation, results, "attn_logit_max", "largest attention logit",
                                              reduce=_top, log_y=True),
        "log_z.png": curves_figure(ablation, results, "log_z_rms", "RMS log Z (output)"),
    }
    paths = []
    for name, fig in figures.items():
        fig.savefig(out_dir / name, dpi=DPI)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths
