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

``from_pretrained(..., fp8="keep")`` keeps them as stored instead: each ``nn.Linear`` whose weight
is one stored tensor with a scale becomes an :class:`FP8Linear` holding the float8 weight and its
scales, and each MoE's routed experts (one stored tensor per expert and projection, stacked) become
:class:`FP8Experts`, the float8 stacks beside their stacked scales. Each product (:func:`fp8_linear`)
goes through block-scaled ``scaled_mm`` on a GPU that has it (compute capability 9.x, 128 x 128
blocks) and otherwise dequantises the one weight it needs for that product, so the model's memory
stays near its FP8 size. Saving writes the float8 weights, their scales and the
``quantization_config`` back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import functools
import warnings
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.checkpoints.hf.format import CheckpointError, ConfigError, is_kind
from zoo.components.ffn.moe import GroupedExperts

SCALE_SUFFIX = "_scale_inv"
FIELD = "quantization_config"


@dataclass(frozen=True)
class BlockFP8:
    """The one quantization zoo reads: float8_e4m3fn weights with float scales per ``block``."""

    block: tuple[int, int] = (128, 128)

    def reading(self, files, dtype: Optional[torch.dtype], keep: Iterable[str] = ()) -> "DequantizedFiles":
        return DequantizedFiles(files, self, dtype, keep)


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
    """A checkpoint's :class:`~zoo.checkpoints.files.io.WeightFiles` as the model sees them: each fp8
    weight and its ``<name>_scale_inv`` are one tensor of the loaded dtype, dequantised when read.

    Every pairing is checked from the headers before anything is read, each an error naming the
    tensor: a scale without its weight, an fp8 weight without its scale, a scale beside a weight
    that is not float8_e4m3fn, a scale that is not floating-point, and a scale grid that does not
    match the weight's blocks.

    The weights named in ``keep`` (stored names) are given as stored, float8 beside their scales,
    which are then tensors of their own (for :class:`FP8Linear`); their scales are checked as read.
    """

    def __init__(self, files, quant: BlockFP8, dtype: Optional[torch.dtype], keep: Iterable[str] = ()):
        self.files, self.block, self.quant, self.keep = files, quant.block, quant, set(keep)
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
        kept_scales = {self.scale_of[w] for w in self.keep}
        self._names = [n for n in names if n not in scales or n in kept_scales]

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
        return self.target if name in self.scale_of and name not in self.keep else self.files.dtype(name)

    def get(self, name: str, *, mapped: bool = False) -> torch.Tensor:
        if name in self.keep:  # as stored; its scale's values are checked when the scale is read
            return self.files.get(name, mapped=mapped)
        if name not in self.scale_of:
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self.keep:
                return self._scale(name[: -len(SCALE_SUFFIX)])
            return self.files.get(name, mapped=mapped)
        return dequantize_blocks(self.files.get(name), self._scale(name), self.block, self.target)

    def _scale(self, name: str) -> torch.Tensor:
        """The scale of weight ``name``, refused by name when an entry is NaN, infinite or negative."""
        scale = self.files.get(self.scale_of[name])
        bad = ~torch.isfinite(scale) | (scale < 0)
        if bad.any():
            value = scale[bad][0].item()
            raise CheckpointError(
                f"{self.files.where[self.scale_of[name]]}: scale {self.scale_of[name]!r} holds {value} ({int(bad.sum())} "
                "entries NaN, infinite or negative): a block scale is a finite number >= 0, so the weight "
                f"{name!r} cannot be read; the checkpoint is corrupt")
        return scale


# -- FP8 kept as FP8 -------------------------------------------------------------------------------

_said: set[str] = set()


def _once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, stacklevel=3)


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``device`` has block-scaled fp8 ``scaled_mm`` (1 x 128 activations, 128 x 128 weights):
    cuBLAS offers it on compute capability 9.x (H100, H200); Ada (8.9) has fp8 products with per-tensor
    or per-row scales only, and Blackwell's block-scaled formats are others."""
    return (device.type == "cuda" and hasattr(F, "scaled_mm")
            and torch.cuda.get_device_capability(device)[0] == 9)


