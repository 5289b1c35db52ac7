"""Filling a model built on the meta device from a checkpoint's tensors, through its format's two-way
name map: which stored layers the spec must have, and the tensors assigned one at a time (converted,
dequantised and cast as they are read), so that loading needs about one copy of the weights."""

from __future__ import annotations

import fnmatch
import re
from typing import Optional

import torch
from tqdm.auto import tqdm

from zoo.checkpoints.files.io import WeightFiles
from zoo.checkpoints.hf.format import CheckpointError, CheckpointFormat
from zoo.checkpoints.hf.maps import IDENTITY, bind
from zoo.checkpoints.hf.mtp import missing_depth
from zoo.checkpoints.quantized import kept_tensors, with_scales
from zoo.core import kinds
from zoo.core.precision import fp32_tensors, narrower
from zoo.core.spec import ModelSpec
from zoo.model.decoder import Decoder


def _rename(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _names(fmt: CheckpointFormat, files: WeightFiles, renames: Optional[dict[str, str]]) -> dict[str, str]:
    """The file's tensor names as the format's map spells them -> as stored."""
    renames = dict(renames or {})
    if fmt.base_prefix and not any(_rename(n, renames).startswith(fmt.base_prefix) for n in files.names()):
        renames[""] = fmt.base_prefix  # a base-model checkpoint: names lack the prefix
    return {_rename(n, renames): n for n in files.names()}


_NUMBER = re.compile(r"\d+")


def check_layers(spec: ModelSpec, fmt: CheckpointFormat, files: WeightFiles,
                 renames: Optional[dict[str, str]] = None) -> None:
    """Compare the config's layer count with the layers the weights hold, before anything is built
    (a config claiming 20,000 layers over a small file would otherwise allocate them all first)."""
    rules = fmt.rules(spec)
    templates = {h for r in rules for h in r.hf if "{i}" in h}
    if not templates:
        return
    # Names a rule claims for itself (a multi-token prediction module stored as layer n_layers) are no main layer.
    claimed = {h for r in rules if not r.per_layer for h in r.hf}
    found = set()
    for name in _names(fmt, files, renames):
        if name not in claimed:
            # A name is layer i's when putting {i} for one of its numbers gives a template: a set look-up
            # per number, so 16,000 experts cost what 16 do (one regex over every template was quadratic).
            for m in _NUMBER.finditer(name):
                if f"{name[:m.start()]}{{i}}{name[m.end():]}" in templates:
                    found.add(int(m.group()))
                    break
    if found != set(range(spec.n_layers)):
        held = f"layers {min(found)}..{max(found)} ({len(found)} in all)" if found else "no layers"
        raise CheckpointError(
            f"{files.directory}: config.json describes {spec.n_layers} layers, but the weights hold {held}; "
            "the config does not describe these weights"
        )


def load_weights(model: Decoder, fmt: CheckpointFormat, files: WeightFiles, *, dtype=None, device=None,
                 renames: Optional[dict[str, str]] = None, ignore: tuple[str, ...] = (),
                 progress: bool = True) -> None:
    """Fill ``model`` (built on the meta device) from ``files`` through ``fmt``'s name map, by assignment.

    Every zoo parameter must come from the file and every tensor in the file must be used (or be
    one the format ignores), floating-point parameters need floating-point tensors, and tensors kept
    as stored must share one dtype: anything else is an error naming the tensor, raised before the
    model is touched.
    """
    names = _names(fmt, files, renames)
    bound = with_scales(list(bind(fmt.rules(model.spec), model)), model)
    meta = dict(model.state_dict(keep_vars=True))
    as_stored = kept_tensors(model)  # float8 weights and their scales (fp8="keep")
    needed = {h for b in bound for h in b.hf}
    missing = sorted(needed - set(names))
    depth = missing_depth(bound, missing)
    if depth is not None:
        raise CheckpointError(
            f"{files.directory}: the config asks for {model.spec.mtp.depth} multi-token prediction module(s), but "
            f"module {depth} (layer {model.spec.n_layers + depth - 1}) has no weights: {missing[0]!r} is missing; "
            "lower the config's MTP depth to the modules the checkpoint holds")
    if missing:
        raise CheckpointError(
            f"{files.directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all: "
            f"{', '.join(missing[:5])}{'...' if len(missing) > 5 else ''}); the checkpoint is incomplete or is "
            f"not the {fmt.model_type} model its config describes"
        )
    skip = tuple(fmt.ignore) + tuple(ignore)
    unexpected = sorted(n for n in names if n not in needed and not any(fnmatch.fnmatchcase(n, p) for p in skip))
    if unexpected:
        raise CheckpointError(
            f"{files.directory}: unexpected tensor {names[unexpected[0]]!r} (in {files.where[names[unexpected[0]]].name}; "
            f"{len(unexpected)} in all): zoo's {fmt.model_type} model has no place for it, so the checkpoint "
            "does not match its config"
        )
    covered = {z for b in bound for z in b.zoo}
    uncovered = sorted(set(meta) - covered)
    if uncovered:
        raise CheckpointError(f"the {fmt.model_type} name map leaves zoo parameter {uncovered[0]!r} unfilled")
    fp32 = set(fp32_tensors(model))  # never read narrower than float32 (zoo/core/precision.py)
    first_of: dict[torch.dtype, str] = {}  # each stored floating dtype -> the first tensor that has it
    for b in bound:
        floating = any(meta[z].is_floating_point() for z in b.zoo)
        for h in b.hf:
            stored = files.dtype(names[h])
            if floating and not stored.is_floating_point:
                raise CheckpointError(
                    f"{files.where[names[h]]}: tensor {names[h]!r} is {stored}, where zoo's {', '.join(b.zoo)} "
                    "needs floating-point weights; the file is corrupt or is not this model")
            if dtype is None and stored.is_floating_point and not (fp32 | as_stored) >= set(b.zoo):
                first_of.setdefault(stored, names[h])
    if len(first_of) > 1:
        (common, first), (odd, name) = list(first_of.items())[:2]
        raise CheckpointError(
            f"{files.where[name]}: tensor {name!r} is {odd}, but {first!r} and the tensors before it are "
            f"{common}: a checkpoint of mixed dtypes would build a model that fails at its first forward. Pass "
            "dtype= to convert every weight to one dtype on load."
        )
    state: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # zoo name -> the HF tensor it was read from
    # The bar appears only for loads that take over a second (a big checkpoint, a dtype conversion).
    for b in tqdm(bound, desc=f"Loading {fmt.model_type} weights", unit="tensor", delay=1.0, leave=False,
                  disable=not progress):
        # Map (no copy) what is kept as stored; read what will be converted. A transform other than the
        # identity (the experts' stack, a transpose) makes its own copy: read into a buffer, the
        # source does not stay resident beside it as mapped pages would.
        keep = (device is None or torch.device(device).type == "cpu") and b.transform is IDENTITY
        hf_tensors = [files.get(names[h], mapped=keep and (dtype is None or files.dtype(names[h]) == dtype
                                                          or as_stored >= set(b.zoo))) for h in b.hf]
        try:
            zoo_tensors = b.transform.to_zoo(hf_tensors, b.heads)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(
                f"{files.directory}: tensor(s) {', '.join(b.hf)} of shape(s) "
                f"{[tuple(t.shape) for t in hf_tensors]} do not fit {b.transform.name} for {', '.join(b.zoo)} ({exc})"
            ) from None
        for zname, t in zip(b.zoo, zoo_tensors):
            want = tuple(meta[zname].shape)
            if tuple(t.shape) != want:
                shapes = ", ".join(f"{h!r} {tuple(x.shape)}" for h, x in zip(b.hf, hf_tensors))
                hint = getattr(fmt, "shape_hint", None)  # a format may name the config field at fault
                hint = hint(model.spec, zname, tuple(t.shape)) if callable(hint) else None
                raise CheckpointError(
                    f"{files.directory}: tensor {shapes} gives {zname} the shape {tuple(t.shape)}, but it needs "
                    f"{want} (via {b.transform.name}); the config does not describe these weights"
                    + (f": {hint}" if hint else "")
                )
            target_dtype = dtype if dtype is not None and t.is_floating_point() and zname not in as_stored else t.dtype
            if zname in fp32 and narrower(target_dtype):
                target_dtype = torch.float32
            t = t.to(device=device or "cpu", dtype=target_dtype)
            if zname in state and not torch.equal(state[zname], t):  # a stored copy (an MTP module's embedding, head)
                raise CheckpointError(
                    f"{files.directory}: tensors {names[source[zname]]!r} and {', '.join(map(repr, (names[h] for h in b.hf)))} "
                    f"both fill zoo's {zname}, which holds one copy, and they differ; the checkpoint's copies must "
                    "be equal for zoo to load it without changing what it computes")
            state[zname], source[zname] = t, b.hf[0]
        del hf_tensors, zoo_tensors
    model.load_state_dict(state, strict=True, assign=True)
    _reset_transient_buffers(model, device or "cpu")
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise CheckpointError(f"after loading, {left[0]!r} is still on the meta device (not filled)")


def _reset_transient_buffers(model: Decoder, device) -> None:
    """Non-persistent buffers (running counts, caches) are in no checkpoint: after a load they are
    zeros, then whatever the part's ``reset_buffers()`` makes them."""
    for module in model.modules():
        transient = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
                     and module._buffers[n].is_meta]
        for name in transient:
            module._buffers[name] = torch.zeros_like(module._buffers[name], device=device)
        if transient and kinds.is_part(module):
            module.reset_buffers()


def _float_dtype(dtype: Optional[torch.dtype | str]) -> Optional[torch.dtype]:
    """A floating-point torch dtype from its name (``"bfloat16"``) or itself; anything else is a ValueError."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point dtype to load weights in; "
                         "use float32, bfloat16 or float16")
    return resolved
