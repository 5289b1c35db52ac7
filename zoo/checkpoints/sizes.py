"""Sizes a spec leaves to a rule (d_ff), resolved the way the built part resolves them."""

import torch

from zoo.spec import ModelSpec


def ffn_size(spec: ModelSpec, i: int = 0) -> int:
    """The FFN width of layer ``i`` (resolving a d_ff rule by building the part on the meta device)."""
    with torch.device("meta"):
        return spec.layer(i).ffn.build(d_model=spec.d_model).d_ff
