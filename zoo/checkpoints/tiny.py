"""Tiny random checkpoints made by transformers itself (needs the ``reference`` extra): the
offline material for ``zoo verify --tiny`` and the parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from zoo.core import registry as _registry


def tiny_formats() -> list[str]:
    """The model_types whose format carries a tiny config that transformers can build (a format whose
    ``transformers_reference`` is False, such as DeepSeekMoE's remote-code ``deepseek``, is checked
    against a reference of its own in its tests instead)."""
    return [e.name for e in _registry.registry("checkpoint_format").entries()
            if getattr(e.obj, "tiny", None) and getattr(e.obj, "transformers_reference", True)]


def tiny_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    fmt = _registry.get("checkpoint_format", model_type)
    # Token ids inside the tiny vocabulary (the defaults of real models are not).
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, **fmt.tiny, **overrides}


def make_tiny(model_type: str, directory: str | Path, *, seed: int = 0, std: float = 0.25,
              overrides: Optional[dict[str, Any]] = None, **save_kw: Any):
    """Build a random transformers model of ``model_type`` from its tiny config, save it with
    ``save_pretrained`` and return it. Every parameter (norms and biases too) is drawn from
    N(0, std) around its initial value, so no weight is left at a trivially symmetric value; so are
    the buffers the format names in ``random_buffers`` (by the end of their name): those that hold
    free values, such as DeepSeek-V3's ``e_score_correction_bias``, not tables derived from others."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **tiny_config(model_type, **(overrides or {})))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
        free = tuple(getattr(_registry.get("checkpoint_format", model_type), "random_buffers", ()))  # plugin formats may lack it
        for name, b in model.named_buffers():
            if free and name.endswith(free):
                b.add_(torch.randn(b.shape, generator=gen) * std)
    model.eval()
    model.save_pretrained(str(directory), **save_kw)
    return model
