"""Resource accounting: what a model costs, computed from its spec on the meta device (no memory,
about a second even for a 405B model).

The formulas are the lecture notes' (see docs/reference/accounting.md); each part reports its own share
(``cost(context)`` and ``facts()``, see zoo.core.kinds), and this module only adds them up:

- parameters, split into embedding (token embeddings, an untied output head, learned positions)
  and non-embedding, and the active ones (a part that uses fewer per token says how many);
- forward FLOPs per token ``2 N + mixing``, where N counts every weight a token is multiplied by
  (the non-embedding parameters plus the output head's vocab x d_model matrix, tied or not; an
  embedding lookup is not a multiply; only active weights) and mixing is what each token mixer
  reports: for attention ``4 * n_heads * head_dim * t`` per layer for a token that sees t keys
  (QK^T and the weighted sum of V; t is capped by a sliding window); training ~ 3x the forward
  (``6 N`` plus the mixing term three times);
- decode-state bytes per token and for a context x batch, as each mixer reports them: attention's
  KV cache is ``2 * n_kv_heads * head_dim * bytes`` per token and layer (window layers hold at most
  ``window`` tokens); a recurrent mixer's state is fixed;
- aspect ratio d_model / n_layers, d_ff / d_model;
- memory to train with AdamW in mixed precision: 16 bytes per parameter (bf16 weights 2 and
  gradients 2, fp32 master weights 4, Adam moments 4 + 4), activations not included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from zoo.core.deprecations import warn
from zoo.core.kinds import Cost, is_part

DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4, "tf32": 4,
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp8": 1, "int8": 1, "int4": 0.5,
}
ADAMW_MIXED_BYTES_PER_PARAM = 16
#: The three ways active parameters per token are counted, and whose headline numbers use each.
ACTIVE_CONVENTIONS = {
    "with_embeddings_and_head": "Mistral (Mixtral 8x7B: 12.9B), Qwen (Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, "
                                "Qwen3-235B-A22B) and OLMoE (1.3B) quote this",
    "without_input_embedding": "the input lookup multiplies nothing, the head does: the weights a token's "
                               "FLOPs come from (2N)",
    "without_embeddings_and_head": "Kaplan et al.'s non-embedding count, which scaling laws use",
}  # bf16 weights + bf16 grads + fp32 master + fp32 m + fp32 v


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of a dtype given as a name (``bf16``, ``float32``, ``int4``) or a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


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


def _part_cost(module: nn.Module, context: int) -> Cost:
    return module.cost(context) if is_part(module) else Cost()  # torch's own modules inside a part state nothing


def _facts(module: nn.Module) -> dict[str, Any]:
    return dict(module.facts()) if is_part(module) else {}  # a block without an FFN has None


def layer_facts(layer: nn.Module) -> dict[str, Any]:
    """What a layer's parts report about themselves (the mixer's heads and window, the FFN's width...)."""
    return {**_facts(layer.mixer), **_facts(layer.ffn)}


def _per_kind(values: dict[str, Any], kinds: int) -> Any:
    """One value when all ``kinds`` layer kinds report the same, else the value of each kind that reports."""
    same = len(values) == kinds and len(set(map(repr, values.values()))) == 1
    return next(iter(values.values())) if same else values


def _build(model_or_name: Any, overrides: Optional[dict[str, Any]]) -> nn.Module:
    if isinstance(model_or_name, nn.Module):
        return model_or_name
    from zoo.model.decoder import build_model
    from zoo.model.recipes import get_spec

    return build_model(get_spec(model_or_name, overrides), device="meta")