def quantize_activations(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) as float8_e4m3fn with one float32 scale per ``group`` columns of a row (amax / 448,
    DeepSeek-V3's ``act_quant``): ``x ~ q * scale`` per group. K must be a multiple of ``group``."""
    g = x.float().unflatten(-1, (-1, group))
    scale = g.abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (g / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2), scale


_checked: dict[torch.device, bool] = {}  # device -> whether scaled_mm passed its first check there


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T + bias`` for the block-scaled float8 ``weight`` (out x in) and its ``scale`` grid, in ``dtype``.

    Block-scaled ``scaled_mm`` where :func:`scaled_mm_supported` says the device has it and the shapes
    fit its 128 x 128 blocks: the input is quantised per 1 x 128 group as DeepSeek-V3's own inference
    does, so the result is close to, not equal to, the dequantised product. The first such product on
    a device is checked against the dequantised one; if it fails or differs, a message says so once
    and the dequantised path is used from then on. Everywhere else the weight is dequantised for this
    one product (in float32, rounded once to ``dtype``, as a dequantising load does), so the result
    equals the dequantised model's exactly.
    """
    if _fits_scaled_mm(x, weight, block):
        ok = _checked.get(x.device)
        if ok is None:
            ok = _checked[x.device] = _check_scaled_mm(x, weight, scale, block, bias)
        if ok:
            return _scaled_mm(x, weight, scale, bias)
    return F.linear(x, dequantize_blocks(weight, scale, block, dtype), bias)


def _fits_scaled_mm(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    out_features, in_features = weight.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and block == (128, 128)
            and in_features % 128 == 0 and out_features % 128 == 0 and scaled_mm_supported(x.device))


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """cuBLAS's layout: activation scales token-major with the token count a multiple of 4 (x is
    zero-padded), the weight column-major and its scales' K blocks padded to a multiple of 4."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    M = rows.shape[0]
    q, act_scale = quantize_activations(F.pad(rows, (0, 0, 0, -M % 4)))
    s = scale.float()
    s = F.pad(s, (0, -s.shape[1] % 4))
    out = F.scaled_mm(q, weight.t(), act_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                      s.t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:M]
    out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], out_features)


def _check_scaled_mm(x, weight, scale, block, bias) -> bool:
    """The first block-scaled product on a device against the dequantised one: within what
    quantising the input to e4m3 makes of it (2^-4 per element; 0.1 of the norm is far beyond)."""
    want = F.linear(x, dequantize_blocks(weight, scale, block, x.dtype), bias).float()
    try:
        got = _scaled_mm(x, weight, scale, bias).float()
    except RuntimeError as exc:
        _once(f"fp8: block-scaled scaled_mm failed on {x.device} ({exc}); dequantising each weight "
              "for its product instead")
        return False
    err = float((got - want).norm() / want.norm().clamp(min=1e-30))
    if not err < 0.1:
        _once(f"fp8: block-scaled scaled_mm on {x.device} is {err:.3g} of the norm from the dequantised "
              "product; dequantising each weight for its product instead")
        return False
    return True


class _StaysFP8(nn.Module):
    """``.to(device)`` moves the float8 weights and their scales; ``.to(dtype)`` changes only the dtype
    the module computes in (``compute_dtype``) and its other tensors: the stored numbers stay as they
    are, and are never converted on the way (a layer's experts in bf16 would be a 22 GB temporary)."""

    compute_dtype: torch.dtype

    def _apply(self, fn, recurse=True):
        kept = {n: p for n, p in self._parameters.items() if p is not None and p.dtype in FP8}
        scales = {n: b for n, b in self._buffers.items() if n.endswith(SCALE_SUFFIX)}
        for n in kept:
            self._parameters[n] = None
        for n in scales:
            self._buffers[n] = None
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters.update(kept)
            self._buffers.update(scales)
        # What fn asks for, seen on an empty tensor of each kind: the device to move to, the dtype to compute in.
        for n, p in kept.items():
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if probe.dtype != p.dtype:
                self.compute_dtype = probe.dtype
            p.data = p.data.to(probe.device)
        for n, b in scales.items():
            self._buffers[n] = b.to(fn(torch.empty(0, dtype=b.dtype, device=b.device)).device)
        return self


