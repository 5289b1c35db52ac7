"""Normalisation layers: LayerNorm (with or without bias) and RMSNorm (incl. Gemma's ``1 + w``)."""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kernels
from zoo.core.kinds import Norm
from zoo.core.registry import register
from zoo.core.spec import positive


def _row_problem(dim: int):
    """Why a fused norm kernel cannot take rows of ``dim`` features (one row is one block)."""
    return f"rows of {dim} features exceed the kernel's 65536" if dim > 65536 else None


@register("norm", "layernorm")
class LayerNorm(Norm):
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last dimension."""

    kernel: ClassVar[str] = "layernorm"
    backends: ClassVar[tuple] = ("triton", "torch")
    kernel_on_shards: ClassVar[str] = "rows"  # under sequence parallelism: each process's rows

    @dataclass(frozen=True)
    class Config:
        eps: float = 1e-5
        bias: bool = True

        def check(self):
            positive("eps", self.eps, allow_none=False)

    def __init__(self, cfg: Config, *, dim: int):
        super().__init__()
        self.cfg, self.dim = cfg, dim
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if cfg.bias else None

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        fast = kernels.fast(self, x)
        if fast is not None:
            return fast(self, x)
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.cfg.eps)

    def kernel_problem(self, backend, x=None, forced=False):
        return _row_problem(self.dim)

    # -- what this part states about itself ---------------------------------------------------------
    #: Tensor parallelism: its weights replicated, applied to the slice it is given
    #: (:func:`zoo.core.parallel.replicated_norm`).
    tp_plan = {"": "replicated"}

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Its input and the float32 mean and reciprocal deviation per row, on its slice of rows."""
        return (self.dim * dtype.itemsize + 8) / tp


@register("norm", "rmsnorm")
class RMSNorm(Norm):
    """``x / sqrt(mean(x^2) + eps) * w``, computed in fp32.

    ``unit_offset``: scale by ``1 + w`` with ``w`` initialised at 0 (Gemma).
    ``scale_in_fp32``: multiply by the weight before casting back (Gemma, OLMo 2) rather than after (Llama).
    """

    kernel: ClassVar[str] = "rmsnorm"
    kernel_on_shards: ClassVar[str] = "rows"  # under sequence parallelism: each process's rows
    backends: ClassVar[tuple] = ("triton", "torch")

    @dataclass(frozen=True)
    class Config:
        eps: float = 1e-6
        unit_offset: bool = False
        scale_in_fp32: bool = False

        def check(self):
            positive("eps", self.eps, allow_none=False)

    def __init__(self, cfg: Config, *, dim: int):
        super().__init__()
        self.cfg, self.dim = cfg, dim
        self.weight = nn.Parameter(torch.zeros(dim) if cfg.unit_offset else torch.ones(dim))

    def reset_parameters(self):
        (nn.init.zeros_ if self.cfg.unit_offset else nn.init.ones_)(self.weight)

    def forward(self, x):
        fast = kernels.fast(self, x)
        if fast is not None:
            return fast(self, x)
        dtype = x.dtype
        h = F.rms_norm(x.float(), (self.dim,), eps=self.cfg.eps)  # x / sqrt(mean(x^2) + eps), one fused pass
        w = self.weight
        if self.cfg.unit_offset:
            w = 1.0 + w.float()
        if self.cfg.scale_in_fp32:
            return (h * w.float()).to(dtype)
        return w * h.to(dtype)

    def kernel_problem(self, backend, x=None, forced=False):
        return _row_problem(self.dim)

    # -- what this part states about itself ---------------------------------------------------------
    #: Tensor parallelism: its weights replicated, applied to the slice it is given
    #: (:func:`zoo.core.parallel.replicated_norm`).
    tp_plan = {"": "replicated"}

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per row, on its slice of rows: the fused kernel (CUDA) keeps its input and the float32
        reciprocal RMS; the reference keeps the input in float32, the reciprocal RMS and the normalised
        row the weight multiplies (float32 when scaled in float32, else in ``dtype``)."""
        if device == "cuda":
            return (self.dim * dtype.itemsize + 4) / tp
        normed = 4 if self.cfg.scale_in_fp32 else dtype.itemsize
        return (self.dim * (4 + normed) + 4) / tp
