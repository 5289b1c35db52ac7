"""GGUF files (llama.cpp's and Ollama's format) in: one file holds the metadata, the tokenizer and
the tensors, quantised or not.

The metadata becomes the HF config its architecture's checkpoint format reads (one
:class:`GGUFArch` per llama.cpp architecture zoo has; a plugin's format declares its own with a
``gguf`` attribute), so a GGUF model is built from a spec exactly as a safetensors one. Tensors are
renamed through the ``gguf`` library's own tensor-name map (the one llama.cpp's converter writes
with), dequantised by the ``gguf`` library one at a time as the model is filled, and the changes
llama.cpp's converter made are undone (Llama's Q/K row permutation for its rotary layout, Gemma's
``1 + w`` norms stored with the 1 added, GPT-2's Conv1D projections stored transposed). Memory holds
about the model in the loaded dtype plus one tensor in flight.

Every check runs on the header before the model is built: an unknown architecture, a metadata key
that changes the model but zoo cannot read, a tensor of a quantisation type ``gguf`` cannot
dequantise, of a shape its metadata does not give, or that has no place in the model, and a file
cut short are each an error naming the file and the key or tensor.

    >>> model = zoo.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from zoo.checkpoints.hf.format import BOUNDED, CheckpointError, ConfigError, get_format, is_kind
from zoo.checkpoints.hf.maps import Heads, _concat_fuse, _concat_split, _grouped_fuse, _grouped_split, bind
from zoo.checkpoints.weights import load_weights
from zoo.core import registry as _registry
from zoo.model.decoder import build_model

SUFFIX = ".gguf"


def require_gguf():
    """The ``gguf`` library (llama.cpp's reader and writer), or an error saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading or writing GGUF files needs the gguf library: pip install 'zoo-lm[gguf]' "
                              "(or pip install gguf)") from None
    return gguf


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file, or a directory holding exactly one (and no config.json)."""
    path = Path(path).expanduser()
    if path.suffix == SUFFIX:  # a missing one too: GGUFFile says so by name
        return True
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob(f"*{SUFFIX}"))


def gguf_file(path: str | Path) -> Path:
    """The GGUF file ``path`` names: itself, or the one ``*.gguf`` file in a directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = sorted(path.glob(f"*{SUFFIX}"))
        if len(found) != 1:
            raise CheckpointError(f"{path}: holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                                  "name the one to load")
        return found[0]
    return path


# -- tensors: what llama.cpp's converter changed, both ways --------------------------------------

def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Its inverse, as transformers' ``_reverse_permute_weights`` computes it (GGUF -> HF)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorFix:
    """A change llama.cpp's converter makes to the GGUF tensors whose names end with one of ``ends``:
    ``to_hf(tensor, config)`` undoes it, ``to_gguf(tensor, config)`` makes it (``config``: the HF one)."""

    name: str
    ends: tuple[str, ...]
    to_hf: Callable[[torch.Tensor, dict], torch.Tensor]
    to_gguf: Callable[[torch.Tensor, dict], torch.Tensor]

    def applies(self, gguf_name: str) -> bool:
        return gguf_name.endswith(self.ends)


def _heads(config):
    return config["num_attention_heads"]


def _kv_heads(config):
    return config.get("num_key_value_heads") or config["num_attention_heads"]


ROPE_PERMUTE = (
    TensorFix("rope_permute_q", ("attn_q.weight", "attn_q.bias"),
              lambda t, c: _unpermute(t, _heads(c)), lambda t, c: _permute(t, _heads(c))),
    TensorFix("rope_permute_k", ("attn_k.weight", "attn_k.bias"),
              lambda t, c: _unpermute(t, _kv_heads(c)), lambda t, c: _permute(t, _kv_heads(c))),
)
# Gemma's norms compute x * (1 + w); llama.cpp stores 1 + w.
NORM_OFFSET = (TensorFix("norm_plus_one", ("norm.weight",), lambda t, c: t - 1, lambda t, c: t + 1),)
# GPT-2's Conv1D weights are (in, out); llama.cpp stores them as (out, in).
CONV1D = (TensorFix("transpose", ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight"),
                    lambda t, c: t.t().contiguous(), lambda t, c: t.t().contiguous()),)
# Qwen2-MoE's shared-expert gate is a (1, d) linear; llama.cpp stores a (d,) vector.
SHARED_GATE = (TensorFix("shared_gate_vector", ("ffn_gate_inp_shexp.weight",),
                         lambda t, c: t.reshape(1, -1), lambda t, c: t.reshape(-1)),)


def _falcon_qkv_to_hf(t, c):
    """llama.cpp stores Falcon's fused QKV as all q heads, then k, then v; HF's new decoder
    architecture groups them per kv head ([q of the group, k, v])."""
    if not c.get("new_decoder_architecture"):
        return t  # one kv head (multi-query): the two layouts are the same
    h = Heads(c["num_attention_heads"], c["num_kv_heads"], c["hidden_size"] // c["num_attention_heads"])
    return _grouped_fuse(_concat_split(t, h), h)


def _falcon_qkv_to_gguf(t, c):
    if not c.get("new_decoder_architecture"):
        return t
    h = Heads(c["num_attention_heads"], c["num_kv_heads"], c["hidden_size"] // c["num_attention_heads"])
    return _concat_fuse(_grouped_split(t, h), h)


FALCON_QKV = (TensorFix("falcon_qkv_order", ("attn_qkv.weight",), _falcon_qkv_to_hf, _falcon_qkv_to_gguf),)


# -- metadata -> HF config -----------------------------------------------------------------------

# llama.cpp's per-architecture keys (after "<arch>.") -> the HF config field they give.
COMMON = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size", "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
# Keys read separately (RoPE, which layers slide) or that describe nothing the model computes.
READ_APART = ("rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
              "rope.scaling.original_context_length", "attention.value_length", "rope.scaling.finetuned",
              "tensor_data_layout", "attention.sliding_window_pattern", "expert_gating_func",
              "expert_weights_norm", "attention.causal", "pooling_type")


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture: the zoo checkpoint format that reads it, its keys where they
    differ from :data:`COMMON`, the HF fields llama.cpp implies without writing them (``extra(meta,
    config)``), and the tensor changes its converter makes."""

    name: str
    model_type: str
    keys: dict[str, str] = field(default_factory=dict)
    extra: Optional[Callable[[dict, dict], dict]] = None
    fixes: tuple[TensorFix, ...] = ()
    partial_rotary: bool = False  # rope.dimension_count may be less than the head dimension

    def fields(self) -> dict[str, str]:
        return {**COMMON, **self.keys}


def _gemma_scalar(layers_27b: int):
    # llama.cpp scales queries by 1/sqrt(head_dim), and the 27B models (told by their layer count)
    # by 1/sqrt(d_model / heads): transformers' query_pre_attn_scalar.
    def extra(meta, c):
        if c["num_hidden_layers"] == layers_27b:
            scalar = c["hidden_size"] // c["num_attention_heads"]
        else:
            scalar = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return {"query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh"}
    return extra


def _gemma3(meta, c):
    extra = _gemma_scalar(62)(meta, c)
    full = c.pop("rope_parameters")
    n = c["num_hidden_layers"]
    every = meta.get("gemma3.attention.sliding_window_pattern", 6)
    # llama.cpp's gemma3: local layers rotate with base 1e4 and no scaling, every 6th layer is global.
    extra["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    extra["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": full}
    return extra


def _falcon(meta, c):
    new = "blk.0.attn_norm_2.weight" in meta["_tensors"]  # two norms per layer: the new decoder architecture
    kv = c.setdefault("num_kv_heads", 1)
    return {"new_decoder_architecture": new, "multi_query": kv == 1, "parallel_attn": True,
            "bias": "blk.0.attn_qkv.bias" in meta["_tensors"], "alibi": False, "tie_word_embeddings": True}


def _gpt2(meta, c):
    return {"tie_word_embeddings": True, "activation_function": "gelu_new"}


def _biases(names):
    def extra(meta, c):
        t = meta["_tensors"]
        return {names[0]: "blk.0.attn_q.bias" in t, **({names[1]: "blk.0.ffn_up.bias" in t} if len(names) > 1 else {})}
    return extra


ARCHITECTURES: dict[str, GGUFArch] = {a.name: a for a in (
    GGUFArch("llama", "llama", extra=_biases(("attention_bias", "mlp_bias")), fixes=ROPE_PERMUTE),
    GGUFArch("qwen2", "qwen2"),
    GGUFArch("qwen3", "qwen3", extra=_biases(("attention_bias",))),
    GGUFArch("qwen2moe", "qwen2_moe", fixes=SHARED_GATE),
    GGUFArch("qwen3moe", "qwen3_moe", extra=lambda meta, c: {"norm_topk_prob": True, **_biases(("attention_bias",))(meta, c)}),
    GGUFArch("gemma", "gemma", fixes=NORM_OFFSET, extra=lambda meta, c: {"hidden_activation": "gelu_pytorch_tanh"}),
    GGUFArch("gemma2", "gemma2", fixes=NORM_OFFSET, extra=_gemma_scalar(46)),
    GGUFArch("gemma3", "gemma3_text", fixes=NORM_OFFSET, extra=_gemma3),
    GGUFArch("olmo2", "olmo2", extra=_biases(("attention_bias",))),
    GGUFArch("falcon", "falcon", keys={"attention.layer_norm_epsilon": "layer_norm_epsilon",
                                       "feed_forward_length": "ffn_hidden_size", "attention.head_count_kv": "num_kv_heads"},
             extra=_falcon,
             fixes=FALCON_QKV),
    GGUFArch("gpt2", "gpt2", keys={"context_length": "n_positions", "embedding_length": "n_embd",
                                   "block_count": "n_layer", "feed_forward_length": "n_inner",
                                   "attention.head_count": "n_head",
                                   "attention.layer_norm_epsilon": "layer_norm_epsilon"},
             extra=_gpt2, fixes=CONV1D),
)}


def architecture(name: str, source: Any = "") -> GGUFArch:
    """The :class:`GGUFArch` of llama.cpp architecture ``name``: zoo's own, or one a registered
    checkpoint format declares (its ``gguf`` attribute)."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    for fmt_name in _registry.registry("checkpoint_format").names():
        declared = getattr(_registry.get("checkpoint_format", fmt_name), "gguf", None)
        if isinstance(declared, GGUFArch) and declared.name == name:
            return declared
    known = sorted(set(ARCHITECTURES) | {a.name for a in plugin_architectures()})
    raise CheckpointError(f"{source}: general.architecture {name!r} is not one zoo reads from GGUF (it reads: "
                          f"{', '.join(known)}); a checkpoint format can declare it with a `gguf` attribute")


def plugin_architectures() -> list[GGUFArch]:
    out = []
    for fmt_name in _registry.registry("checkpoint_format").names():
        declared = getattr(_registry.get("checkpoint_format", fmt_name), "gguf", None)
        if isinstance(declared, GGUFArch):
            out.append(declared)
    return out


# Formats llama.cpp reads as another architecture: Mistral is llama (without a sliding window).
WRITTEN_AS = {"mistral": "llama"}


def architecture_of(model_type: str) -> Optional[GGUFArch]:
    """The GGUF architecture a zoo checkpoint format is written as (None: llama.cpp has none for it)."""
    declared = getattr(get_format(model_type), "gguf", None)
    if isinstance(declared, GGUFArch):
        return declared
    model_type = get_format(model_type).model_type
    if model_type in WRITTEN_AS:
        return ARCHITECTURES[WRITTEN_AS[model_type]]
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


# -- the header, walked before any reader loops over it --------------------------------------------

# GGUF value types (gguf.GGUFValueType) -> bytes per item; 8 (string) and 9 (array) have a length first.
_INTS = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
MAX_ARRAY = 1 << 22  # items in one metadata array: zoo's vocabulary limit (gguf's reader keeps a view per item)
MAX_NESTING = 4  # arrays of arrays
MAX_DIMS = 4  # GGML_MAX_DIMS


def gguf_types():
    return require_gguf().GGUFValueType


def scan_header(path: Path) -> None:
    """Walk a GGUF file's header as llama.cpp does, checking every count and length it states
    against the bytes left before anything is read or looped over (``gguf.GGUFReader`` loops over
    a claimed count, and reads past the end as empty: 128 bytes claiming 2**62 items would run
    forever). A :class:`CheckpointError` names the file, the key or tensor, and the count."""
    import mmap
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (it does not start with the GGUF magic and header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            version = struct.unpack_from("<I", data, 4)[0]
            end = ">" if version & 0xFFFF == 0 else "<"  # a big-endian file, as gguf's reader tells it
            version = struct.unpack_from(end + "I", data, 4)[0]
            if version not in (2, 3):
                raise CheckpointError(f"{path}: GGUF version {version} is not one zoo reads (2 or 3)")
            u32, u64 = struct.Struct(end + "I"), struct.Struct(end + "Q")
            pos = 8

            def number(st, what):
                nonlocal pos
                if pos + st.size > size:
                    raise CheckpointError(f"{path}: the header is cut short at byte {pos}, in {what}")
                (v,) = st.unpack_from(data, pos)
                pos += st.size
                return v

            def skip(n, what):
                nonlocal pos
                if n > size - pos:
                    raise CheckpointError(f"{path}: {what} claims {n:,} bytes, but only {size - pos:,} are left in the "
                                          "file (a damaged or hostile header)")
                pos += n

            def string(what):
                n = number(u64, what)
                skip(n, f"{what} (a string)")
                return n

            def value(kind, what, depth=0):
                if kind in _FIXED:
                    return skip(_FIXED[kind], what)
                if kind == 8:
                    return string(what)
                if kind != 9:
                    raise CheckpointError(f"{path}: {what} has value type {kind}, which GGUF does not define")
                if depth >= MAX_NESTING:
                    raise CheckpointError(f"{path}: {what} nests arrays deeper than {MAX_NESTING} levels")
                item, count = number(u32, what), number(u64, what)
                if count > MAX_ARRAY:
                    raise CheckpointError(f"{path}: {what} claims an array of {count:,} items, beyond zoo's limit of "
                                          f"{MAX_ARRAY:,} (a damaged or hostile header)")
                if item in _FIXED:
                    return skip(count * _FIXED[item], f"{what} (an array of {count:,} items)")
                least = 8 if item == 8 else 12  # a string's length, an array's type and count
                if count * least > size - pos:
                    raise CheckpointError(f"{path}: {what} claims an array of {count:,} items, but only {size - pos:,} "
                                          "bytes are left in the file (a damaged or hostile header)")
                for _ in range(count):
                    value(item, what, depth + 1)

            n_tensors, n_kv = number(u64, "the tensor count"), number(u64, "the metadata count")
            for count, least, what in ((n_kv, 8 + 4 + 1, "metadata entries"), (n_tensors, 8 + 4 + 4 + 8, "tensors")):
                if count * least > size - pos:
                    raise CheckpointError(f"{path}: the header claims {count:,} {what}, but only {size - pos:,} bytes "
                                          "are left in the file (a damaged or hostile header)")
            for i in range(n_kv):
                start = pos
                n = string(f"metadata entry {i}'s key")
                key = bytes(data[start + 8:start + 8 + n]).decode("utf-8", "replace")
                value(number(u32, f"metadata key {key!r}"), f"metadata key {key!r}")
            for i in range(n_tensors):
                start = pos
                n = string(f"tensor {i}'s name")
                name = bytes(data[start + 8:start + 8 + n]).decode("utf-8", "replace")
                dims = number(u32, f"tensor {name!r}'s dimension count")
                if dims > MAX_DIMS:
                    raise CheckpointError(f"{path}: tensor {name!r} claims {dims:,} dimensions; GGUF tensors have at "
                                          f"most {MAX_DIMS}")
                skip(8 * dims + 4 + 8, f"tensor {name!r}'s shape, type and offset")


class GGUFFile:
    """A GGUF file opened with ``gguf.GGUFReader`` (memory-mapped, nothing read yet): its metadata
    as Python values and its tensor table. The header is walked first (:func:`scan_header`); a
    file cut short or otherwise unreadable is a CheckpointError naming it."""

    def __init__(self, path: str | Path):
        gguf = require_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        scan_header(self.path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError, IndexError, ... on a damaged file
            raise CheckpointError(f"{self.path}: not a readable GGUF file, or cut short ({type(exc).__name__}: {exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        end = max((t.data_offset + t.n_bytes for t in self.reader.tensors), default=0)
        size = self.path.stat().st_size
        if end > size:
            last = max(self.reader.tensors, key=lambda t: t.data_offset + t.n_bytes)
            raise CheckpointError(f"{self.path}: the file is cut short: tensor {last.name!r} ends at byte {end}, "
                                  f"but the file has {size}")

    def keys(self) -> list[str]:
        return list(self.reader.fields)

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default: Any = None, kind: Optional[str] = None) -> Any:
        """The value of metadata key ``key`` (``default`` when absent); ``kind`` (``int``, ``number``,
        ``str``, ``bool``) is the GGUF type it must have, else a CheckpointError names the key."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        if kind is not None:
            stored = f.types[0].name if f.types else "?"
            allowed = {"int": _INTS, "number": _INTS | {"FLOAT32", "FLOAT64"}, "str": {"STRING"}, "bool": {"BOOL"}}[kind]
            if stored not in allowed:
                what = {"int": "an integer", "number": "a number", "str": "a string", "bool": "a boolean"}[kind]
                inner = f" of {f.types[1].name}" if stored == "ARRAY" and len(f.types) > 1 else ""
                raise CheckpointError(f"{self.path}: metadata key {key!r} must be {what}, but it holds "
                                      f"{stored}{inner}")
        v = f.contents()
        if f.types and f.types[0].name == "FLOAT32":  # 1e-5, not 9.999999747378752e-06
            import numpy as np

            v = float(np.format_float_positional(np.float32(v), unique=True))
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else v

    def token_id(self, key: str, vocab_size: Optional[int]) -> Optional[int]:
        """A special token id (``tokenizer.ggml.eos_token_id`` ...): an integer inside the vocabulary."""
        v = self.value(key, kind="int")
        if v is not None and vocab_size is not None and not 0 <= v < vocab_size:
            raise CheckpointError(f"{self.path}: metadata key {key!r} = {v} is outside the vocabulary "
                                  f"[0, {vocab_size})")
        return v

    def architecture(self) -> GGUFArch:
        name = self.value("general.architecture", kind="str")
        if name is None:
            raise CheckpointError(f"{self.path}: metadata key 'general.architecture' is missing")
        return architecture(name, self.path)

    def config(self) -> dict[str, Any]:
        """The HF config (as ``config.json`` would hold it) that this file's metadata describes."""
        arch = self.architecture()
        a = arch.name
        fields = arch.fields()
        cfg: dict[str, Any] = {"model_type": get_format(arch.model_type).model_type}
        for key in self.keys():
            if not key.startswith(a + "."):
                continue
            sub = key[len(a) + 1:]
            if sub in fields:
                cfg[fields[sub]] = self.value(key, kind="number")
            elif sub not in READ_APART:
                raise CheckpointError(f"{self.path}: metadata key {key!r} = {self.value(key)!r} is not one zoo's "
                                      f"{a} reader knows, so zoo cannot tell what it changes in the model")
        for required in ("embedding_length", "block_count", "attention.head_count"):
            if f"{a}.{required}" not in self:
                raise CheckpointError(f"{self.path}: metadata key '{a}.{required}' is missing")
        for sub, hf in fields.items():  # sizes that lists are made of are bounded before any is made
            limit, v = BOUNDED.get(hf), cfg.get(hf)
            if limit is not None and v is not None and (not is_kind(v, int) or not 0 < v <= limit):
                raise CheckpointError(f"{self.path}: metadata key '{a}.{sub}' = {v!r} is not a size zoo reads (a "
                                      f"positive integer of at most {limit:,})")
        for sub in ("embedding_length", "attention.head_count", "attention.head_count_kv", "attention.key_length"):
            if f"{a}.{sub}" in self and not (is_kind(cfg[fields[sub]], int) and cfg[fields[sub]] > 0):
                raise CheckpointError(f"{self.path}: metadata key '{a}.{sub}' = {cfg[fields[sub]]!r} must be a positive "
                                      "integer")
        if self.value(f"{a}.attention.causal", True, kind="bool") is not True:
            raise CheckpointError(f"{self.path}: {a}.attention.causal is false; zoo's decoders are causal")
        d_key, h_key = fields["embedding_length"], fields["attention.head_count"]
        head_dim = cfg.get("head_dim") or cfg[d_key] // cfg[h_key]
        value_dim = self.value(f"{a}.attention.value_length", head_dim, kind="int")
        if value_dim != head_dim:
            raise CheckpointError(f"{self.path}: {a}.attention.value_length {value_dim} differs from the key length "
                                  f"{head_dim}; zoo's attention has one head dimension")
        rotary = self.value(f"{a}.rope.dimension_count", kind="int")
        if rotary is not None and rotary != head_dim:
            if not arch.partial_rotary:
                raise CheckpointError(f"{self.path}: {a}.rope.dimension_count {rotary} is not the head dimension "
                                      f"{head_dim}; zoo's {arch.model_type} rotates whole heads")
        if f"{a}.rope.freq_base" in self or rotary is not None:
            rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.value(f"{a}.rope.freq_base", 10000.0, kind="number"))}
            kind = self.value(f"{a}.rope.scaling.type", "none", kind="str")
            if kind in ("linear", "yarn"):
                rope.update(rope_type=kind, factor=float(self.value(f"{a}.rope.scaling.factor", kind="number")))
                if kind == "yarn":
                    rope["original_max_position_embeddings"] = self.value(f"{a}.rope.scaling.original_context_length",
                                                                          kind="int")
            elif kind != "none":
                raise CheckpointError(f"{self.path}: {a}.rope.scaling.type {kind!r} is not one zoo reads "
                                      "(none, linear, yarn)")
            if rotary is not None and rotary != head_dim:
                rope["partial_rotary_factor"] = rotary / head_dim
            cfg["rope_parameters"] = rope
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{self.path}: tensor 'rope_freqs.weight' holds per-frequency RoPE factors "
                                  "(Llama 3.1's scaling as llama.cpp stores it); zoo does not read it from GGUF")
        if "vocab_size" not in cfg.values() and fields["vocab_size"] not in cfg:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            embed = self.tensors.get("token_embd.weight")
            cfg[fields["vocab_size"]] = len(tokens.data) if tokens is not None else int(embed.shape[-1]) if embed else None
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensors
        for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
            if f"tokenizer.ggml.{key}" in self:
                cfg[hf] = self.token_id(f"tokenizer.ggml.{key}", cfg.get(fields["vocab_size"]))
        if arch.extra is not None:
            cfg.update(arch.extra({**{k: self.value(k) for k in self.keys() if not k.startswith("tokenizer.")},
                                   "_tensors": self.tensors}, cfg))
        return cfg


def _expert_name(hf: str) -> tuple[str, Optional[int]]:
    """``model.layers.3.mlp.experts.5.gate_proj.weight`` -> (the name without the expert index, 5)."""
    m = re.fullmatch(r"(.*\.experts\.)(\d+)\.(.*)", hf)
    return (m[1] + m[3], int(m[2])) if m else (hf, None)


def name_map(arch: GGUFArch, hf_names, n_layers: int) -> dict[str, tuple[str, Optional[int]]]:
    """HF tensor name -> (GGUF tensor name, expert index or None), through gguf's TensorNameMap."""
    gguf = require_gguf()
    enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.name), None)
    if enum is None:
        raise CheckpointError(f"the gguf library has no architecture {arch.name!r}; upgrade it (pip install -U gguf)")
    names = gguf.get_tensor_name_map(enum, n_layers)
    out = {}
    for hf in hf_names:
        base, expert = _expert_name(hf)
        stem, dot, suffix = base.rpartition(".")
        target = names.get_name(stem) if suffix in ("weight", "bias") else names.get_name(base)
        if target is not None:
            out[hf] = (f"{target}.{suffix}" if suffix in ("weight", "bias") else target, expert)
    return out


