"""Hugging Face checkpoints: ``config.json`` <-> spec through a format per ``model_type``;
safetensors <-> module through that format's two-way weight-name map.

The module is built on the meta device and filled by assignment, tensor by tensor, so loading
needs about one copy of the weights.

    >>> model = zoo.from_pretrained("meta-llama/Llama-3.2-1B", dtype=torch.bfloat16)
    >>> zoo.save_pretrained(model, "out/")   # transformers loads it back
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from zoo.checkpoints.adapter import load_adapter
# Bound under other names than the old module paths zoo.checkpoints.gguf and .native: importing one of
# those shims rebinds that attribute of this package to the shim.
from zoo.checkpoints.files import gguf as gguf_file, native as native_layout
from zoo.checkpoints.files.hub import resolve
from zoo.checkpoints.files.io import WeightFiles, reading, replace_checkpoint, stream_shards
from zoo.checkpoints.files.tokenizer import Tokenizer
from zoo.checkpoints.hf.config import (CARRIED, _architecture, _format_and_config, _unstored, config_to_spec,
                                       ignored_fields, read_config, spec_to_config)
from zoo.checkpoints.hf.format import CheckpointError, CheckpointFormat, ConfigError, collect_ignored, get_format
from zoo.checkpoints.hf.maps import bind
from zoo.checkpoints.hf.mtp import without_absent_mtp
from zoo.checkpoints.quantized import FIELD as QUANTIZATION, keep_fp8, kept_tensors, read_quantization, with_scales
from zoo.checkpoints.sources import Source, open_source
from zoo.checkpoints.weights import _float_dtype, _names, check_layers, load_weights
from zoo.core.registry import list_components
from zoo.core.spec import differences
from zoo.model.decoder import Decoder, build_model

__all__ = [
    "CheckpointError", "CheckpointFormat", "ConfigError", "Source", "check_layers", "config_to_spec", "from_pretrained",
    "get_format", "ignored_fields", "load_weights", "open_source", "read_config", "resolve", "save_pretrained",
    "save_tokenizer", "spec_to_config",
]

def from_pretrained(
    path_or_repo_id: str | Path,
    *,
    revision: Optional[str] = None,
    dtype: Optional[torch.dtype | str] = None,
    device: Optional[torch.device | str] = None,
    strict: bool = False,
    token: Any = None,
    cache_dir: Optional[str] = None,
    progress: bool = True,
    adapter: Optional[str | Path] = None,
    fp8: str = "dequantize",
) -> Decoder:
    """Load an HF checkpoint (local directory or hub repo id) into a zoo model.

    ``dtype`` converts floating-point weights on load (default: as stored). The model is built on
    the meta device and filled by assignment, tensor by tensor, from safetensors, so loading needs about
    one copy of the weights. Config fields transformers ignores are accepted and kept (in
    ``model.hf_config``, written back on saving); ``strict=True`` refuses them. ``progress=False``
    hides the progress bar that long loads show. Block-scaled FP8 checkpoints (``quantization_config``
    with ``quant_method: "fp8"``, as DeepSeek-V3 ships) are dequantised tensor by tensor as they are
    read (:mod:`zoo.checkpoints.quantized`); ``fp8="keep"`` keeps the linear layers' weights in FP8
    with their block scales instead (:class:`~zoo.checkpoints.quantized.FP8Linear`: block-scaled
    ``scaled_mm`` on an H100/H200, else each weight dequantised for its own product), and saving writes
    them back as stored. Other quantization methods are refused by name. A GGUF
    file (or a directory holding one) is read by :mod:`zoo.checkpoints.files.gguf`, dequantised to ``dtype``
    (default float32). A directory in zoo's own layout (``spec.toml`` + ``model.safetensors``: what
    ``zoo train`` exports for a model no HF format describes) loads too, and so does a training run's
    directory (its ``final/`` export); see :mod:`zoo.checkpoints.files.native`. ``adapter``: a PEFT LoRA
    adapter directory (what ``zoo train --lora`` writes, or peft saves for the transformers model) to
    apply on top (:func:`zoo.checkpoints.adapter.load_adapter`; ``zoo.merge_adapter`` folds it in).
    """
    if fp8 not in ("dequantize", "keep"):
        raise ValueError(f"fp8={fp8!r}: use 'dequantize' (the default: full-precision weights) or 'keep' "
                         "(FP8 linear weights with their block scales)")
    model = _from_pretrained(path_or_repo_id, revision=revision, dtype=dtype, device=device, strict=strict,
                             token=token, cache_dir=cache_dir, progress=progress, fp8=fp8)
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def _from_pretrained(path_or_repo_id, *, revision, dtype, device, strict, token, cache_dir, progress, fp8) -> Decoder:
    source = open_source(path_or_repo_id, revision=revision, token=token, cache_dir=cache_dir)
    return _LOADERS[source.kind](source.path, dtype=_float_dtype(dtype), device=device, strict=strict, progress=progress,
                                 fp8=fp8)


def _load_gguf(path: Path, *, dtype, device, strict, progress, fp8) -> Decoder:
    """A llama.cpp file: metadata, tokenizer and (quantised) tensors in one."""
    return gguf_file.load(path, dtype=dtype, device=device, strict=strict, progress=progress)


def _load_native(path: Path, *, dtype, device, strict, progress, fp8) -> Decoder:
    """zoo's own layout: a model no HF format describes."""
    model = native_layout.load_native(path, dtype=dtype, device=device)
    model.source = path
    return model


