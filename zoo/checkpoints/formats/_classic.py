"""Shared pieces of the LayerNorm-era formats (gpt2, gpt_neox, gptj, falcon)."""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.format import Fields


def aliases(config: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Older spellings of a field (``n_head`` for ``num_attention_heads``...) read as the current one."""
    out = dict(config)
    for old, new in names.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    return out


def layernorm(f: Fields, key: str, bias: bool = True) -> dict[str, Any]:
    return {"name": "layernorm", "eps": float(f.get(key, 1e-5)), "bias": bias}


def linear_rules(hf: str, zoo: str, transform=None):
    from zoo.checkpoints.maps import IDENTITY, rule

    return [rule(f"{hf}.{w}", f"{zoo}.{w}", transform or IDENTITY) for w in ("weight", "bias")]
