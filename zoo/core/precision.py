"""Tensors a part keeps in float32 whatever the model's dtype.

A part lists the names of its own parameters and buffers that must stay in float32 in a class
attribute ``fp32_tensors`` (the MoE router's selection bias: DeepSeek-V3's
``e_score_correction_bias``, whose rounding to bfloat16 changes which experts are chosen). zoo
honours it wherever it sets the model's dtype: ``model.to(dtype)`` / ``.half()`` / ``.bfloat16()``
(:meth:`zoo.model.decoder.Decoder._apply`), ``build_model(dtype=...)``, and loading a checkpoint, with or
without ``dtype=`` (such a tensor is read as float32 and is exempt from the one-dtype check of the
rest). Saving writes it as float32, as transformers does. This is transformers'
``_keep_in_fp32_modules_strict`` (kept in float32 for both float16 and bfloat16), declared by the
part that owns the tensor rather than by the model class. A float64 model takes it to float64.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from zoo.core.kinds import is_part


def fp32_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Full name -> (module, attribute) of every tensor a part of ``model`` declares float32."""
    found = {}
    for prefix, module in model.named_modules():
        for name in module.fp32_tensors if is_part(module) else ():
            if getattr(module, name, None) is not None:
                found[f"{prefix}.{name}" if prefix else name] = (module, name)
    return found


def narrower(dtype: torch.dtype) -> bool:
    """A floating dtype below float32 (bfloat16, float16): the casts a declared tensor does not follow
    (a float64 model takes it to float64 with the rest)."""
    return dtype.is_floating_point and dtype.itemsize < 4


def apply_keeping_fp32(model: nn.Module, apply: Callable[..., nn.Module], fn, recurse: bool = True) -> nn.Module:
    """``apply(fn, recurse)`` (``nn.Module._apply``), except that each declared float32 tensor keeps its
    float32 values: where ``fn`` narrowed its dtype, it gets the original values moved where ``fn`` put
    it (never a float32 copy of a rounded tensor)."""
    before = {key: getattr(m, n).data for key, (m, n) in fp32_tensors(model).items()}
    apply(fn, recurse)
    for key, (m, n) in fp32_tensors(model).items():
        now, old = getattr(m, n), before.get(key)
        if old is None or not narrower(now.dtype) or old.dtype != torch.float32:
            continue
        kept = old.to(device=now.device) if not now.is_meta else torch.empty_like(now, dtype=torch.float32)
        if n in m._parameters:
            m._parameters[n].data = kept
        else:
            m._buffers[n] = kept
    return model


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight in full precision: ``weight`` of an ``nn.Linear``, or a dequantised copy
    from a layer that keeps it quantised (``dense_weight()``, as
    :class:`~zoo.checkpoints.quantized.FP8Linear` does)."""
    fn = getattr(linear, "dense_weight", None)
    return fn() if callable(fn) else linear.weight


def compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, or the one a quantised layer states."""
    return getattr(linear, "compute_dtype", None) or linear.weight.dtype
