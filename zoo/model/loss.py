"""The language-model loss: cross-entropy with an optional z-loss, and the loss output that carries
the auxiliary losses and metrics parts add."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
import torch
import torch.nn.functional as F


@dataclass
class LossOutput:
    loss: torch.Tensor  # cross-entropy + z_loss * z + the weighted auxiliary losses
    ce: torch.Tensor  # mean token cross-entropy
    z: torch.Tensor  # mean squared log-partition log(Z)^2 (what z-loss penalises)
    logits: Optional[torch.Tensor] = None
    # Named auxiliary losses the parts added during the forward (unweighted; ``loss`` includes each
    # times its weight, given in ``aux_weights``), and metrics they recorded.
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    aux_weights: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def terms(self) -> dict[str, torch.Tensor]:
        """Every scalar to log, by name: loss, ce, z, each auxiliary loss and each metric."""
        return {"loss": self.loss, "ce": self.ce, "z": self.z, **self.aux, **self.metrics}


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    z_loss: float = 0.0,
    ignore_index: int = -100,
) -> LossOutput:
    """Next-token cross-entropy with optional z-loss (PaLM): ``ce + z_loss * mean(log(Z)^2)``.

    ``labels`` are aligned with ``logits`` (position t predicts labels[t]); shift before calling.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    target = labels.reshape(-1)
    valid = target != ignore_index
    ce = F.cross_entropy(flat, target, ignore_index=ignore_index)
    log_z = torch.logsumexp(flat, dim=-1)
    z = (log_z.pow(2) * valid).sum() / valid.sum().clamp(min=1)
    return LossOutput(loss=ce + z_loss * z if z_loss else ce, ce=ce, z=z)
