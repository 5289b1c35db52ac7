"""Stability tricks that are functions of a tensor: soft-capping (Gemma 2) and z-loss (PaLM).

QK-norm lives in the attention part, embedding scaling in the spec's ``embedding.scale``.
"""

import torch

from zoo.registry import register


@register("stability", "softcap")
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: smooth, odd, identity near 0, bounded by ``cap``."""
    return cap * torch.tanh(x / cap)


@register("stability", "z_loss")
def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean of ``log(Z)^2`` over positions, with ``Z`` the softmax normaliser (PaLM's auxiliary loss)."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
