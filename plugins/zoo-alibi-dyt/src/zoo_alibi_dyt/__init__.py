"""ALiBi attention biases and Dynamic Tanh, registered into zoo through the ``zoo.plugins`` entry point."""

import math
from dataclasses import dataclass

import torch
from torch import nn

import zoo
from zoo.core.kinds import PositionEncoding


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """Per-head slopes: ``2^(-max_bias * h / n)`` for h = 1..n when n is a power of two; otherwise
    those of the nearest lower power of two followed by every other slope of the next one (as in
    the paper's code)."""
    def geometric(n):
        return [2 ** (-max_bias * h / n) for h in range(1, n + 1)]

    low = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(low) + geometric(2 * low)[0::2][: n_heads - low]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(PositionEncoding):
    """Attention with Linear Biases: score(i, j) += -m_h * (i - j). No embedding, no rotation."""

    applies_to = "bias"

    @dataclass(frozen=True)
    class Config:
        max_bias: float = 8.0

        def check(self):
            if self.max_bias <= 0:
                raise zoo.SpecError("max_bias", f"must be positive, got {self.max_bias}")

    def __init__(self, cfg: Config, *, spec=None, layer=None):
        super().__init__()
        self.cfg = cfg

    def parallelize(self, tp_mesh, **kw):
        """Tensor parallelism: nothing to shard; attention asks for the bias of the heads it holds, the
        ``rank``-th slice of every head's slopes."""
        self._tp_mesh = tp_mesh

    def score_bias(self, state, q_idx, k_idx, n_heads):
        mesh = getattr(self, "_tp_mesh", None)
        tp, rank = (mesh.size(), mesh.get_local_rank()) if mesh is not None else (1, 0)
        slopes = alibi_slopes(n_heads * tp, self.cfg.max_bias)[rank * n_heads: (rank + 1) * n_heads].to(q_idx.device)
        distance = (q_idx[:, None] - k_idx[None, :]).float()  # (Tq, Tk), slots: padding keeps distances
        return (-slopes[:, None, None] * distance)[None]  # (1, H, Tq, Tk)


class DyT(nn.Module):
    """Dynamic Tanh: ``weight * tanh(alpha * x) + bias``, a norm replacement with no statistics."""

    @dataclass(frozen=True)
    class Config:
        alpha_init: float = 0.5
        bias: bool = True

        def check(self):
            if self.alpha_init <= 0:
                raise zoo.SpecError("alpha_init", f"must be positive, got {self.alpha_init}")

    def __init__(self, cfg: Config, *, dim: int):
        super().__init__()
        self.cfg = cfg
        self.alpha = nn.Parameter(torch.full((1,), cfg.alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if cfg.bias else None

    def reset_parameters(self):
        nn.init.constant_(self.alpha, self.cfg.alpha_init)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        y = torch.tanh(self.alpha * x) * self.weight
        return y + self.bias if self.bias is not None else y


@zoo.hookimpl
def zoo_register(registry):
    registry.add_position("alibi", ALiBi)
    registry.add_norm("dyt", DyT)
