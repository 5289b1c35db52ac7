"""The score hook of attention: what an attention does to its scores between ``q . k`` and the
softmax, stated once and honoured by every path (eager, SDPA with a mask, FlexAttention).

An attention variant (learned sinks, a soft-cap, a temperature, chunked local attention, a
per-position query temperature) is :class:`~zoo.components.mixers.attention.Attention` with its
``scores()`` hook returning a :class:`Scores`; the paths read nothing else, so the variant keeps
SDPA, FlexAttention, the decode state and the tensor-parallel plan. The order, on every path::

    q      = q * query_scale(positions)                    (per query position, after RoPE)
    score  = (q . k) * scale                               (scale: ``scale_dim ** -0.5``)
    score  = score_mod(score, b, h, q_slot, k_slot)        (flex-style, elementwise)
    score  = score + bias                                  (a bias position encoding: ALiBi)
    seen   = k_slot <= q_slot, and q_slot - k_slot < window, and in one chunk, and mask_mod(...), and
             the key is no padding (a query that then sees nothing sees every key, as padding rows do)
    p      = softmax over the seen keys and one more term exp(sink[h]) in the denominator, then the
             sink's own probability dropped (it weighs no value)
    out    = p @ v

Which path runs what: eager computes the scores and runs all of it. SDPA runs everything but a
``score_mod``: a sink as one more key of zeros whose mask entry is the sink's logit, masks and
chunks as a dense boolean mask (``scaled_dot_product_attention`` with ``attn_mask``);
:meth:`Attention.kernel_problem` sends a ``score_mod`` to FlexAttention (CUDA) or eager.
FlexAttention runs the ``score_mod`` and ``mask_mod`` as its own, the window and chunks as block
sparsity, and a sink by rescaling its output with its log-sum-exp (``out * sigmoid(lse - sink)``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from zoo.components.stability import softcap

#: ``score_mod(score, b, h, q, k) -> score``: FlexAttention's signature, with ``q`` and ``k`` the
#: query's and key's slots (their absolute places in the sequence, left padding included; the ones
#: the causal mask compares), not indices into the tensors. ``b`` and ``h`` index the batch row and
#: this process's query heads. It must be elementwise: the eager path calls it once on whole
#: broadcastable tensors (score (B, H, Tq, Tk), b (B, 1, 1, 1), h (1, H, 1, 1), q (1, 1, Tq, 1),
#: k (1, 1, 1, Tk)), FlexAttention on scalars.
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``mask_mod(b, h, q, k) -> bool``: which keys a query may also see beyond the causal, window and
#: chunk rules (the same arguments as a ``score_mod``, no score). It must leave each query its own
#: key; masks are cached by the function's identity, so return the same object every forward.
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Scores:
    """What an attention does to its scores (the module docstring gives the order and the paths).

    - ``score_mod``: an elementwise change of the scaled scores (:data:`ScoreMod`): a soft-cap
      (:func:`softcapped`), a temperature (``lambda s, b, h, q, k: s / t``). SDPA cannot run one.
    - ``mask_mod``: a further restriction of what a query sees (:data:`MaskMod`).
    - ``window``: a causal sliding window, ``q - k < window`` (the decode state keeps a ring of it).
    - ``chunk``: chunked local attention (Llama 4's ``attention_chunk_size``): a query sees only keys
      of its own chunk of ``chunk`` slots, counted from the row's first real (non-padding) key.
    - ``sink``: one logit per query head, (H,) (this process's heads), added to the softmax's
      denominator and dropped (gpt-oss's learned sinks). It may be a parameter: it gets its gradient.
    - ``query_scale``: ``fn(positions) -> multipliers`` of the queries, (B, Tq) from the (B or 1, Tq)
      positions the position encoding sees (padding skipped, so a padded row computes what it computes
      alone); Llama 4's NoPE layers scale queries by a log-position temperature.
    """

    score_mod: Optional[ScoreMod] = None
    mask_mod: Optional[MaskMod] = None
    window: Optional[int] = None
    chunk: Optional[int] = None
    sink: Optional[torch.Tensor] = None
    query_scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def but(self, **changes) -> "Scores":
        """A copy with ``changes`` (``dataclasses.replace``): ``super().scores().but(sink=self.sinks)``."""
        return replace(self, **changes)

    def then(self, score_mod: ScoreMod) -> "Scores":
        """A copy whose ``score_mod`` runs ``score_mod`` after this one's (a temperature after a soft-cap)."""
        first = self.score_mod
        if first is None:
            return replace(self, score_mod=score_mod)
        return replace(self, score_mod=lambda s, b, h, q, k: score_mod(first(s, b, h, q, k), b, h, q, k))

    @property
    def masked(self) -> bool:
        """Whether a query sees less than every earlier key beyond the window (a chunk or a mask_mod)."""
        return self.chunk is not None or self.mask_mod is not None


@functools.lru_cache(maxsize=None)
def softcapped(cap: float) -> ScoreMod:
    """The ``score_mod`` of tanh soft-capping, ``cap * tanh(score / cap)`` (Gemma 2, Grok-1): the one
    soft-cap (:func:`zoo.components.stability.softcap`); one function object per cap."""

    def score_mod(score, b, h, q, k):
        return softcap(score, cap)

    return score_mod


def chunk_offsets(k_idx: torch.Tensor, key_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(B,) the first real key's slot of each row (chunks count from it), or None without padding."""
    if key_mask is None:
        return None
    far = torch.iinfo(k_idx.dtype).max
    return torch.where(key_mask.bool(), k_idx[None, :], far).amin(-1).clamp(max=int(k_idx.max()))


def chunk_index(slot: torch.Tensor, chunk: int, offset=None) -> torch.Tensor:
    """The chunk of ``chunk`` slots that ``slot`` falls in, counted from ``offset`` (None: slot 0)."""
    return torch.div(slot if offset is None else slot - offset, chunk, rounding_mode="floor")


def same_chunk(q: torch.Tensor, k: torch.Tensor, chunk: int, offset=None) -> torch.Tensor:
    """Whether slots ``q`` and ``k`` fall in one chunk of ``chunk`` slots counted from ``offset``."""
    return chunk_index(q, chunk, offset) == chunk_index(k, chunk, offset)


def scale_queries(q: torch.Tensor, scores: Scores, positions: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, D) queries times ``query_scale(positions)`` (B or 1, Tq) per query (in the
    multiplier's dtype, cast back), or ``q`` itself."""
    if scores.query_scale is None:
        return q
    scale = scores.query_scale(positions)
    scale = scale[None] if scale.dim() == 1 else scale
    return (q * scale.view(scale.shape[0], 1, -1, 1)).to(q.dtype)


def grid(B: int, H: int, q_idx: torch.Tensor, k_idx: torch.Tensor):
    """(b, h, q, k) as broadcastable tensors for an elementwise ``score_mod``/``mask_mod`` on (B, H, Tq, Tk)."""
    dev = q_idx.device
    return (torch.arange(B, device=dev).view(-1, 1, 1, 1), torch.arange(H, device=dev).view(1, -1, 1, 1),
            q_idx.view(1, 1, -1, 1), k_idx.view(1, 1, 1, -1))
