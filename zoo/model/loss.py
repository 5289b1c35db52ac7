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

    ``labels`` are aligned with ``logits`` (position t predicts labels[t]); shift before calling. The
    logits are taken to float32 at least (a float64 model's loss stays float64).
    """
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    target = labels.reshape(-1)
    valid = target != ignore_index
    ce = F.cross_entropy(flat, target, ignore_index=ignore_index)
    log_z = torch.logsumexp(flat, dim=-1)
    z = (log_z.pow(2) * valid).sum() / valid.sum().clamp(min=1)
    return LossOutput(loss=ce + z_loss * z if z_loss else ce, ce=ce, z=z)


def vocab_parallel_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    start: int,
    tp_mesh,
    z_loss: float = 0.0,
    ignore_index: int = -100,
) -> LossOutput:
    """:func:`lm_loss` on logits sharded by vocabulary (tensor parallelism): ``logits`` hold this
    process's columns ``start, start + 1, ...`` of the whole sequence. Only the per-token
    log-partitions and target logits cross the processes (a gather of one float per token and
    process, and a sum), never the logits, and each process's gradient reaches its own columns. Every
    process of ``tp_mesh`` returns the same loss."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    target = labels.reshape(-1)
    valid = target != ignore_index
    local = torch.logsumexp(flat, dim=-1, keepdim=True)  # (N, 1): this process's share of log Z
    log_z = torch.logsumexp(DTensor.from_local(local, tp_mesh, [Shard(1)], run_check=False).full_tensor(), dim=-1)
    mine = valid & (target >= start) & (target < start + flat.shape[-1])
    picked = torch.where(mine, flat.gather(1, torch.where(mine, target - start, 0).unsqueeze(1)).squeeze(1), 0.0)
    target_logit = DTensor.from_local(picked, tp_mesh, [Partial()], run_check=False).full_tensor()
    count = valid.sum()
    ce = ((log_z - target_logit) * valid).sum() / count
    z = (log_z.pow(2) * valid).sum() / count.clamp(min=1)
    return LossOutput(loss=ce + z_loss * z if z_loss else ce, ce=ce, z=z)