class FP8Linear(_StaysFP8):
    """An ``nn.Linear`` whose weight stays float8_e4m3fn with one float scale per ``block`` block
    (``weight_scale_inv``, as stored in the checkpoint); ``dtype`` is the dtype it computes and
    returns in (the model's). For inference: the weight has no gradient. Its product is
    :func:`fp8_linear`: block-scaled ``scaled_mm`` on a GPU that has it, else the weight dequantised
    for the one product (equal to the dequantised model's).
    """

    _checked = _checked  # device -> whether scaled_mm passed its first check there (shared with every FP8 product)

    def __init__(self, in_features: int, out_features: int, *, bias: bool, block: tuple[int, int],
                 dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.block, self.compute_dtype = in_features, out_features, block, dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        grid = scale_shape((out_features, in_features), block)
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=scale_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}, dtype={self.compute_dtype}")

    def dense_weight(self) -> torch.Tensor:
        """The full-precision weight (``dtype``), built for the caller and not kept."""
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.compute_dtype, self.bias)


class FP8Experts(_StaysFP8, GroupedExperts):
    """The routed experts of an MoE (:class:`~zoo.components.ffn.moe.GroupedExperts`) kept as stored:
    ``w_gate``, ``w_up``, ``w_down`` are the float8 stacks (one expert per index of dim 0) beside their
    stacked block scales ``w_gate_scale_inv``, ... (E x row blocks x column blocks). For inference: the
    weights have no gradient.

    The forward runs expert by expert (``dispatch`` is not consulted: a grouped matmul needs the whole
    layer's experts in full precision at once, 22 GB in bf16 for a DeepSeek-V3 layer). Each expert that
    has tokens multiplies through :func:`fp8_linear`, so at most one expert's matrix is dequantised at a
    time and an expert with no tokens costs nothing; on the CPU the result equals the dequantised
    model's. The loop reads the token counts on the host once per layer.
    """

    def __init__(self, like: GroupedExperts, *, block: tuple[int, int], dtype: torch.dtype,
                 scale_dtype: torch.dtype = torch.float32, device=None):
        nn.Module.__init__(self)
        self.gated, self.act, self.dispatch, self.d_model, self.d_ff = like.gated, like.act, like.dispatch, like.d_model, like.d_ff
        self.block, self.compute_dtype = block, dtype
        for name in self.projections():
            shape = getattr(like, name).shape
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                                             requires_grad=False))
            self.register_buffer(name + SCALE_SUFFIX, torch.empty(scale_shape(shape, block), dtype=scale_dtype, device=device))
        if not self.gated:
            self.w_gate = None

    def projections(self) -> tuple[str, ...]:
        return ("w_gate", "w_up", "w_down") if self.gated else ("w_up", "w_down")

    def extra_repr(self) -> str:
        return f"n_experts={self.w_up.shape[0]}, block={self.block}, dtype={self.compute_dtype}"

    def reset_parameters(self, generator=None, std: float = 0.02) -> None:
        """Nothing to draw: the weights are the checkpoint's."""

    def dense_weight(self, name: str) -> torch.Tensor:
        """Projection ``name``'s whole stack in full precision (``dtype``), built for the caller and not kept."""
        return dequantize_blocks(getattr(self, name), getattr(self, name + SCALE_SUFFIX), self.block, self.compute_dtype)

    def choose_path(self, device, dtype) -> tuple[str, str]:
        return "loop", "float8 experts kept as stored: expert by expert, one expert's matrix dequantised at a time"

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        def linear(x, name, e):
            return fp8_linear(x, getattr(self, name)[e], getattr(self, name + SCALE_SUFFIX)[e], self.block,
                              self.compute_dtype)

        outs = []
        for e, chunk in enumerate(torch.split(xs, counts.tolist())):
            if chunk.shape[0] == 0:
                continue
            h = linear(chunk, "w_up", e)
            h = self.act(linear(chunk, "w_gate", e)) * h if self.gated else self.act(h)
            outs.append(linear(h, "w_down", e))
        return torch.cat(outs) if outs else xs.new_zeros(0, self.d_model, dtype=self.compute_dtype)