def quant_types() -> set[str]:
    """The GGML tensor types the installed ``gguf`` library dequantises."""
    gguf = require_gguf()
    from gguf import quants

    return {"F32", "F16"} | {t.name for t in quants._type_traits}


class GGUFWeights:
    """The tensors of a :class:`GGUFFile` as a checkpoint format's map names them (the interface of
    :class:`~zoo.checkpoints.files.io.WeightFiles`), each dequantised to ``dtype`` when read.

    ``hf_names`` are the names the model's bound map asks for. Before anything is read, every GGUF
    tensor must have a place (an HF name), a type the ``gguf`` library dequantises, and the shape
    its metadata gives where the model needs one.
    """

    def __init__(self, file: GGUFFile, arch: GGUFArch, config: dict, hf_names, n_layers: int,
                 dtype: Optional[torch.dtype]):
        self.file, self.arch, self.config = file, arch, config
        self.directory = file.path
        self.target = dtype or torch.float32
        mapping = name_map(arch, hf_names, n_layers)
        self.source = {hf: g for hf, g in mapping.items() if g[0] in file.tensors}
        self.where = {hf: file.path for hf in self.source}
        used = {g for g, _ in self.source.values()}
        unplaced = [n for n in file.tensors if n not in used]
        if unplaced:
            raise CheckpointError(
                f"{file.path}: tensor {unplaced[0]!r} has no place in zoo's {arch.model_type} model "
                f"({len(unplaced)} such: {', '.join(unplaced[:5])}); the file's metadata does not describe its tensors")
        known = quant_types()
        for name in used:
            t = file.tensors[name]
            if t.tensor_type.name not in known:
                raise CheckpointError(
                    f"{file.path}: tensor {name!r} is stored as {t.tensor_type.name}, a type the gguf library does not "
                    f"dequantise (it reads: {', '.join(sorted(known))}); requantise the file (llama-quantize) to one of them")
        self._cache: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def names(self) -> list[str]:
        return list(self.source)

    def _gguf_shape(self, hf: str) -> tuple[int, ...]:
        g, expert = self.source[hf]
        shape = tuple(int(x) for x in reversed(self.file.tensors[g].shape))  # GGML lists dimensions innermost first
        return shape[1:] if expert is not None else shape

    def shape(self, hf: str) -> tuple[int, ...]:
        g, _ = self.source[hf]
        shape = self._gguf_shape(hf)
        for fix in self.arch.fixes:
            if fix.applies(g):
                shape = tuple(fix.to_hf(torch.empty(shape, device="meta"), self.config).shape)
        return shape

    def dtype(self, hf: str) -> torch.dtype:
        return self.target

    def _dequantised(self, g: str) -> torch.Tensor:
        if self._cache[0] != g:  # the experts of one stacked tensor are read one after another
            self._cache = (None, None)
            from gguf import quants

            t = self.file.tensors[g]
            try:
                array = quants.dequantize(t.data, t.tensor_type)
            except (ValueError, AssertionError) as exc:
                raise CheckpointError(f"{self.file.path}: tensor {g!r} ({t.tensor_type.name}) cannot be dequantised: "
                                      f"its data does not fit its shape {list(reversed(t.shape.tolist()))} ({exc})") from None
            if not array.flags.writeable:  # a view of the read-only mapping (F32 tensors)
                array = array.copy()
            want = tuple(int(x) for x in reversed(t.shape))
            if tuple(array.shape) != want:
                array = array.reshape(want)
            self._cache = (g, torch.from_numpy(array))
        return self._cache[1]

    def get(self, hf: str, *, mapped: bool = False) -> torch.Tensor:
        g, expert = self.source[hf]
        t = self._dequantised(g)
        if expert is not None:
            t = t[expert]
        for fix in self.arch.fixes:
            if fix.applies(g):
                t = fix.to_hf(t, self.config)
        return t.to(self.target, copy=True)


