"""Resource accounting: what a model costs, computed from its spec on the meta device (no memory,
about a second even for a 405B model).

The formulas are the lecture notes' (see docs/accounting.md):

- parameters, split into embedding (token embeddings, an untied output head, learned positions)
  and non-embedding;
- forward FLOPs per token ``2 N + attention``, where N counts every weight a token is multiplied by
  (the non-embedding parameters plus the output head's vocab x d_model matrix, tied or not; an
  embedding lookup is not a multiply) and attention is ``4 * n_heads * head_dim * t`` per layer
  for a token that sees t keys (QK^T and the weighted sum of V; t is capped by a sliding window);
  training ~ 3x the forward (``6 N`` plus the attention term three times);
- KV-cache bytes ``2 * n_layers * n_kv_heads * head_dim * bytes`` per token, and for a context x
  batch (window layers hold at most ``window`` tokens);
- aspect ratio d_model / n_layers, d_ff / d_model;
- memory to train with AdamW in mixed precision: 16 bytes per parameter (bf16 weights 2 and
  gradients 2, fp32 master weights 4, Adam moments 4 + 4), activations not included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4, "tf32": 4,
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp8": 1, "int8": 1, "int4": 0.5,
}
ADAMW_MIXED_BYTES_PER_PARAM = 16  # bf16 weights + bf16 grads + fp32 master + fp32 m + fp32 v


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of a dtype given as a name (``bf16``, ``float32``, ``int4``) or a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def attention_kind(n_heads: int, n_kv_heads: int) -> str:
    if n_kv_heads == n_heads:
        return "MHA"
    if n_kv_heads == 1:
        return "MQA"
    return f"GQA-{n_kv_heads}"


def render(part) -> str:
    """A part as ``name(field=value, ...)``, listing the fields that differ from the part's defaults
    (nested parts rendered the same way)."""
    if part is None:
        return "-"
    fields = []
    for f in dataclasses.fields(part.config):
        value = getattr(part.config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if isinstance(default, str) and hasattr(value, "kind") and render(value) == default:
            continue
        if value == default or (hasattr(default, "kind") and hasattr(value, "kind") and render(value) == render(default)):
            continue
        if hasattr(value, "kind") and hasattr(value, "config"):
            value = render(value)
        fields.append(f"{f.name}={value}")
    return f"{part.name}({', '.join(fields)})" if fields else part.name


def _layer_facts(spec, layer_module, i: int) -> dict[str, Any]:
    att = layer_module.attention
    ffn = layer_module.ffn
    linears = [m for m in layer_module.modules() if isinstance(m, nn.Linear)]
    return {
        "kind": spec.layer_kind(i),
        "n_heads": att.n_heads,
        "n_kv_heads": att.n_kv_heads,
        "head_dim": att.head_dim,
        "window": att.window,
        "d_ff": getattr(ffn, "d_ff", None),
        "bias": any(m.bias is not None for m in linears),
    }


def account(
    model_or_name: Any,
    *,
    context: Optional[int] = None,
    batch: int = 1,
    dtype: Any = "bf16",
    overrides: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Every figure for one model (a preset name, spec or built Decoder) as plain data.

    ``context`` (default: the spec's ``max_seq_len``) and ``batch`` size the KV cache and the
    attention FLOPs; ``dtype`` is the storage type of weights and cache.
    """
    import zoo

    model = model_or_name
    if not isinstance(model, nn.Module):
        model = zoo.build(model_or_name, device="meta", overrides=overrides)
    spec = model.spec
    context = spec.max_seq_len if context is None else int(context)
    if context <= 0 or batch <= 0:
        raise ValueError(f"--context and --batch must be positive, got context={context}, batch={batch}")
    nbytes = dtype_bytes(dtype)
    layers = [_layer_facts(spec, layer, i) for i, layer in enumerate(model.layers)]

    total = model.num_parameters()
    non_embedding = model.num_parameters(exclude_embeddings=True)
    head_matrix = spec.vocab_size * spec.d_model
    matmul_params = non_embedding + head_matrix

    def seen(L: int, t: int) -> int:  # keys a token at 1-based position t attends to
        return min(t, L["window"]) if L["window"] else t

    def attn_flops(t: int) -> int:
        return sum(4 * L["n_heads"] * L["head_dim"] * seen(L, t) for L in layers)

    def attn_flops_mean(T: int) -> float:  # averaged over the T tokens of a causal sequence
        total_keys = []
        for L in layers:
            w = L["window"] or T
            w = min(w, T)
            keys = w * (w + 1) // 2 + (T - w) * w  # sum over t of min(t, w)
            total_keys.append(4 * L["n_heads"] * L["head_dim"] * keys)
        return sum(total_keys) / T

    kv_per_token = sum(2 * L["n_kv_heads"] * L["head_dim"] for L in layers) * nbytes
    kv_tokens = sum(2 * L["n_kv_heads"] * L["head_dim"] * (min(context, L["window"]) if L["window"] else context)
                    for L in layers)
    kv_total = kv_tokens * nbytes * batch

    d_ffs = {L["kind"]: L["d_ff"] for L in layers}
    ratios = {k: (v / spec.d_model if v else None) for k, v in d_ffs.items()}
    heads = {L["kind"]: attention_kind(L["n_heads"], L["n_kv_heads"]) for L in layers}
    forward_at_context = 2 * matmul_params + attn_flops(context)
    forward_mean = 2 * matmul_params + attn_flops_mean(context)
    published = None
    if isinstance(model_or_name, str):
        try:
            published = zoo.published_params(model_or_name)
        except zoo.RegistryError:
            published = None
    return {
        "name": spec.label or (model_or_name if isinstance(model_or_name, str) else None),
        "d_model": spec.d_model,
        "n_layers": spec.n_layers,
        "vocab_size": spec.vocab_size,
        "max_seq_len": spec.max_seq_len,
        "params": {
            "total": total,
            "embedding": total - non_embedding,
            "non_embedding": non_embedding,
            "published": published,
        },
        "shape": {
            "aspect_ratio": spec.d_model / spec.n_layers,
            "d_ff": d_ffs if len(set(d_ffs.values())) > 1 else next(iter(d_ffs.values())),
            "d_ff_over_d_model": ratios if len(set(ratios.values())) > 1 else next(iter(ratios.values())),
            "attention": heads if len(set(heads.values())) > 1 else next(iter(heads.values())),
            "n_heads": layers[0]["n_heads"],
            "n_kv_heads": layers[0]["n_kv_heads"],
            "head_dim": layers[0]["head_dim"],
            "windows": {L["kind"]: L["window"] for L in layers},
        },
        "flops": {
            "context": context,
            "matmul_params": matmul_params,
            "forward_per_token_2n": 2 * matmul_params,
            "attention_per_token_at_context": attn_flops(context),
            "forward_per_token_at_context": forward_at_context,
            "forward_per_token_mean": forward_mean,
            "training_per_token_6n": 6 * matmul_params,
            "training_per_token": 3 * forward_mean,
        },
        "kv_cache": {
            "dtype": str(dtype),
            "bytes_per_token": kv_per_token,
            "context": context,
            "batch": batch,
            "bytes": kv_total,
        },
        "memory": {
            "dtype": str(dtype),
            "weights_bytes": total * nbytes,
            "decode_weight_bytes_per_token": (matmul_params + spec.d_model) * nbytes,
            "adamw_mixed_precision_bytes": total * ADAMW_MIXED_BYTES_PER_PARAM,
            "inference_bytes": total * nbytes + kv_total,
        },
    }