def _plain_stack(module: nn.Module) -> bool:
    """Stacked experts that :class:`FP8Experts` can keep: zoo's ``act(gate) * up`` (or ``act(up)``) without biases."""
    return isinstance(module, GroupedExperts) and not isinstance(module, FP8Experts) \
        and type(module).activate is GroupedExperts.activate and all(b is None for b in module.biases())


def keep_fp8(model: nn.Module, bound, names: dict[str, str], files: DequantizedFiles) -> DequantizedFiles:
    """Make each ``nn.Linear`` of ``model`` (on the meta device) whose weight is one stored fp8 tensor
    (through an identity rule of ``bound``; ``names``: the format's spelling -> the stored name) an
    :class:`FP8Linear`, and each MoE's :class:`GroupedExperts` whose every projection is stacked
    (:data:`~zoo.checkpoints.hf.maps.STACK`) from stored fp8 tensors an :class:`FP8Experts`; give back
    ``files`` that read those weights and their scales as stored. Anything else quantised (experts
    stored fused, as DBRX's are) is dequantised as it is read."""
    from zoo.checkpoints.hf.maps import IDENTITY, STACK

    kept, experts = [], {}  # experts: the module's path -> {projection: its stored tensors}
    for b in bound:
        stored = [names.get(h) for h in b.hf]
        if len(b.zoo) != 1 or not all(n in files.scale_of for n in stored):
            continue
        path, _, attr = b.zoo[0].rpartition(".")
        module = model.get_submodule(path)
        if b.transform is STACK and _plain_stack(module):
            experts.setdefault(path, {})[attr] = stored
        elif b.transform is IDENTITY and len(stored) == 1 and attr == "weight" and type(module) is nn.Linear:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, FP8Linear(
                module.in_features, module.out_features, bias=module.bias is not None, block=files.block,
                dtype=files.target, scale_dtype=files.files.dtype(files.scale_of[stored[0]]), device="meta"))
            kept += stored
    for path, projections in experts.items():
        module = model.get_submodule(path)
        wanted = {n for n in ("w_gate", "w_up", "w_down") if getattr(module, n) is not None}
        if set(projections) != wanted:  # a projection stored unquantised: the layer is dequantised whole
            continue
        scale_dtype = files.files.dtype(files.scale_of[projections["w_up"][0]])
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, FP8Experts(module, block=files.block, dtype=files.target,
                                                              scale_dtype=scale_dtype, device="meta"))
        kept += [n for stored in projections.values() for n in stored]
    return files.quant.reading(files.files, files.target, keep=kept)


def _kept(model: nn.Module) -> set[str]:
    """The zoo names of every float8 weight kept by an :class:`FP8Linear` or :class:`FP8Experts`."""
    return {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, _StaysFP8)
            for p, t in m.named_parameters(recurse=False) if t.dtype in FP8}


def with_scales(bound: list, model: nn.Module) -> list:
    """``bound`` and, for each kept float8 weight, the rule of its scale: the HF names and the zoo
    name, each with ``_scale_inv``, through the weight's own transform (identity, or the experts' stack)."""
    from zoo.checkpoints.hf.maps import Bound

    fp8 = _kept(model)
    extra = [Bound(tuple(h + SCALE_SUFFIX for h in b.hf), (b.zoo[0] + SCALE_SUFFIX,), b.transform, None)
             for b in bound if len(b.zoo) == 1 and b.zoo[0] in fp8]
    return bound + extra


def kept_tensors(model: nn.Module) -> set[str]:
    """The zoo names of every float8 weight and scale kept as stored (``fp8="keep"``): read and written as stored."""
    return {n for w in _kept(model) for n in (w, w + SCALE_SUFFIX)}