def load(path: str | Path, *, dtype: Optional[torch.dtype] = None, device=None, strict: bool = False,
         progress: bool = True):
    """A zoo model from a GGUF file (or a directory holding one); see :mod:`zoo.checkpoints.files.gguf`.

    Quantised tensors are dequantised to ``dtype`` (default float32) as they are read.
    """
    file = GGUFFile(gguf_file(path))
    arch = file.architecture()
    config = file.config()
    fmt = get_format(arch.model_type)
    try:
        spec = fmt.config_to_spec(config, strict=strict)
    except ConfigError as exc:
        raise CheckpointError(f"{file.path}: its metadata gives {exc}") from None
    model = build_model(spec, device="meta")
    bound = list(bind(fmt.rules(spec), model))
    weights = GGUFWeights(file, arch, config, [h for b in bound for h in b.hf], spec.n_layers, dtype)
    check_shapes(model, bound, weights)
    load_weights(model, fmt, weights, dtype=weights.target, device=device, progress=progress)
    model.eval()
    model.checkpoint_format = fmt.model_type
    model.hf_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    model.gguf_path = model.source = file.path
    return model


def check_shapes(model, bound, weights: GGUFWeights) -> None:
    """Every tensor's shape, from the file's tensor table, against the parameter the metadata's
    model has for it, before any tensor is read."""
    meta = dict(model.state_dict(keep_vars=True))
    for b in bound:
        if not all(h in weights.source for h in b.hf):
            continue  # a missing tensor: load_weights names it
        shapes = [weights.shape(h) for h in b.hf]
        try:
            got = b.transform.to_zoo([torch.empty(s, device="meta") for s in shapes], b.heads)
        except RuntimeError:
            got = None
        for z, t in zip(b.zoo, got or [None] * len(b.zoo)):
            if t is None or tuple(t.shape) != tuple(meta[z].shape):
                g = weights.source[b.hf[0]][0]
                raise CheckpointError(
                    f"{weights.file.path}: tensor {g!r} has shape {list(weights._gguf_shape(b.hf[0]))}, but the "
                    f"file's metadata describes a model whose {z} is {tuple(meta[z].shape)}; the tensor does not "
                    "belong to this metadata")


