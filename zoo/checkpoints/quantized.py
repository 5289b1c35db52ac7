"""Quantized checkpoints: block-scaled FP8 weights (DeepSeek-V3's layout), dequantised on load.

A checkpoint whose ``config.json`` carries ``quantization_config`` with ``quant_method: "fp8"``
stores some weights as ``float8_e4m3fn`` beside a float scale ``<name>_scale_inv`` with one entry
per ``weight_block_size`` block (128 x 128 by default) of the weight's last two dimensions.
Blocks start at index 0; where a dimension is not a multiple of the block, its last block is
partial and still has its own scale, so the scale grid is ``ceil(rows / b0) x ceil(cols / b1)``.
The real weight is ``w[..., i, j] = q[..., i, j] * scale[..., i // b0, j // b1]``, computed in
float32 and rounded once to the dtype asked for (DeepSeek-V3's ``weight_dequant`` and
transformers' ``FP8Linear`` read it so).

zoo reads such checkpoints for any format, tensor by tensor: each weight that has a scale is
dequantised as it is read, so memory holds the model in the loaded dtype plus one tensor in
flight. The model is an ordinary full-precision model; saving it writes that dtype and no
``quantization_config``. Every other quantization method is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from zoo.checkpoints.format import CheckpointError, ConfigError, is_kind

SCALE_SUFFIX = "_scale_inv"
FIELD = "quantization_config"


@dataclass(frozen=True)
class BlockFP8:
    """The one quantization zoo reads: float8_e4m3fn weights with float scales per ``block``."""

    block: tuple[int, int] = (128, 128)

    def reading(self, files, dtype: Optional[torch.dtype]) -> "DequantizedFiles":
        return DequantizedFiles(files, self, dtype)


def read_quantization(config: dict[str, Any], source: Optional[str | Path] = None) -> Optional[BlockFP8]:
    """The quantization ``config`` declares (None when it declares none). A method zoo cannot read,
    or an fp8 setting it cannot follow, is a :class:`ConfigError` naming the field, the value and
    ``source`` (the config's file, where known)."""
    if FIELD not in config or config[FIELD] is None:
        return None
    q = config[FIELD]

    def error(key: str, message: str) -> ConfigError:
        return ConfigError(f"{FIELD}.{key}" if key else FIELD, f"{message} (in {source})" if source else message)

    if not isinstance(q, dict):
        raise error("", f"must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise error("quant_method", (
            f"{method!r} quantization is not supported: zoo reads unquantized weights and block-scaled fp8 "
            "(quant_method 'fp8', as DeepSeek-V3 ships). Dequantize the checkpoint with a library that "
            f"reads {method} and save it unquantized" if method is not None else
            "is missing, so zoo cannot tell how the weights are quantized"))
    # fmt and expert_dtype decide how the stored numbers read; static activations come with
    # activation_scale tensors that a dequantised model has no place for. The other fields
    # (dequantize, modules_to_not_convert, ...) change nothing once the weights are dequantised:
    # zoo dequantises exactly the tensors that have a scale.
    for key, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("expert_dtype", ("fp8",)),
                         ("scale_fmt", ("float", "ue8m0"))):
        value = q.get(key, allowed[0])
        if value not in allowed:
            raise error(key, f"{value!r} is not supported; zoo reads fp8 checkpoints with {key} "
                             f"{' or '.join(map(repr, allowed))}")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(is_kind(b, int) and b > 0 for b in block)):
        raise error("weight_block_size", f"must be two positive integers (rows, columns), got {block!r}; "
                                         "zoo reads block-scaled fp8 only, not per-tensor scales")
    return BlockFP8(tuple(block))


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without its quantization_config, once :func:`read_quantization` has accepted it: the
    architecture is the unquantized model's."""
    return {k: v for k, v in config.items() if k != FIELD} if FIELD in config else config


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """``weight[..., i, j] * scale[..., i // b0, j // b1]`` in float32, rounded to ``dtype``.

    The scales are widened over rows only (a ``rows x ceil(cols / b1)`` tensor) and applied to the
    column blocks through a view, so the one full-size temporary is the float32 weight itself.
    """
    b0, b1 = block
    rows, cols = weight.shape[-2:]
    out = weight.to(torch.float32)
    per_row = scale.to(torch.float32).repeat_interleave(b0, dim=-2)[..., :rows, :]
    whole = cols // b1
    out[..., : whole * b1].unflatten(-1, (whole, b1)).mul_(per_row[..., :whole, None])
    out[..., whole * b1:].mul_(per_row[..., whole:])  # the partial last block (empty if none)
    return out.to(dtype)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of ``shape``: one entry per (possibly partial) block."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class DequantizedFiles:
    """A checkpoint's :class:`~zoo.checkpoints.io.WeightFiles` as the model sees them: each fp8
    weight and its ``<name>_scale_inv`` are one tensor of the loaded dtype, dequantised when read.

    Every pairing is checked from the headers before anything is read, each an error naming the
    tensor: a scale without its weight, an fp8 weight without its scale, a scale beside a weight
    that is not float8_e4m3fn, a scale that is not floating-point, and a scale grid that does not
    match the weight's blocks.
    """

    def __init__(self, files, quant: BlockFP8, dtype: Optional[torch.dtype]):
        self.files, self.block = files, quant.block
        self.directory, self.where = files.directory, files.where
        names = files.names()
        self.scale_of = {n[: -len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}
        for weight, scale in self.scale_of.items():
            self._check_pair(weight, scale)
        self._check_block()
        for name in names:
            if files.dtype(name) in FP8 and name not in self.scale_of:
                raise CheckpointError(
                    f"{files.where[name]}: tensor {name!r} is {files.dtype(name)} but has no scale "
                    f"{name + SCALE_SUFFIX!r}, so its values cannot be known; the checkpoint is incomplete")
        scales = set(self.scale_of.values())
        plain = [files.dtype(n) for n in names if n not in scales and n not in self.scale_of
                 and files.dtype(n).is_floating_point]
        # Without dtype=, dequantised weights take the dtype the checkpoint's other weights are stored in.
        self.target = dtype or (plain[0] if plain else torch.float32)
        self._names = [n for n in names if n not in scales]

    def _check_pair(self, weight: str, scale: str) -> None:
        files = self.files
        where = files.where[scale]
        if weight not in files.where:
            raise CheckpointError(f"{where}: scale {scale!r} has no weight {weight!r} in the checkpoint; "
                                  "the checkpoint is incomplete")
        if files.dtype(weight) != torch.float8_e4m3fn:
            raise CheckpointError(
                f"{files.where[weight]}: tensor {weight!r} has the scale {scale!r} but is stored as "
                f"{files.dtype(weight)}, not float8_e4m3fn; the checkpoint does not match its quantization_config")
        if not files.dtype(scale).is_floating_point or files.dtype(scale) in FP8:
            raise CheckpointError(f"{where}: scale {scale!r} is {files.dtype(scale)}; zoo reads float32, bfloat16 "
                                  "or float16 scales")
        shape, want = files.shape(weight), None
        if len(shape) >= 2:
            want = scale_shape(shape, self.block)
        if want is None or files.shape(scale) != want:
            raise CheckpointError(
                f"{where}: scale {scale!r} has shape {files.shape(scale)}, but weight {weight!r} of shape "
                f"{shape} in {self.block[0]}x{self.block[1]} blocks (weight_block_size) needs "
                + (f"{want}" if want else "a weight of at least two dimensions")
                + "; the scales do not belong to this weight or the block size is wrong")

    def _check_block(self) -> None:
        """A block larger than every quantized weight (``[1e9, 1e9]``) matches any one-entry scale
        grid, yet would widen each scale to the block's size: the config does not describe these weights."""
        shapes = {w: self.files.shape(w)[-2:] for w in self.scale_of}
        for axis, what in enumerate(("rows", "columns")):
            if not shapes:
                return
            largest = max(shapes, key=lambda w: shapes[w][axis])
            if self.block[axis] > shapes[largest][axis]:
                raise CheckpointError(
                    f"{self.files.where[largest]}: quantization_config.weight_block_size {list(self.block)} has blocks of "
                    f"{self.block[axis]} {what}, more than the largest quantized weight has ({largest!r}, "
                    f"{shapes[largest][axis]}); the block size must be at most the weights' size")

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.target if name in self.scale_of else self.files.dtype(name)

    def get(self, name: str, *, mapped: bool = False) -> torch.Tensor:
        if name not in self.scale_of:
            return self.files.get(name, mapped=mapped)
        scale = self.files.get(self.scale_of[name])
        bad = ~torch.isfinite(scale) | (scale < 0)
        if bad.any():
            value = scale[bad][0].item()
            raise CheckpointError(
                f"{self.files.where[self.scale_of[name]]}: scale {self.scale_of[name]!r} holds {value} ({int(bad.sum())} "
                "entries NaN, infinite or negative): a block scale is a finite number >= 0, so the weight "
                f"{name!r} cannot be read; the checkpoint is corrupt")
        return dequantize_blocks(self.files.get(name), scale, self.block, self.target)
