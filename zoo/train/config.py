"""What to train on and how (TrainConfig), and what a run returns (TrainResult)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class TrainConfig:
    """What to train on and how. Batch sizes count sequences of ``seq_len`` tokens."""

    # data
    data: tuple[str, ...] = ()  # text files; empty: the built-in corpus (Python stdlib sources)
    tokenizer: Optional[str] = None  # a tokenizer.json or a checkpoint directory; None: bytes (or init_from's)
    seq_len: int = 256
    # batch: global_batch = processes x micro_batch x grad_accum (grad_accum derived when None)
    global_batch: int = 32
    micro_batch: int = 8
    grad_accum: Optional[int] = None
    # start from trained weights: an HF checkpoint directory or hub id, read by zoo.from_pretrained
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
    save_every: int = 0  # steps between checkpoints; 0: only at the end
    keep_last: int = 2  # checkpoints kept
    resume: Optional[str] = "auto"  # auto: latest checkpoint in out_dir; a path; None: start fresh
    stop_after: Optional[int] = None  # stop (and checkpoint) after this many steps in this invocation
    log_every: int = 10
    progress: bool = True
    plot: bool = True
    export: bool = True  # write the trained weights with zoo.save_pretrained to out_dir/final
    export_format: Optional[str] = None  # HF model_type to export as; None: the first that fits the spec

    def check(self) -> None:
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
    plot: Optional[Path] = None
    tokens_per_s: float = 0.0
    main_process: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # Every term the loss output carried (loss, ce, z, each auxiliary loss and metric), per step.
    terms: list[dict[str, float]] = field(default_factory=list)