def tokenizer_parts(path: str | Path) -> dict[str, Any]:
    """What :class:`zoo.inference.tokenizer.Tokenizer` needs, from a GGUF file's ``tokenizer.*`` metadata: a
    ``tokenizers`` tokenizer built by transformers' GGUF converter (which knows each vocabulary
    kind's normaliser, pre-tokeniser and decoder), the BOS token and whether to prepend it, the
    end-of-sequence and end-of-turn ids, the padding id and the chat template."""
    file = GGUFFile(gguf_file(path))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if key not in file:
            raise CheckpointError(f"{file.path}: holds no tokenizer (metadata key {key!r} is missing); pass token "
                                  "ids, or a tokenizer.json of this model with --tokenizer")
    tokens = file.reader.fields["tokenizer.ggml.tokens"]
    if tokens.types[:2] != [gguf_types().ARRAY, gguf_types().STRING]:
        raise CheckpointError(f"{file.path}: metadata key 'tokenizer.ggml.tokens' must be an array of strings, but it "
                              f"holds {' of '.join(t.name for t in tokens.types)}")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in file and len(file.reader.fields[key].data) != len(tokens.data):
            raise CheckpointError(f"{file.path}: metadata key {key!r} has {len(file.reader.fields[key].data)} entries "
                                  f"for {len(tokens.data)} tokens")
    file.value("tokenizer.ggml.model", kind="str")
    for k in ("bos", "eos", "eot", "eom", "padding", "unknown", "seperator"):  # (llama.cpp's spelling)
        file.token_id(f"tokenizer.ggml.{k}_token_id", len(tokens.data))
    file.value("tokenizer.chat_template", kind="str")
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        raise CheckpointError(f"{file.path}: building its tokenizer needs transformers' GGUF converter: "
                              "pip install 'zoo-lm[gguf]'") from None
    arch, tok_dict, tok_config = get_gguf_tokenizer(str(file.path))
    try:
        backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise CheckpointError(f"{file.path}: its tokenizer (tokenizer.ggml.model "
                              f"{file.value('tokenizer.ggml.model')!r}) cannot be built ({exc})") from None
    vocab = len(tokens.data)
    eos = [file.token_id(f"tokenizer.ggml.{k}", vocab) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return {
        "path": file.path, "tokenizer": backend, "bos_token": tok_config.get("bos_token"),
        "add_bos": bool(tok_config.get("add_bos_token", False)) and tok_config.get("bos_token") is not None,
        "eos_token_ids": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        "pad_token_id": file.token_id("tokenizer.ggml.padding_token_id", vocab),
        "chat_template": file.value("tokenizer.chat_template"),
    }
