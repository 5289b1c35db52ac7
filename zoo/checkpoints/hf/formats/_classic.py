"""Shared pieces of the LayerNorm-era formats (gpt2, gpt_neox, gptj, falcon)."""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.hf.format import Fields


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


def layernorm_eps(key: str):
    """The LayerNorms' eps (every layer's and the final one) under ``key``."""
    from zoo.checkpoints.hf.fields import Field

    return Field(key, ("layer.norm.eps", "final_norm.eps"), 1e-5, to_spec=float)


#: The LayerNorm-era template: LayerNorms with biases in every layer and at the end.
LAYERNORM_TEMPLATE = {"layer": {"norm": {"name": "layernorm", "bias": True}},
                      "final_norm": {"name": "layernorm", "bias": True}}
