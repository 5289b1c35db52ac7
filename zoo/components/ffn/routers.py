"""Routers of a mixture of experts: which experts each token goes to, with what weights."""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import ClassVar, Optional
import torch
import torch.nn.functional as F
from torch import nn
from zoo.core.kinds import Router as _RouterBase
from zoo.core.registry import register
from zoo.core.spec import SpecError, positive


@dataclass
class Routing:
    """One forward's routing of N tokens: ``logits`` and ``probs`` (N, E) in float32 (``probs``: the
    normalised scores balance losses use), the chosen ``indices`` (N, k) and their ``weights`` (N, k,
    float32, before ``norm_topk_prob`` and the routed scaling)."""

    logits: torch.Tensor
    probs: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor


class Router(_RouterBase):
    """A linear gate ``E x d_model`` applied in float32, and an optional per-expert selection bias
    (a buffer ``bias``, added to the scores only to choose experts, never to weight them).

    The bias stays float32 whatever the model's dtype (zoo/core/precision.py): its entries may differ by
    less than bfloat16 resolves near the scores they are added to, so rounding it changes the choice;
    transformers keeps DeepSeek-V3's ``e_score_correction_bias`` in float32 likewise."""

    fp32_tensors = ("bias",)

    @dataclass(frozen=True)
    class Config:
        selection_bias: bool = False

    def __init__(self, cfg, *, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.cfg, self.n_experts, self.top_k = cfg, n_experts, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        if cfg.selection_bias:
            self.register_buffer("bias", torch.zeros(n_experts))
        else:
            self.bias = None
        self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        """The gate Normal(0, ``std``) (the spec's ``init_std`` when the model initialises it), the bias 0."""
        with torch.no_grad():
            if not self.weight.is_meta:
                self.weight.normal_(0.0, std, generator=generator)
            if self.bias is not None and not self.bias.is_meta:
                self.bias.zero_()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` in float32, under autocast too (which would run the matmul in bfloat16 and
        change the choice of experts)."""
        kind = x.device.type
        with torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else contextlib.nullcontext():
            return F.linear(x.float(), self.weight.float())

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k of ``scores`` (plus the selection bias, when there is one)."""
        if self.bias is not None:
            scores = scores + self.bias.float()
        return torch.topk(scores, self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> Routing:
        raise NotImplementedError

    # -- what this part states about itself ---------------------------------------------------------
    #: Its weight is a matrix and is decayed (the selection bias is a buffer).
    no_decay = ()

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token: its input cast to float32 (the input itself in float32: its FFN counts it) and the
        float32 scores the weights and balancing losses are taken from, and the chosen indices."""
        d_model = self.weight.shape[1]
        return (4 * d_model if dtype.itemsize != 4 else 0) + 2 * 4 * self.n_experts + 8 * self.top_k

    @classmethod
    def check_experts(cls, cfg, n_experts: int, top_k: int) -> None:
        """Refuse settings that do not fit ``n_experts`` and ``top_k`` (SpecError naming the field)."""

    @staticmethod
    def shrink_to(cfg, n_experts: int) -> dict:
        return {}


@register("router", "softmax_topk")
class SoftmaxTopK(Router):
    """Softmax over all experts, then the top-k probabilities (Qwen-MoE, OLMoE, Switch)."""

    def forward(self, x):
        logits = self.logits(x)
        probs = logits.softmax(-1)
        idx = self.choose(probs)
        return Routing(logits, probs, idx, probs.gather(-1, idx))


@register("router", "topk_softmax")
class TopKSoftmax(Router):
    """Top-k logits, then a softmax over those k (Mixtral, DBRX): the weights sum to one."""

    def forward(self, x):
        logits = self.logits(x)
        idx = self.choose(logits)
        return Routing(logits, logits.softmax(-1), idx, logits.gather(-1, idx).softmax(-1))


def _group_mask(scores: torch.Tensor, n_groups: int, topk_group: int, reduce: str) -> torch.Tensor:
    """(N, E) true for the experts of each token's ``topk_group`` best groups; a group's score is its
    best expert's (``max``) or the sum of its best two (``top2``)."""
    N, E = scores.shape
    grouped = scores.view(N, n_groups, E // n_groups)
    best = grouped.max(-1).values if reduce == "max" else grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(topk_group, dim=-1).indices, True)
    return keep[:, :, None].expand(N, n_groups, E // n_groups).reshape(N, E)


class _Grouped(Router):
    @dataclass(frozen=True)
    class Config:
        n_groups: int = 1
        topk_group: int = 1
        selection_bias: bool = False

        def check(self):
            positive("n_groups", self.n_groups, allow_none=False)
            positive("topk_group", self.topk_group, allow_none=False)
            if self.topk_group > self.n_groups:
                raise SpecError("topk_group", f"{self.topk_group} groups of {self.n_groups} cannot be chosen")

    group_score: ClassVar[str] = "max"

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        choice = scores + self.bias.float() if self.bias is not None else scores
        keep = _group_mask(choice, self.cfg.n_groups, self.cfg.topk_group, self.group_score)
        return torch.topk(choice.masked_fill(~keep, float("-inf")), self.top_k, dim=-1).indices

    # -- what this part states about itself ---------------------------------------------------------
    @classmethod
    def check_experts(cls, cfg, n_experts, top_k):
        if n_experts % cfg.n_groups:
            raise SpecError("n_groups", f"{cfg.n_groups} groups do not divide {n_experts} experts")
        per_group = n_experts // cfg.n_groups
        if cls.group_score == "top2" and per_group < 2:
            raise SpecError("n_groups", f"each group needs two experts to score it, got {per_group}")
        if top_k > cfg.topk_group * per_group:
            raise SpecError("topk_group", f"{cfg.topk_group} groups of {per_group} experts hold fewer than top_k = {top_k}")

    @staticmethod
    def shrink_to(cfg, n_experts):
        groups = min(cfg.n_groups, n_experts // 2)
        return {"n_groups": groups, "topk_group": min(cfg.topk_group, groups)}


@register("router", "sigmoid_group")
class SigmoidGroup(_Grouped):
    """DeepSeek-V3: sigmoid scores; the selection bias is added to choose; groups are scored by the
    sum of their two best biased scores; top-k among the ``topk_group`` best groups; weights are the
    unbiased scores of the chosen (normalise them with the FFN's ``norm_topk_prob``)."""

    @dataclass(frozen=True)
    class Config(_Grouped.Config):
        selection_bias: bool = True

    group_score = "top2"

    def forward(self, x):
        logits = self.logits(x)
        scores = logits.sigmoid()
        idx = self.select(scores)
        return Routing(logits, scores / scores.sum(-1, keepdim=True), idx, scores.gather(-1, idx))


@register("router", "greedy_group")
class GreedyGroup(_Grouped):
    """DeepSeek-V2's group-limited greedy routing: softmax scores; groups scored by their best
    expert; top-k among the ``topk_group`` best groups."""

    def forward(self, x):
        logits = self.logits(x)
        probs = logits.softmax(-1)
        idx = self.select(probs)
        return Routing(logits, probs, idx, probs.gather(-1, idx))
