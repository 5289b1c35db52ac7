"""Stability tricks that are functions of a tensor: soft-capping (Gemma 2), the one soft-cap that
the head, attention's scores and the flex-attention kernel all use.

QK-norm lives in the attention part, embedding scaling in the spec's ``embedding.scale``, and
z-loss (PaLM) in the model's loss (``zoo.lm_loss``, and the fused loss kernel beside it).
"""

import torch

from zoo.core.registry import register


@register("stability", "softcap")
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: smooth, odd, identity near 0, bounded by ``cap``."""
    return cap * torch.tanh(x / cap)

