"""What to train on and how (TrainConfig), and what a run returns (TrainResult)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union


MESH_DIMS = ("dp_replicate", "dp_shard", "ep", "tp")


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from a TOML file or keyword) has the annotated type ``hint``: an int where an
    int is meant (not a bool), a number where a float is, a bool where a bool is (not the string "no")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(_fits(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, (tuple, list)) and all(_fits(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:  # a path may be a Path
        return isinstance(value, (str, os.PathLike))
    return isinstance(value, hint) if isinstance(hint, type) else True


def check_types(config: Any, prefix: Optional[str] = None) -> None:
    """Refuse a field whose value is not of its declared type, naming it (``cpu = "no"`` is no bool)
    as ``prefix.field`` (default: the class name)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _fits(value, hints[f.name]):
            want = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise ValueError(f"{prefix or type(config).__name__}.{f.name} must be {want}, got {value!r}")


def _section(cls: type, value: Any, name: str) -> Any:
    """A ``[name]`` table (a dict) read as the fields of the dataclass ``cls``; an unknown key is an error naming it."""
    if not isinstance(value, dict):
        return value
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: not a {name} setting; they are {sorted(known)}")
    return cls(**value)


@dataclass
class ParallelConfig:
    """How the processes split the work (the ``[parallel]`` table of a training config; ``--dp-replicate``,
    ``--dp-shard``, ``--tp``, ``--ep``, ``--ac`` on the command line). The product of the sizes is the
    number of processes. ``dp_replicate`` > 1 with ``dp_shard`` > 1 is HSDP (FSDP2 within each replica,
    gradients averaged across replicas); ``ac`` checkpoints activations: ``none``, ``block`` (every
    block) or ``N`` (every N-th block, counting from the first)."""

    dp_replicate: int = 1  # replicas (HSDP's outer dimension)
    dp_shard: int = -1  # FSDP2 shards within a replica; -1: the processes left by the other sizes
    tp: int = 1  # tensor (and sequence) parallel degree
    ep: int = 1  # expert parallel degree
    ac: str = "none"  # activation checkpointing: none, block, or every N-th block

    def sizes(self, processes: int) -> dict[str, int]:
        """Each mesh dimension's size for ``processes`` processes (``dp_shard = -1`` resolved); raises,
        naming the sizes to change, when they do not multiply to ``processes``."""
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and not (name == "dp_shard" and value == -1)):
                raise ValueError(f"parallel.{name} must be a positive integer{' or -1 (the rest)' if name == 'dp_shard' else ''}, "
                                 f"got {value!r}")
        fixed = {n: getattr(self, n) for n in MESH_DIMS if not (n == "dp_shard" and self.dp_shard == -1)}
        product = math.prod(fixed.values())
        given = " x ".join(f"{n} {v}" for n, v in fixed.items() if v != 1) or "1"
        if self.dp_shard == -1:
            if processes % product:
                raise ValueError(
                    f"parallel: {given} = {product} does not divide the {processes} processes, so dp_shard = -1 "
                    f"has no size; change {', '.join(n for n, v in fixed.items() if v != 1)} to divide {processes}, "
                    "or launch a multiple of their product")
            return {**fixed, "dp_shard": processes // product}
        if product != processes:
            raise ValueError(
                f"parallel: {given} = {product}, but {processes} processes are running; the sizes must multiply "
                f"to {processes}: change {', '.join(n for n, v in fixed.items() if v != 1) or 'dp_shard'}, or set "
                "dp_shard = -1 to take the rest")
        return fixed

    def checkpointed(self, n_layers: int) -> list[int]:
        """The blocks whose activations are recomputed in backward."""
        ac = str(self.ac).strip().lower()
        if ac == "none":
            return []
        if ac == "block":
            return list(range(n_layers))
        if ac.isdigit() and int(ac) >= 1:
            return list(range(0, n_layers, int(ac)))
        raise ValueError(f"parallel.ac must be none, block or a positive integer N (every N-th block), got {self.ac!r}")

    def check(self) -> None:
        self.checkpointed(1)

    def with_accelerate(self, env: Optional[dict[str, str]] = None) -> "ParallelConfig":
        """These settings with the sizes of an accelerate config's ``parallelism_config`` (which
        ``accelerate launch`` passes as ``PARALLELISM_CONFIG_*`` variables): its ``dp_replicate_size``,
        ``dp_shard_size`` and ``tp_size`` become ``dp_replicate``, ``dp_shard`` and ``tp``. Sizes set in
        zoo's own ``parallel`` settings too must agree with it, or the error names both. Context and
        sequence parallelism (``cp_size``, ``sp_size`` above 1) are refused: zoo has neither."""
        env = os.environ if env is None else env
        if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
            return self
        sizes = {}
        for theirs, ours in (("DP_REPLICATE", "dp_replicate"), ("DP_SHARD", "dp_shard"), ("TP", "tp"),
                             ("CP", None), ("SP", None)):
            key = f"PARALLELISM_CONFIG_{theirs}_SIZE"
            try:
                size = int(env.get(key, "1"))
            except ValueError:
                raise ValueError(f"the accelerate config's parallelism_config_{theirs.lower()}_size ({key}) "
                                 f"must be an integer, got {env[key]!r}") from None
            if ours is None:
                if size > 1:
                    raise ValueError(f"the accelerate config sets parallelism_config_{theirs.lower()}_size = {size}, "
                                     f"but zoo has no {'context' if theirs == 'CP' else 'sequence (Ulysses)'} "
                                     "parallelism; set it to 1 (zoo's tensor parallelism shards the sequence "
                                     "between blocks: parallelism_config_tp_size or parallel.tp)")
                continue
            mine, default = getattr(self, ours), getattr(ParallelConfig, ours)
            if mine != default and mine != size:
                raise ValueError(f"parallel.{ours} = {mine} in zoo's settings, but the accelerate config's "
                                 f"parallelism_config_{theirs.lower()}_size = {size}; set one of them, or make them agree")
            sizes[ours] = size
        return dataclasses.replace(self, **sizes)

    def check_model(self, spec: Any) -> None:
        """Refuse, naming the field, an ``ep`` the model ``spec`` cannot split its experts over: ``ep`` > 1
        needs an FFN that shards its experts (``parallelize_experts``, as the ``moe`` FFN does), and must
        divide each such FFN's ``n_experts``."""
        from zoo.core.kinds import implements

        if self.ep == 1:
            return
        ffns = [(f"layers.{i}.ffn", spec.layer(i).ffn) for i in range(spec.n_layers) if spec.layer(i).ffn is not None]
        moes = [(at, ffn) for at, ffn in ffns if implements(ffn.cls, "parallelize_experts")]
        if not moes:
            raise ValueError(f"parallel.ep = {self.ep}: the model has no FFN with routed experts to shard (an moe "
                             f"FFN); its FFNs are {sorted({ffn.name for _, ffn in ffns})}; set ep = 1")
        for at, ffn in moes:
            n = getattr(ffn.config, "n_experts", None)
            if isinstance(n, int) and n % self.ep:
                raise ValueError(f"parallel.ep = {self.ep} does not divide {at}.n_experts = {n}; "
                                 f"choose an ep that divides {n}")


@dataclass
class LoraSettings:
    """LoRA fine-tuning through peft (the ``[lora]`` table of a training config; ``--lora r=16,alpha=32``
    on the command line): rank-``r`` updates ``B @ A`` scaled by ``alpha / r`` on the linear modules
    ``targets`` names, the base weights frozen. A target is a module name or its end (``q_proj`` picks
    every layer's, as peft matches); none: every linear projection of the blocks (attention and MLP).
    At the end the adapter is written as a PEFT adapter directory (``out_dir/adapter``) and, with
    ``merge``, the merged model as a normal checkpoint (``out_dir/final``)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ()  # zoo module names (q_proj, k_proj, v_proj, o_proj, gate, up, down); (): all of the blocks'
    rslora: bool = False  # scale by alpha / sqrt(r)
    merge: bool = True  # also export the merged model to out_dir/final

    def __post_init__(self):
        if isinstance(self.targets, (list, str)):
            self.targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)

    def check(self) -> None:
        check_types(self, "lora")
        if self.r < 1:
            raise ValueError(f"lora.r must be at least 1, got {self.r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        empty = [t for t in self.targets if not t.strip()]
        if empty:
            raise ValueError(f"lora.targets: an empty module name in {list(self.targets)}")

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """The settings ``--lora r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj`` gives, by name:
        comma-separated ``key=value`` pairs, where names after ``targets=`` without an ``=`` of their own
        are more targets; an empty text gives none (the defaults)."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        key = None
        for item in (i.strip() for i in text.split(",") if i.strip()):
            if "=" not in item:
                if key != "targets":
                    raise ValueError(f"--lora: {item!r} is not key=value (the settings are "
                                     f"{', '.join(hints)}; e.g. --lora r=16,alpha=32,targets=q_proj,v_proj)")
                values["targets"] += (item,)
                continue
            key, value = (s.strip() for s in item.split("=", 1))
            if key not in hints:
                raise ValueError(f"--lora: {key!r} is not a LoRA setting; they are {', '.join(hints)}")
            values[key] = _parsed(key, value, hints[key])
        return values


def _parsed(key: str, value: str, hint: Any) -> Any:
    """A ``--lora`` value as its field's type: an int, a float, a bool (true/false) or a tuple of names."""
    try:
        if hint is int:
            return int(value)
        if hint is float:
            return float(value)
    except ValueError:
        raise ValueError(f"--lora: {key}={value!r} is not {'an integer' if hint is int else 'a number'}") from None
    if hint is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"--lora: {key}={value!r} is not true or false")
        return value.lower() in ("true", "1", "yes")
    return (value,) if value else ()