def _load_hf(directory: Path, *, dtype, device, strict, progress, fp8) -> Decoder:
    """An HF checkpoint directory: config.json and safetensors."""
    with reading(directory):  # no save replaces the files while they are read
        config = read_config(directory)
        quant = read_quantization(config, directory / "config.json")
        fmt, inner, renames = _format_and_config(config)
        with collect_ignored() as ignored:
            spec = fmt.config_to_spec(inner, strict=strict)
        with WeightFiles(directory) as files:
            if quant is not None:  # each quantized weight is dequantised to dtype as it is read
                files = quant.reading(files, dtype)
            spec = without_absent_mtp(spec, fmt, set(_names(fmt, files, renames)))
            check_layers(spec, fmt, files, renames)
            model = build_model(spec, device="meta")
            if quant is not None and fp8 == "keep":
                files = keep_fp8(model, bind(fmt.rules(spec), model), _names(fmt, files, renames), files)
            load_weights(model, fmt, files, dtype=dtype, device=device, renames=renames, progress=progress)
    model.eval()
    model.checkpoint_format = fmt.model_type
    model.hf_config = {k: inner[k] for k in (*CARRIED, *ignored) if k in inner}
    if kept_tensors(model):  # written back when the model is saved with its FP8 weights
        model.hf_config[QUANTIZATION] = config[QUANTIZATION]
    model.source = directory
    return model


#: How each kind of :class:`~zoo.checkpoints.sources.Source` loads.
_LOADERS = {"gguf": _load_gguf, "native": _load_native, "hf": _load_hf}


