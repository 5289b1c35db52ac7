"""Hugging Face checkpoints: ``config.json`` <-> spec through a format per ``model_type``;
safetensors <-> module through that format's two-way weight-name map.

The module is built on the meta device and filled by assignment, tensor by tensor, so loading
needs about one copy of the weights.

    >>> model = zoo.from_pretrained("meta-llama/Llama-3.2-1B", dtype=torch.bfloat16)
    >>> zoo.save_pretrained(model, "out/")   # transformers loads it back
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from zoo.checkpoints.hf.format import CheckpointError, CheckpointFormat, ConfigError, collect_ignored, get_format, layout_of
from zoo.core import kinds
from zoo.checkpoints.files.hub import resolve
from zoo.checkpoints.files.io import WeightFiles, reading, regular_file, replace_checkpoint, stream_shards
from zoo.checkpoints.hf.maps import IDENTITY, bind
from zoo.checkpoints.quantized import FIELD as QUANTIZATION, keep_fp8, kept_tensors, read_quantization, with_scales, without_quantization
from zoo.model.decoder import Decoder, build_model
from zoo.checkpoints.hf.mtp import missing_depth, without_absent_mtp
from zoo.core.precision import fp32_tensors, narrower
from zoo.core.registry import list_components
from zoo.core.spec import ModelSpec, differences

__all__ = [
    "CheckpointError", "CheckpointFormat", "ConfigError", "config_to_spec", "from_pretrained",
    "get_format", "ignored_fields", "load_weights", "read_config", "save_pretrained", "spec_to_config",
]

# Non-architectural fields carried from the loaded config into a saved one.
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory} has no config.json")
    try:
        config = json.loads(regular_file(path, "config").read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not a {type(config).__name__}")
    return config


def _format_and_config(config: dict[str, Any]) -> tuple[CheckpointFormat, dict[str, Any], dict[str, str]]:
    if not isinstance(config, dict):
        raise ConfigError("config", f"must be a JSON object, got {type(config).__name__}")
    read_quantization(config)  # a quantization zoo cannot read is refused by name
    config = without_quantization(config)  # the architecture is the unquantized model's
    fmt = get_format(config.get("model_type") or layout_of(config))
    inner, renames = fmt.unwrap(config)
    if inner is not config:
        fmt = get_format(inner.get("model_type") or fmt.model_type)
    return fmt, inner, renames


def config_to_spec(config: dict[str, Any], *, strict: bool = False) -> ModelSpec:
    """The zoo spec an HF config describes, read as transformers reads it: a field zoo cannot express
    is an error naming it; a field transformers ignores is accepted (``strict=True`` refuses it too)."""
    fmt, inner, _ = _format_and_config(config)
    return fmt.config_to_spec(inner, strict=strict)


def ignored_fields(config: dict[str, Any]) -> list[str]:
    """The fields of ``config`` that neither transformers' modelling code nor zoo reads (vendor extras
    such as Qwen's ``use_mrope``): they change nothing in the model and are kept on saving."""
    fmt, inner, _ = _format_and_config(config)
    with collect_ignored() as ignored:
        fmt.config_to_spec(inner, strict=False)
    return sorted(set(ignored))


def spec_to_config(spec: ModelSpec, model_type: str) -> dict[str, Any]:
    """The HF config of ``spec`` in ``model_type``'s format; a CheckpointError when the format has no
    way to say what the spec holds (a format reads the parts it knows: learned positions have no
    RoPE base for a RoPE-only format to write)."""
    fmt = get_format(model_type)
    try:
        body = fmt.spec_to_config(spec)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else f"it has no field for what the spec holds ({type(exc).__name__}: {exc})"
        raise CheckpointError(f"this model cannot be written as {fmt.model_type}: {detail}") from None
    return {"architectures": [fmt.architecture], "model_type": fmt.model_type, **body}


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
    from tqdm.auto import tqdm

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
        from zoo.checkpoints.adapter import load_adapter

        load_adapter(model, adapter)
    return model


def _from_pretrained(path_or_repo_id, *, revision, dtype, device, strict, token, cache_dir, progress, fp8) -> Decoder:
    from zoo.checkpoints.files import gguf, native

    if gguf.is_gguf(path_or_repo_id):  # a llama.cpp file: metadata, tokenizer and (quantised) tensors in one
        return gguf.load(path_or_repo_id, dtype=_float_dtype(dtype), device=device, strict=strict, progress=progress)
    if Path(path_or_repo_id).is_dir():  # a training run's directory: its export
        path_or_repo_id = native.checkpoint_dir(path_or_repo_id)
        if not (Path(path_or_repo_id) / "config.json").exists() and (Path(path_or_repo_id) / "checkpoints").is_dir():
            raise CheckpointError(native.unfinished_run(Path(path_or_repo_id)))
        if native.is_native(path_or_repo_id):  # zoo's own layout: a model no HF format describes
            model = native.load_native(path_or_repo_id, dtype=_float_dtype(dtype), device=device)
            model.source = Path(path_or_repo_id)
            return model
    directory = resolve(path_or_repo_id, revision=revision, token=token, cache_dir=cache_dir)
    dtype = _float_dtype(dtype)
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


def _architecture(spec: ModelSpec) -> dict[str, Any]:
    """What decides the function a spec computes, layer by layer, with defaults resolved (not layer
    kind names, labels or training-only settings), so that two spellings of one model compare equal.
    Each part resolves its own defaults (``resolved(config, d_model)``, when it has one)."""
    from zoo.core.spec import to_dict

    def resolved(part):
        if part is None:
            return None
        settings = part.cls.resolved(part.config, spec.d_model)
        return {"name": part.name, **settings} if settings is not None else to_dict(part)

    data = {k: v for k, v in spec.to_dict().items()
            if k not in ("layers", "layer_pattern", "label", "dropout", "init_std", "z_loss", "position")}
    per_layer = []
    for i in range(spec.n_layers):
        layer = spec.layer(i)
        ffn = resolved(layer.ffn)
        ffn["name"] = "glu" if getattr(layer.ffn.cls, "gated", False) else ffn["name"]
        per_layer.append({"mixer": resolved(layer.mixer), "ffn": ffn, "norm": resolved(layer.norm),
                          "block": resolved(layer.block), "position": resolved(spec.position_for(i))})
    data["per_layer"] = per_layer
    if "mtp" in data:  # its loss weight is a training setting
        data["mtp"] = {k: v for k, v in data["mtp"].items() if k != "weight"}
    return data


def _unstored(path: str, fmt: CheckpointFormat) -> bool:
    """Whether a path of :func:`_architecture` is one the format says its config does not store
    (``fmt.not_stored``: spec paths such as ``max_seq_len`` or ``layers.*.mixer.width``)."""
    spec_path = re.sub(r"^per_layer\[\d+\]\.", "layers.*.", path)
    return any(fnmatch.fnmatchcase(spec_path, p) or spec_path.startswith(p + ".") for p in fmt.not_stored)


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
    from zoo.inference.tokenizer import Tokenizer

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
