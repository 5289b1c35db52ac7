"""Sizes a spec leaves to a rule (d_ff), resolved the way the built part resolves them."""

import torch

from zoo.core.spec import ModelSpec


def ffn_size(spec: ModelSpec, i: int = 0) -> int:
    """The FFN width of layer ``i``, as the part resolves it (its ``resolved`` settings, else the
    ``d_ff`` fact of the part built on the meta device)."""
    ffn = spec.layer(i).ffn
    settings = ffn.cls.resolved(ffn.config, spec.d_model)
    if settings is not None:
        return settings["d_ff"]
    with torch.device("meta"):
        return ffn.build(d_model=spec.d_model).facts()["d_ff"]