def account(
    model_or_name: Any,
    *,
    context: Optional[int] = None,
    batch: int = 1,
    dtype: Any = "bf16",
    overrides: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Every figure for one model (a preset name, spec or built Decoder) as plain data.

    ``context`` (default: the spec's ``max_seq_len``) and ``batch`` size the decode state and the
    token-mixing FLOPs; ``dtype`` is the storage type of weights and state. Each figure is the sum
    of what each part reports about itself (``cost(context)``: active parameters, mixing FLOPs,
    decode state); nothing here reads a part's attributes.
    """
    from zoo.model.recipes import published_params
    from zoo.core.registry import RegistryError

    model = _build(model_or_name, overrides)
    spec = model.spec
    context = spec.max_seq_len if context is None else int(context)
    if context <= 0 or batch <= 0:
        raise ValueError(f"--context and --batch must be positive, got context={context}, batch={batch}")
    nbytes = dtype_bytes(dtype)

    total = model.num_parameters()
    non_embedding = model.num_parameters(exclude_embeddings=True)
    # Each part's cost, asked once. Parts that use only some of their parameters per token (a mixture
    # of experts) say how many.
    # (The multi-token prediction modules, if any, are left out: they are counted apart, under "mtp".)
    mtp = set(model.mtp.modules()) if getattr(model, "mtp", None) is not None else set()
    part_costs = {m: _part_cost(m, context) for m in model.modules() if m is not model and m not in mtp}
    inactive = sum(sum(p.numel() for p in m.parameters()) - c.active_params
                   for m, c in part_costs.items() if c.active_params is not None)
    input_embedding = model.embed.weight.numel()
    head_matrix = spec.vocab_size * spec.d_model
    matmul_params = non_embedding + head_matrix
    active_matmul = matmul_params - inactive

    costs = [part_costs[layer.mixer] for layer in model.layers]
    mixing_at_context = sum(c.flops for c in costs)
    mixing_mean = sum(c.flops_mean for c in costs)
    state_per_token = sum(c.state_per_token for c in costs) * nbytes
    state_fixed = sum(c.state_fixed for c in costs) * nbytes
    state_total = (sum(c.state_at_context for c in costs) * nbytes + state_fixed) * batch

    facts: dict[str, dict[str, Any]] = {}
    for i, layer in enumerate(model.layers):
        for key, value in layer_facts(layer).items():
            facts.setdefault(key, {})[spec.layer_kind(i)] = value
    d_ffs = facts.pop("d_ff", {spec.layer_kind(0): None})
    ratios = {k: (v / spec.d_model if v else None) for k, v in d_ffs.items()}
    forward_at_context = 2 * active_matmul + mixing_at_context
    forward_mean = 2 * active_matmul + mixing_mean
    published = None
    if isinstance(model_or_name, str):
        try:
            published = published_params(model_or_name)
        except RegistryError:
            published = None
    # A mixer that caches less than multi-head attention would (MLA) says what MHA would need.
    mha = [layer_facts(layer).get("mha_state_per_token") for layer in model.layers]
    decode_state = {
        "dtype": str(dtype),
        "bytes_per_token": state_per_token,
        "mha_bytes_per_token": sum(mha) * nbytes if all(mha) else None,
        "fixed_bytes": state_fixed * batch,
        "context": context,
        "batch": batch,
        "bytes": state_total,
    }
    return _Account({
        "name": spec.label or (model_or_name if isinstance(model_or_name, str) else None),
        "d_model": spec.d_model,
        "n_layers": spec.n_layers,
        "vocab_size": spec.vocab_size,
        "max_seq_len": spec.max_seq_len,
        "params": {
            "total": total,
            "embedding": total - non_embedding,
            "non_embedding": non_embedding,
            "active": total - inactive,
            # Vendors quote active parameters three ways (see ACTIVE_CONVENTIONS).
            "active_conventions": {
                "with_embeddings_and_head": total - inactive,
                "without_input_embedding": total - inactive - (0 if spec.head.tied else input_embedding),
                "without_embeddings_and_head": non_embedding - inactive,
            },
            "published": published,
            # The multi-token prediction modules (zoo/model/mtp.py), not in the figures above (used in
            # training and for drafting only).
            "mtp": model.num_parameters(mtp=True) - total if mtp else 0,
        },
        "shape": {
            "aspect_ratio": spec.d_model / spec.n_layers,
            "d_ff": _per_kind(d_ffs, len(spec.layers)),
            "d_ff_over_d_model": _per_kind(ratios, len(spec.layers)),
            **{key: _per_kind(values, len(spec.layers)) for key, values in facts.items()},
        },
        "flops": {
            "context": context,
            "matmul_params": matmul_params,
            "active_matmul_params": active_matmul,
            "forward_per_token_2n": 2 * active_matmul,
            "mixing_per_token_at_context": mixing_at_context,
            "forward_per_token_at_context": forward_at_context,
            "forward_per_token_mean": forward_mean,
            "training_per_token_6n": 6 * active_matmul,
            "training_per_token": 3 * forward_mean,
        },
        # What decoding keeps: keys and values for attention, fixed states for recurrent mixers.
        "decode_state": decode_state,
        "kv_cache": decode_state,  # the name before mixers
        "memory": {
            "dtype": str(dtype),
            "weights_bytes": total * nbytes,
            "decode_weight_bytes_per_token": (active_matmul + spec.d_model) * nbytes,
            "adamw_mixed_precision_bytes": total * ADAMW_MIXED_BYTES_PER_PARAM,
            "inference_bytes": total * nbytes + state_total,
        },
    })


def components(model_or_name: Any, overrides: Optional[dict[str, Any]] = None) -> list[tuple[str, str]]:
    """The model's parts as (row, value) pairs, one row per fact, layer kinds in order: the rows
    ``zoo describe`` prints and ``zoo diff`` lines up. Each layer's facts are what its parts report."""
    model = _build(model_or_name, overrides)
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
        prefix = "" if len(spec.layers) == 1 else f"[{kind}] "
        rows += [
            (prefix + "block", render(ls.block)),
            (prefix + "norm", render(ls.norm)),
            (prefix + "position", render(spec.position_for(i))),
            (prefix + "mixer", render(ls.mixer)),
        ]
        rows += [(prefix + key, str(value)) for key, value in _facts(layer.mixer).items() if value is not None]
        rows.append((prefix + "ffn", render(ls.ffn) if layer.ffn is not None else "none (the block has none)"))
        for key, value in _facts(layer.ffn).items():
            if key == "d_ff" and value:
                value = f"{value} ({value / spec.d_model:.3g} x d_model)"
            rows.append((prefix + key, str(value)))
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        rows.append((prefix + "linear biases", "yes" if any(m.bias is not None for m in linears) else "no"))
    rows += [
        ("final norm", render(spec.final_norm)),
        ("head", f"{'tied' if spec.head.tied else 'untied'}"
                 f"{', bias' if spec.head.bias else ''}{f', logits x {spec.head.scale:g}' if spec.head.scale else ''}"
                 f"{f', softcap {spec.head.softcap}' if spec.head.softcap else ''}"),
        ("dropout", str(spec.dropout)),
        ("z-loss", str(spec.z_loss)),
    ]
    if spec.mtp is not None:
        from zoo.model.mtp import mtp_layer_kinds

        kinds = mtp_layer_kinds(spec)
        rows.append(("mtp", f"depth {spec.mtp.depth}, weight {spec.mtp.weight}, "
                            f"{'block of layer kind' if len(kinds) == 1 else 'blocks of layer kinds'} "
                            f"{', '.join(map(repr, kinds))}"))
    return rows


def render_embedding(spec) -> str:
    parts = [f"scale {spec.embedding.scale}"] if spec.embedding.scale != "none" else []
    if spec.embedding.padded_vocab_size:
        parts.append(f"{spec.embedding.padded_vocab_size} rows")
    return ", ".join(parts) or "plain"


class _Account(dict):
    """The account; its ``kv_cache`` key, the name of ``decode_state`` before mixers, warns when read."""

    def __getitem__(self, key):
        if key == "kv_cache":
            warn("accounting key 'kv_cache'")
        return super().__getitem__(key)