def components(model_or_name: Any, overrides: Optional[dict[str, Any]] = None) -> list[tuple[str, str]]:
    """The model's parts as (row, value) pairs, one row per fact, layer kinds in order: the rows
    ``zoo describe`` prints and ``zoo diff`` lines up."""
    import zoo

    model = model_or_name
    if not isinstance(model, nn.Module):
        model = zoo.build(model_or_name, device="meta", overrides=overrides)
    spec = model.spec
    rows: list[tuple[str, str]] = [
        ("d_model", str(spec.d_model)),
        ("layers", str(spec.n_layers)),
        ("vocab", str(spec.vocab_size)),
        ("max_seq_len", str(spec.max_seq_len)),
        ("layer pattern", " ".join(spec.layer_pattern)),
        ("embedding", render_embedding(spec)),
    ]
    done = set()
    for i, layer in enumerate(model.layers):
        kind = spec.layer_kind(i)
        if kind in done:
            continue
        done.add(kind)
        ls = spec.layer(i)
        facts = _layer_facts(spec, layer, i)
        prefix = "" if len(spec.layers) == 1 else f"[{kind}] "
        window = f", window {facts['window']}" if facts["window"] else ""
        rows += [
            (prefix + "block", render(ls.block)),
            (prefix + "norm", render(ls.norm)),
            (prefix + "position", render(spec.position_for(i))),
            (prefix + "attention kv", attention_kind(facts["n_heads"], facts["n_kv_heads"])),
            (prefix + "heads", f"{facts['n_heads']} x {facts['head_dim']}, {facts['n_kv_heads']} kv heads{window}"),
            (prefix + "attention", render(ls.attention)),
            (prefix + "ffn", render(ls.ffn)),
            (prefix + "d_ff", f"{facts['d_ff']} ({facts['d_ff'] / spec.d_model:.3g} x d_model)" if facts["d_ff"] else "-"),
            (prefix + "linear biases", "yes" if facts["bias"] else "no"),
        ]
    rows += [
        ("final norm", render(spec.final_norm)),
        ("head", f"{'tied' if spec.head.tied else 'untied'}"
                 f"{', bias' if spec.head.bias else ''}{f', softcap {spec.head.softcap}' if spec.head.softcap else ''}"),
        ("dropout", str(spec.dropout)),
        ("z-loss", str(spec.z_loss)),
    ]
    return rows


def render_embedding(spec) -> str:
    parts = [f"scale {spec.embedding.scale}"] if spec.embedding.scale != "none" else []
    if spec.embedding.padded_vocab_size:
        parts.append(f"{spec.embedding.padded_vocab_size} rows")
    return ", ".join(parts) or "plain"
