"""RoPE frequency scalings for longer contexts.

Each is built as ``cls(config, dim=rotary_dim, theta=base)`` and answers
``frequencies(seq_len) -> (inv_freq, attention_factor)``: the per-pair inverse frequencies in
fp32 and a factor applied to cos and sin (YaRN's temperature; 1 otherwise).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zoo.core.kinds import RopeScaling
from zoo.core.registry import register
from zoo.core.spec import SpecError


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2i/dim)`` for i in [0, dim/2), in fp32 (as the reference computes it)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _factor_check(cfg):
    if cfg.factor < 1.0:
        raise SpecError("factor", f"must be >= 1, got {cfg.factor}")


class _Scaling(RopeScaling):
    def __init__(self, cfg, *, dim: int, theta: float):
        super().__init__()
        self.cfg, self.dim, self.theta = cfg, dim, theta

    def frequencies(self, seq_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
        raise NotImplementedError


@register("rope_scaling", "linear")
class Linear(_Scaling):
    """Position interpolation: every position divided by ``factor``."""

    @dataclass(frozen=True)
    class Config:
        factor: float = 1.0
        check = _factor_check

    def frequencies(self, seq_len=None):
        return default_inv_freq(self.dim, self.theta) / self.cfg.factor, 1.0


@register("rope_scaling", "ntk")
class NTKAware(_Scaling):
    """NTK-aware scaling: the base grows to ``theta * factor^(dim / (dim - 2))``, so high
    frequencies are kept and low ones interpolated."""

    @dataclass(frozen=True)
    class Config:
        factor: float = 1.0
        check = _factor_check

    def frequencies(self, seq_len=None):
        base = self.theta * self.cfg.factor ** (self.dim / (self.dim - 2))
        return default_inv_freq(self.dim, base), 1.0


@register("rope_scaling", "dynamic_ntk")
class DynamicNTK(_Scaling):
    """NTK-aware scaling applied only once the sequence outgrows the original context, by how much it does."""

    dynamic = True

    @dataclass(frozen=True)
    class Config:
        factor: float = 1.0
        original_max_seq_len: int = 2048
        check = _factor_check

    def frequencies(self, seq_len=None):
        orig = self.cfg.original_max_seq_len
        base = self.theta
        if seq_len is not None and seq_len > orig:
            f = self.cfg.factor
            base = base * ((f * seq_len / orig) - (f - 1)) ** (self.dim / (self.dim - 2))
        return default_inv_freq(self.dim, base), 1.0


@register("rope_scaling", "yarn")
class YaRN(_Scaling):
    """YaRN: interpolate low frequencies, keep high ones, ramp between (beta_fast..beta_slow
    rotations over the original context), and scale attention by ``0.1 ln(factor) + 1``."""

    @dataclass(frozen=True)
    class Config:
        factor: float = 1.0
        original_max_seq_len: int = 4096
        beta_fast: float = 32.0
        beta_slow: float = 1.0
        attention_factor: Optional[float] = None
        mscale: Optional[float] = None
        mscale_all_dim: Optional[float] = None
        truncate: bool = True
        check = _factor_check

    @staticmethod
    def _mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    @classmethod
    def softmax_factor(cls, cfg) -> float:
        """DeepSeek's change to the softmax scale: ``mscale(factor, mscale_all_dim)^2`` (1 when
        ``mscale_all_dim`` is unset). Its attention (MLA) multiplies ``head_dim^-0.5`` by it; cos and
        sin carry ``mscale / mscale_all_dim`` besides (the attention factor of :meth:`frequencies`)."""
        return cls._mscale(cfg.factor, cfg.mscale_all_dim) ** 2 if cfg.mscale_all_dim else 1.0

    def frequencies(self, seq_len=None):
        c, dim, base = self.cfg, self.dim, self.theta
        factor = c.factor
        attention_factor = c.attention_factor
        if c.mscale and c.mscale_all_dim:
            attention_factor = self._mscale(factor, c.mscale) / self._mscale(factor, c.mscale_all_dim)
        if attention_factor is None:
            attention_factor = self._mscale(factor)

        def correction_dim(rotations):
            return (dim * math.log(c.original_max_seq_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(c.beta_fast), correction_dim(c.beta_slow)
        if c.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - ramp  # 1 where frequencies are kept (high frequency), 0 where interpolated
        return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


@register("rope_scaling", "llama3")
class Llama3(_Scaling):
    """Llama 3.1's scaling: wavelengths longer than original/low_freq_factor are divided by
    ``factor``, shorter than original/high_freq_factor kept, and smoothly blended between."""

    @dataclass(frozen=True)
    class Config:
        factor: float = 8.0
        low_freq_factor: float = 1.0
        high_freq_factor: float = 4.0
        original_max_seq_len: int = 8192
        check = _factor_check

    def frequencies(self, seq_len=None):
        c = self.cfg
        inv_freq = default_inv_freq(self.dim, self.theta)
        low_wavelen = c.original_max_seq_len / c.low_freq_factor
        high_wavelen = c.original_max_seq_len / c.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / c.factor, inv_freq)
        smooth = (c.original_max_seq_len / wavelen - c.low_freq_factor) / (c.high_freq_factor - c.low_freq_factor)
        smoothed = (1 - smooth) * scaled / c.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
