"""GGUF files out: a zoo model as llama.cpp and Ollama read it, with its tokenizer and chat template.

The model's spec is written as its checkpoint format's HF config would say it
(:func:`~zoo.checkpoints.spec_to_config`, which refuses by name what the format cannot express),
turned into llama.cpp's metadata keys by the same table :mod:`zoo.checkpoints.files.gguf` reads with,
and read back before anything is kept: a model whose file would describe a different model (a
sliding window the GGUF architecture has no key for, a RoPE scaling llama.cpp stores otherwise)
is refused, naming the spec field. The tensors pass the format's weight-name map, gguf's tensor-name
map and the changes llama.cpp's converter makes (:class:`~zoo.checkpoints.files.gguf.TensorFix`).

Weights of two or more dimensions are stored in ``dtype`` (``f16``, ``bf16``, ``q8_0``, or ``f32``);
vectors (norms, biases) stay F32 as llama.cpp keeps them, and a matrix whose rows are no multiple of
Q8_0's block of 32 is stored F16 instead.

    >>> zoo.save_gguf(model, "model.gguf", dtype="q8_0", tokenizer="SmolLM2.Q4_1.gguf")
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from zoo.checkpoints.hf.config import _architecture, spec_to_config
from zoo.checkpoints.hf.format import CheckpointError, get_format
from zoo.checkpoints.hf.maps import bind
from zoo.core.spec import differences
from zoo.checkpoints.files.gguf import COMMON, GGUFFile, architecture_of, name_map, require_gguf

DTYPES = ("f32", "f16", "bf16", "q8_0")


def _metadata(config: dict[str, Any], arch) -> dict[str, Any]:
    """llama.cpp's ``<arch>.*`` keys for an HF ``config`` (the inverse of GGUFFile.config)."""
    a = arch.name
    meta: dict[str, Any] = {}
    for gkey, hkey in arch.fields().items():
        value = config.get(hkey)
        if value is not None and not isinstance(value, (list, dict)):
            meta[f"{a}.{gkey}"] = value
    d, heads = config[arch.fields()["embedding_length"]], config[arch.fields()["attention.head_count"]]
    head_dim = config.get("head_dim") or d // heads
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:  # per layer type (Gemma 3): the global layers'
        rope = rope["full_attention"]
    if rope:
        meta[f"{a}.rope.freq_base"] = float(rope["rope_theta"])
        kind = rope.get("rope_type", "default")
        if kind in ("linear", "yarn"):
            meta[f"{a}.rope.scaling.type"] = kind
            meta[f"{a}.rope.scaling.factor"] = float(rope["factor"])
            if kind == "yarn":
                meta[f"{a}.rope.scaling.original_context_length"] = int(rope["original_max_position_embeddings"])
        elif kind != "default":
            raise CheckpointError(f"this model cannot be written as GGUF: its RoPE scaling {kind!r} has no "
                                  f"llama.cpp metadata key (GGUF writes none, linear and yarn)")
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        meta[f"{a}.rope.dimension_count"] = rotary
    return meta


def _typed(writer, key: str, value: Any) -> None:
    gguf = require_gguf()
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, T.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, T.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, T.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, T.STRING)
    else:
        raise CheckpointError(f"GGUF metadata key {key!r}: zoo writes no value of type {type(value).__name__}")


def _tokenizer_metadata(source) -> dict[str, Any]:
    """The ``tokenizer.*`` keys (vocabulary, merges, special ids, chat template) of a GGUF file,
    copied as they are, with their GGUF value types."""
    file = GGUFFile(source)
    out = {}
    for key, f in file.reader.fields.items():
        if key.startswith("tokenizer."):
            out[key] = (f.contents(), f.types)
    if "tokenizer.ggml.model" not in out:
        raise CheckpointError(f"{file.path}: holds no tokenizer to embed (metadata key 'tokenizer.ggml.model' is missing)")
    return out


def _quantised(t: torch.Tensor, dtype: str):
    """(numpy data, GGML type) for one tensor: vectors F32, matrices in ``dtype``."""
    gguf = require_gguf()
    Q = gguf.GGMLQuantizationType
    x = t.detach().to(torch.float32).cpu().numpy()
    if x.ndim < 2 or dtype == "f32":
        return x, Q.F32
    if dtype == "f16" or (dtype == "q8_0" and x.shape[-1] % 32):
        return x.astype(np.float16), Q.F16
    qtype = {"bf16": Q.BF16, "q8_0": Q.Q8_0}[dtype]
    return gguf.quants.quantize(x, qtype), qtype