def save_pretrained(model: Decoder, directory: str | Path, *, model_type: Optional[str] = None,
                    max_shard_size: int | str = "2GB", state: Optional[Mapping[str, torch.Tensor]] = None,
                    tokenizer: Any = None) -> Path:
    """Write ``model`` in the Hugging Face layout (config.json + safetensors shards + index).

    The tensors are converted and written one rule at a time, so a save holds about one tensor
    beyond the weights. ``state`` gives the weights by zoo name when they are not ``model``'s own
    (which may then be on the meta device): a mapping that reads each tensor when it is asked for,
    and gives its dtype and shape without reading it through ``meta(name)``, as
    :class:`zoo.training.checkpointer.CheckpointWeights` does for a training checkpoint.

    The tokenizer goes with it, so that ``zoo generate`` and transformers run the result:
    ``tokenizer`` (a :class:`zoo.inference.tokenizer.Tokenizer`, a tokenizer.json or a directory
    holding one), else the one of the checkpoint or GGUF file the model was loaded from. It writes
    ``tokenizer.json``, ``tokenizer_config.json``, the chat template and ``generation_config.json``
    (BOS, end-of-sequence and padding ids); without a tokenizer, ``generation_config.json`` carries
    the config's token ids.

    Only the previous checkpoint's own files in ``directory`` are replaced; anything else there (a
    tokenizer, an adapter, a repository) is kept. A save killed at any point leaves the previous
    checkpoint or, once it has committed, the new one (finished by the next load or save); a second
    save into the same directory at the same time is refused.

    The ``model_type`` comes from the checkpoint the model was loaded from, or must be given.
    """
    model_type = model_type or getattr(model, "checkpoint_format", None)
    if not model_type:
        raise CheckpointError(
            "save_pretrained needs to know which HF model_type to write: this model was not loaded from a "
            "checkpoint, so pass model_type= (one of: "
            + ", ".join(list_components("checkpoint_format")) + ")"
        )
    fmt = get_format(model_type)
    spec = model.spec
    carried = dict(getattr(model, "hf_config", {}))
    quantization = carried.pop(QUANTIZATION, None) if kept_tensors(model) else None
    carried.pop(QUANTIZATION, None)
    if fmt.model_type != getattr(model, "checkpoint_format", None):  # kept fields belong to their own format
        carried = {k: v for k, v in carried.items() if k in CARRIED}
    config = {**carried, **spec_to_config(spec, fmt.model_type)}
    # Before any tensor is converted or written: the config must describe exactly this model.
    back = fmt.config_to_spec(config)
    differ = [d for d in differences(_architecture(spec), _architecture(back)) if not _unstored(d[0], fmt)]
    if differ:
        diff = [f"{p}: {json.dumps(x)} in the model, {json.dumps(y)} as the config reads back" for p, x, y in differ]
        raise CheckpointError(
            f"this model cannot be written as {fmt.model_type}: its config would describe a different model "
            f"({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})"
        )
    state = model.state_dict() if state is None else state
    meta = getattr(state, "meta", lambda name: state[name].to("meta"))  # dtype and shape, not the data
    config["dtype"] = str(meta(next(iter(model.state_dict()))).dtype).removeprefix("torch.")
    bound = with_scales(list(bind(fmt.rules(spec), model)), model)
    if quantization is not None:  # FP8 weights kept as stored: the config says how to read them
        config[QUANTIZATION] = quantization
    # Each HF tensor's name, dtype and shape, from the transforms run on the meta device: the files'
    # headers are written first, then each rule's tensors, converted as they are written.
    layout = [(name, t.dtype, tuple(t.shape)) for b in bound
              for name, t in zip(b.hf, b.transform.to_hf([meta(z) for z in b.zoo], b.heads))]

    def converted():
        for b in bound:
            yield from zip(b.hf, b.transform.to_hf([state[z].detach() for z in b.zoo], b.heads))

    with replace_checkpoint(Path(directory)) as tmp:
        stream_shards(layout, converted(), tmp, max_shard_size)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(model, directory, tokenizer, ids=config)
    return Path(directory)


def save_tokenizer(model: Decoder, directory: str | Path, tokenizer: Any = None, *, ids: Any = None) -> None:
    """Beside a saved checkpoint: ``tokenizer`` (see :func:`save_pretrained`), or the tokenizer of
    the checkpoint the model came from when it has one; else a ``generation_config.json`` of the token
    ids in ``ids`` (the config written)."""
    directory = Path(directory)
    if tokenizer is None and getattr(model, "source", None) is not None:
        source = Path(model.source)
        if source.resolve() != directory.resolve() and (source.is_file() or (source / "tokenizer.json").is_file()):
            try:
                tokenizer = Tokenizer(source)
            except (CheckpointError, ValueError):  # a GGUF file without a tokenizer, one that cannot be built
                tokenizer = None
    if isinstance(tokenizer, (str, Path)):
        tokenizer = Tokenizer(tokenizer)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(directory)
    elif not (directory / "generation_config.json").exists():
        gen = {k: ids[k] for k in CARRIED if (ids or {}).get(k) is not None}
        if gen:
            (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