@dataclass
class ValSettings:
    """Validation during training (the ``[val]`` table; ``--val path=DIR,every=50`` on the command line):
    the evaluation loss (mean next-token cross-entropy over the validation tokens that count) every
    ``every`` steps and at the end, in the log, the progress line, ``metrics.jsonl`` (``val_loss``),
    the loss plot and the result. The validation set is the prepared corpus ``path``, or, with
    ``fraction``, the last ``fraction`` of each training source, held out of training. At most
    ``samples`` sequences are evaluated, in order, split over the data-parallel processes."""

    path: Optional[str] = None  # a prepared corpus; None: hold out `fraction` of the training data
    fraction: float = 0.0
    every: int = 100
    samples: int = 64

    def check(self) -> None:
        check_types(self, "val")
        if self.path is None and not 0.0 < self.fraction < 1.0:
            raise ValueError(f"val: give a prepared corpus (val.path) or a held-out fraction in (0, 1) (val.fraction), "
                             f"got path={self.path!r}, fraction={self.fraction}")
        if self.path is not None and self.fraction:
            raise ValueError("val: give val.path or val.fraction, not both")
        for name in ("every", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"val.{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class TrainConfig:
    """What to train on and how. Batch sizes count sequences of ``seq_len`` tokens."""

    # data: text files, or prepared corpora (zoo data prepare) as paths or {path, weight} tables (a mixture);
    # empty: the built-in corpus (Python stdlib sources)
    data: tuple[Union[str, dict], ...] = ()
    packing: str = "documents"  # prepared corpora: documents (positions and attention per document) or plain
    sft: bool = False  # supervised fine-tuning: whole conversations, loss on the assistant's tokens only
    tokenizer: Optional[str] = None  # a tokenizer.json or a checkpoint directory; None: bytes (or init_from's)
    seq_len: int = 256
    # batch: global_batch = processes x micro_batch x grad_accum (grad_accum derived when None)
    global_batch: int = 32
    micro_batch: int = 8
    grad_accum: Optional[int] = None
    # start from trained weights: an HF checkpoint directory, hub id or GGUF file, read by zoo.from_pretrained
    init_from: Optional[str] = None
    # optimisation
    steps: int = 1000
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    z_loss: Optional[float] = None  # None: the spec's coefficient
    seed: int = 0
    # hardware
    mixed_precision: str = "auto"  # auto: the accelerate config's, else bf16 on CUDA with bf16, else fp32; no, bf16, fp16
    fsdp: Optional[bool] = None  # None: FSDP2 when the accelerate launch config asks for FSDP
    cpu: bool = False  # train on the CPU even when a GPU is present
    # output
    out_dir: str = "runs/zoo"
    save_every: int = 100  # steps between checkpoints (and one at the end); 0: only at the end
    keep_last: int = 2  # checkpoints kept
    resume: Optional[str] = "auto"  # auto: latest checkpoint in out_dir; a path; None: start fresh
    stop_after: Optional[int] = None  # stop (and checkpoint) after this many steps in this invocation
    log_every: int = 10
    progress: bool = True
    plot: bool = True
    export: bool = True  # write the trained weights with zoo.save_pretrained to out_dir/final
    export_format: Optional[str] = None  # HF model_type to export as; None: the first that fits the spec
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # a dict is read as its fields
    lora: Optional[LoraSettings] = None  # LoRA fine-tuning (a dict is read as its fields); None: every weight trains
    val: Optional[ValSettings] = None  # validation during training (a dict is read as its fields)

    def __post_init__(self):
        self.parallel = _section(ParallelConfig, self.parallel, "parallel")
        self.lora = _section(LoraSettings, self.lora, "lora")
        self.val = _section(ValSettings, self.val, "val")
        if isinstance(self.data, (list, str)):
            self.data = (self.data,) if isinstance(self.data, str) else tuple(self.data)

    @classmethod
    def from_toml(cls, path: str | Path, **fields: Any) -> "TrainConfig":
        """A config from a TOML file of TrainConfig fields, with ``[parallel]`` and ``[lora]`` tables; ``fields`` override it."""
        import tomllib

        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"{path}: {key!r} is not a TrainConfig field; they are {sorted(known)}")
        if "data" in data:
            data["data"] = tuple(data["data"])
        return cls(**{**data, **fields})

    def check(self) -> None:
        check_types(self)
        self.parallel.check()
        if self.lora is not None:
            self.lora.check()
        if self.val is not None:
            self.val.check()
        if self.packing not in ("documents", "plain"):
            raise ValueError(f"TrainConfig.packing must be 'documents' or 'plain', got {self.packing!r}")
        for i, entry in enumerate(self.data):
            if isinstance(entry, dict):
                unknown = sorted(set(entry) - {"path", "weight"})
                if unknown or not isinstance(entry.get("path"), (str, os.PathLike)):
                    raise ValueError(f"data[{i}]: a data source is a path or {{path, weight}}, got {entry!r}")
                w = entry.get("weight", 1.0)
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w > 0):
                    raise ValueError(f"data[{i}].weight must be a positive number, got {w!r}")
        for f in dataclasses.fields(self):  # NaN passes every comparison below: refuse it first
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"TrainConfig.{f.name} must be a finite number, got {value}")
        for name in ("seq_len", "global_batch", "micro_batch", "steps", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "weight_decay", "grad_clip", "lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise ValueError(f"TrainConfig.grad_accum must be at least 1, got {self.grad_accum}")
        if not 0 <= self.seed < 2 ** 63:  # torch.manual_seed's range
            raise ValueError(f"TrainConfig.seed must be in [0, 2**63), got {self.seed}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"TrainConfig.mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")

    def accumulation(self, processes: int) -> int:
        """Micro-batches per process per optimizer step; raises when the batch sizes do not divide."""
        per_step = processes * self.micro_batch
        if self.global_batch % per_step:
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by processes ({processes}) x micro_batch "
                f"({self.micro_batch}) = {per_step}; choose a global batch that is a multiple of {per_step} "
                "or another micro_batch"
            )
        accum = self.global_batch // per_step
        if self.grad_accum is not None and self.grad_accum != accum:
            raise ValueError(
                f"global_batch {self.global_batch} != processes ({processes}) x micro_batch ({self.micro_batch}) "
                f"x grad_accum ({self.grad_accum}) = {per_step * self.grad_accum}; fix one of them or leave "
                "grad_accum unset to derive it"
            )
        return accum


@dataclass
class TrainResult:
    step: int
    losses: list[float]  # loss (cross-entropy + z-loss + weighted auxiliary losses) of each step run in this invocation
    ce: list[float]
    z: list[float]  # mean log(Z)^2 of each step
    out_dir: Path
    checkpoint: Optional[Path] = None
    export: Optional[Path] = None
    adapter: Optional[Path] = None  # a LoRA run's PEFT adapter directory
    plot: Optional[Path] = None
    tokens_per_s: float = 0.0
    main_process: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # Every term the loss output carried (loss, ce, z, each auxiliary loss and metric), per step.
    terms: list[dict[str, float]] = field(default_factory=list)
    # The validation loss ({step, val_loss}) at each evaluation of this invocation (with config.val; a
    # fresh run's first is at step 0, before training).
    val: list[dict[str, float]] = field(default_factory=list)