def save_gguf(model, path: str | Path, *, dtype: str = "f16", tokenizer: Optional[str | Path] = None,
              model_type: Optional[str] = None, name: Optional[str] = None) -> Path:
    """Write ``model`` as one GGUF file at ``path`` for llama.cpp (see :mod:`zoo.checkpoints.files.gguf_out`).

    ``tokenizer``: a GGUF file whose tokenizer (and chat template) to embed; default the file the
    model was loaded from, if it was a GGUF. A model loaded from safetensors has no GGUF tokenizer
    to copy, so its file carries none unless one is given (llama.cpp then cannot tokenize text).
    """
    gguf = require_gguf()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: GGUF is written as one of {', '.join(DTYPES)}")
    if Path(path).is_dir():
        raise ValueError(f"{path} is a directory; a GGUF is one file: name it (such as {Path(path) / 'model.gguf'})")
    model_type = model_type or getattr(model, "checkpoint_format", None)
    if not model_type:
        raise CheckpointError("save_gguf needs the model's HF model_type: this model was not loaded from a checkpoint, "
                              "so pass model_type= (llama, qwen2, gemma2, ...)")
    fmt = get_format(model_type)
    arch = architecture_of(fmt.model_type)
    if arch is None:
        raise CheckpointError(f"this model cannot be written as GGUF: llama.cpp has no architecture zoo writes "
                              f"{fmt.model_type} as (GGUF architectures zoo writes: llama, qwen2, qwen3, qwen2moe, "
                              "qwen3moe, gemma, gemma2, gemma3, olmo2, falcon, gpt2, and those plugins declare)")
    spec = model.spec
    config = spec_to_config(spec, fmt.model_type)
    meta = _metadata(config, arch)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "gguf_path", None)
    tok_meta = _tokenizer_metadata(tokenizer) if tokenizer is not None else {}

    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    bound = list(bind(fmt.rules(spec), model))
    names = name_map(arch, [h for b in bound for h in b.hf], spec.n_layers)
    for b in bound:
        for hf, t in zip(b.hf, b.transform.to_hf([state[z].detach() for z in b.zoo], b.heads)):
            if hf not in names:
                raise CheckpointError(f"this model cannot be written as GGUF: tensor {hf!r} has no name in llama.cpp's "
                                      f"{arch.name} architecture")
            g, expert = names[hf]
            if expert is None:
                tensors[g] = t
            else:
                experts.setdefault(g, {})[expert] = t
    for g, parts in experts.items():
        tensors[g] = torch.stack([parts[j] for j in range(len(parts))])
    if tensors.get("output.weight") is not None and spec.head.tied:
        del tensors["output.weight"]  # llama.cpp reads a missing output as the tied embedding

    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    with open(tmp, "xb"):  # made as any new file: mode 0666 less the umask (a mkstemp file would be 0600)
        pass
    try:
        writer = gguf.GGUFWriter(tmp, arch.name)
        # (not "mistral": transformers reads a llama file so named as Mistral, with a 4096 window)
        writer.add_name(name or arch.name)
        writer.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[dtype])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in meta.items():
            _typed(writer, key, value)
        for key, (value, types) in tok_meta.items():
            if types[0] == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, types[0])
        for g, t in tensors.items():
            for fix in arch.fixes:
                if fix.applies(g):
                    t = fix.to_gguf(t, config)
            data, qtype = _quantised(t, dtype)
            writer.add_tensor(g, data, raw_dtype=qtype if qtype not in (gguf.GGMLQuantizationType.F32,
                                                                       gguf.GGMLQuantizationType.F16) else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        # Read the file back: its metadata must describe exactly this model.
        back = get_format(arch.model_type).config_to_spec(GGUFFile(tmp).config())
        diff = [f"{p}: {json.dumps(x)} in the model, {json.dumps(y)} as GGUF reads back"
                for p, x, y in differences(_architecture(spec), _architecture(back))
                if not p.rsplit(".", 1)[-1].endswith("loss")]  # loss weights are training settings
        if diff:
            raise CheckpointError(f"this model cannot be written as GGUF ({arch.name}): llama.cpp's metadata would "
                                  f"describe a different model ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
