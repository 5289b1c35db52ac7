"""DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer picks, for each query, the
``topk`` keys that attention then reads; everything else is masked out.

The indexer has its own small heads. Its queries come from MLA's query latent (``q_lora_rank``
wide), its single key per token from the hidden state through a LayerNorm; the leading
``rope_dim`` dimensions of both are rotated (half-split pairs, whatever layout the main attention
uses), and the score of key ``s`` for query ``t`` is

    I[t, s] = sum_h  w_h(x_t) * relu(q_{t,h} . k_s / sqrt(head_dim)),   w(x) = W_w x / sqrt(n_heads)

computed in float32 (or the activations' dtype where that is wider: float64 for a reference) (``index_rope_layout = "pairs_to_half"``: the rotated dimensions are read as
interleaved pairs and written half-split first, as GLM-5's indexer does). Selection is the top ``topk`` of ``I[t, :]`` among the keys the query may see
(causal, not padding); ties at the cut (ReLU makes exact zeros common) go to the earlier key.

Its decode state, :class:`IndexKeys`, holds one ``head_dim``-wide key per token per layer beside
the attention's own cache.

A layer may also share its selection (GLM-5's IndexShare, arXiv:2603.12201): with ``indexer =
"shared"`` it has no indexer of its own and attends to the keys the nearest earlier ``"full"`` layer
selected for the same queries (through a chain of shared layers). That selection crosses layers in
the forward context (``ctx.slot(Selections)``, one entry per full layer a shared layer reads), so
a decode step carries it from the full layer to its sharers exactly as a full forward does; the
shared layer's decode state is MLA's alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core.kinds import Cost, LayerState
from zoo.core.parallel import grad_summed
from zoo.core.registry import register
from zoo.core.precision import compute_dtype
from zoo.core.spec import SpecError, positive

from zoo.components.mixers._masks import dense_mask
from zoo.components.mixers.mla import MLA


def check_topk(topk: int, field: str = "index_topk") -> None:
    if not isinstance(topk, int) or isinstance(topk, bool) or topk <= 0:
        raise SpecError(field, f"must be a positive number of keys per query, got {topk!r}")


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """float32, or ``dtype`` where it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x`` as half-split pairs (i, i + d/2) by
    the per-pair angles whose cosines and sines are given; the rest passes through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class LightningIndexer(nn.Module):
    """The indexer of one layer: ``n_heads`` heads of ``head_dim``, a key per token, top-``topk``.

    Weights (DeepSeek's names): ``wq_b`` (q latent -> heads), ``wk`` (hidden -> key), ``k_norm``
    (a LayerNorm with bias, eps 1e-6), ``weights_proj`` (hidden -> one weight per head). With
    ``interleaved`` the rotated dimensions pair (2i, 2i + 1) and come out half-split.
    """

    def __init__(self, *, d_model: int, q_dim: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 interleaved: bool = False):
        super().__init__()
        self.interleaved = interleaved
        check_topk(topk)
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise SpecError("index_head_dim", f"{head_dim} must hold the rotated part of {rope_dim} dims (even)")
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def reset_parameters(self):
        self.k_norm.reset_parameters()

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> the keys (B, T, head_dim); ``cos``/``sin`` per pair, (B, T, rope_dim/2)."""
        return self.rotate(self.k_norm(self.wk(x)), cos, sin)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # pairs (2i, 2i + 1) of the rotated part, written half-split
            r = self.rope_dim
            x = torch.cat([x[..., 0:r:2], x[..., 1:r:2], x[..., r:]], dim=-1)
        return rotate_half_pairs(x, cos, sin)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index scores (B, Tq, Tk) in float32 (at least) of the queries at ``x``/``q_latent`` against ``keys``
        (B, Tk, head_dim), before any mask."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        q = self.rotate(q, cos[:, :, None], sin[:, :, None])
        wide = at_least_fp32(x.dtype)
        logits = torch.einsum("bthd,bsd->bths", q.to(wide), keys.to(wide)) * self.head_dim ** -0.5
        w = self.weights_proj(x.to(compute_dtype(self.weights_proj))).to(wide) * self.n_heads ** -0.5  # (B, T, H)
        return torch.einsum("bth,bths->bts", w, F.relu(logits))

    def select(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Boolean (B, Tq, Tk): the top ``topk`` keys of each query among those ``allowed``
        (broadcastable to ``scores``); every allowed key when there are at most ``topk``."""
        allowed = allowed.expand_as(scores)
        if scores.shape[-1] <= self.topk:
            return allowed
        idx, ok = self.top(scores, allowed)
        return torch.zeros_like(allowed).scatter_(-1, idx, ok)

    def top(self, scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices (B, Tq, k) of each query's ``k = min(topk, Tk)`` best keys, and whether each
        is allowed (a query that sees fewer than k keys fills its list with masked ones)."""
        allowed = allowed.expand_as(scores)
        # A stable sort settles ties (ReLU makes exact zeros common) for the earlier key, so a
        # query picks the same keys whatever the row's length (prefill, decode, left padding).
        # The selection takes no gradient: sorting detached scores keeps no indices for backward.
        idx = scores.detach().masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
        idx = idx[..., : self.topk].contiguous()  # a copy: the view would keep every key's index for backward
        return idx, allowed.gather(-1, idx)


class IndexKeys:
    """The indexer's decode state for one layer: a ``head_dim``-wide key per slot, (B, capacity, D).

    ``update(k, slots)`` stores (B, T, D) keys at their slots and returns every key so far. The
    buffer grows by doubling (or is sized once from ``max_len``); :meth:`to_static` gives a copy of
    fixed size that a compiled step updates in place (unfilled slots lie after the query and are
    masked by causality).
    """

    def __init__(self, max_len: Optional[int] = None, *, static: bool = False):
        self.max_len, self.static = max_len, static
        self.k: Optional[torch.Tensor] = None
        self.filled = 0

    def update(self, k: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.static:
            self.k.index_copy_(1, slots, k.to(self.k.dtype))
            return self.k
        end = int(slots[-1]) + 1
        if self.k is None or end > self.k.shape[1]:
            held = 0 if self.k is None else self.k.shape[1]
            grown = k.new_empty(k.shape[0], max(end, self.max_len or 0, 2 * held), k.shape[-1])
            if self.k is not None:
                grown[:, : self.filled] = self.k[:, : self.filled]
            self.k = grown
        self.k[:, int(slots[0]) : end] = k
        self.filled = end
        return self.k[:, :end]

    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.numel() * self.k.element_size()

    def to_static(self, max_len: int) -> "IndexKeys":
        if self.k is None:
            raise ValueError("to_static needs a state that has been filled (prefill the prompt first)")
        out = IndexKeys(max_len, static=True)
        out.k = self.k.new_zeros(self.k.shape[0], max_len, self.k.shape[-1])
        out.k[:, : self.filled] = self.k[:, : self.filled]
        out.filled = self.filled
        return out


class DSAState(LayerState):
    """A DSA layer's decode state: MLA's (the latent and the rotated key part per token) and the
    indexer's keys beside it (None in a layer that shares another's selection). Opaque to everything
    but the layer."""

    def __init__(self, kv, keys: Optional[IndexKeys]):
        self.kv, self.keys = kv, keys

    def nbytes(self) -> int:
        return self.kv.nbytes() + (self.keys.nbytes() if self.keys is not None else 0)

    def to_static(self, max_len: int) -> "DSAState":
        return DSAState(self.kv.to_static(max_len), self.keys.to_static(max_len) if self.keys is not None else None)


@dataclass
class Selections:
    """The top-k selections of one forward that later layers reuse (``ctx.slot(Selections)``): layer
    index -> its (indices, allowed), or None while every visible key is selected."""

    by_layer: dict[int, Optional[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def selection_source(spec, index: int) -> int:
    """The layer whose indexer a ``"shared"`` DSA layer ``index`` reuses: the nearest earlier layer
    with ``indexer = "full"``, reached through DSA layers only."""
    j = index - 1
    while j >= 0 and spec.layer(j).mixer.name == "dsa" and spec.layer(j).mixer.config.indexer == "shared":
        j -= 1
    if j < 0 or spec.layer(j).mixer.name != "dsa":
        before = "no layer comes before it" if j < 0 else f"layer {j} before it is not DSA"
        raise SpecError("indexer", f"'shared' at layer {index} reuses the top-k selection of an earlier DSA layer "
                                   f"with indexer 'full', but {before}: make the first DSA layer 'full'")
    return j


def keys_seen(context: int, topk: int, mean: bool = False) -> float:
    """Keys a query attends to at position ``context`` (``min(context, topk)``), or with ``mean``
    the average of that over the ``context`` positions of a causal sequence."""
    if not mean:
        return min(context, topk)
    k = min(context, topk)
    return (k * (k + 1) / 2 + (context - k) * k) / context


@register("mixer", "dsa")
class DSA(MLA):
    """DeepSeek Sparse Attention: MLA whose queries each attend only to the ``index_topk`` keys a
    lightning indexer picks (every visible key while there are no more than that). Its decode state
    is MLA's plus the indexer's keys (``index_head_dim`` values per token).

    The indexer is trained by a loss of its own (``indexer_loss``, its weight; 0 leaves it as it
    is) while the model runs in training mode: the auxiliary
    loss ``dsa_indexer_kl`` is the KL divergence from the main attention's distribution over the
    keys it attended (summed over heads and renormalised) to the softmax of the index scores over
    those keys, averaged over queries. The indexer's inputs are detached, so this loss trains the
    indexer alone and the language-model loss never reaches it (DeepSeek-V3.2's recipe: a dense
    warm-up with ``index_topk`` at least the sequence length, then sparse training).
    """

    documents: ClassVar[bool] = False  # its indexer's selection does not know packed documents

    @dataclass(frozen=True)
    class Config(MLA.Config):
        index_n_heads: int = 64
        index_head_dim: int = 128
        index_topk: int = 2048
        indexer_loss: float = 1.0  # weight of the dsa_indexer_kl term in training (0: not computed)
        # "full": this layer's own indexer selects; "shared": reuse the nearest earlier full layer's selection
        indexer: Literal["full", "shared"] = "full"
        # how the indexer's rotated dims pair: "half" (i, i + d/2), DeepSeek-V3.2; "pairs_to_half", GLM-5
        index_rope_layout: Literal["half", "pairs_to_half"] = "half"

        def check(self):
            super().check()
            for name in ("index_n_heads", "index_head_dim"):
                positive(name, getattr(self, name), allow_none=False)
            check_topk(self.index_topk)
            if self.q_lora_rank is None:
                raise SpecError("q_lora_rank", "DSA's indexer reads the query latent: set q_lora_rank")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise SpecError("index_head_dim", f"{self.index_head_dim} is narrower than the rotated part "
                                                  f"qk_rope_head_dim {self.qk_rope_head_dim}")
            if self.indexer_loss < 0:
                raise SpecError("indexer_loss", f"must be >= 0, got {self.indexer_loss}")

    def __init__(self, cfg, *, d_model: int, layer, spec, index: int = 0):
        super().__init__(cfg, d_model=d_model, layer=layer, spec=spec, index=index)
        # The layer whose selection this one reuses (None: its own indexer selects), and whether a later
        # layer reuses this one's (then the forward keeps it in ctx.slot(Selections)).
        main = index < spec.n_layers  # (not a multi-token prediction block's)
        self.source = spec.sources[index] if main else self.reads_from(cfg, spec=spec, index=index)
        self.shares = index in spec.sources
        if self.source is None:
            self.indexer = LightningIndexer(d_model=d_model, q_dim=cfg.q_lora_rank, n_heads=cfg.index_n_heads,
                                            head_dim=cfg.index_head_dim, rope_dim=cfg.qk_rope_head_dim,
                                            topk=cfg.index_topk, interleaved=cfg.index_rope_layout == "pairs_to_half")

    def new_state(self, batch, max_len, *, dtype=None, device=None) -> DSAState:
        keys = IndexKeys(max_len) if self.source is None else None
        return DSAState(super().new_state(batch, max_len, dtype=dtype, device=device), keys)

    def forward(self, x, ctx, pos):
        B, T, _ = x.shape
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(B, T, -1, self.qk_dim).transpose(1, 2)  # -1: this process's heads
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c, k_rope = self.latents(x)
        if pos is not None:
            q_rope, k_rope = pos.rotate(q_rope, k_rope)
            q_rope, k_rope = q_rope.to(x.dtype), k_rope.to(x.dtype)
            cos, sin = (t[:, 0].to(x.dtype) for t in pos.pairs())
        else:
            cos = x.new_ones(B, T, self.rope // 2)
            sin = x.new_zeros(B, T, self.rope // 2)
        own = self.source is None
        if own:  # the indexer reads detached inputs: only its own loss trains it
            xi, qi = x.detach(), q_latent.detach()
            keys = self.indexer.keys(xi, cos, sin)
        q_idx = k_idx = ctx.slots
        if ctx.state is not None:
            state = ctx.state.layers[self.index]
            c, k_rope, k_idx = state.kv.update(c, k_rope, q_idx)
            if own:
                keys = state.keys.update(keys, q_idx)
        key_mask = ctx.key_mask
        if key_mask is not None and k_idx is not q_idx:
            key_mask = key_mask[:, k_idx]
        visible = dense_mask(q_idx, k_idx, None, key_mask)  # (Tq, Tk) or (B, 1, Tq, Tk)
        visible = visible if visible.dim() == 4 else visible[None, None]
        if own:
            scores = self.indexer.scores(xi, qi, keys, cos, sin)
            # None while every visible key is selected; else each query's top-k (indices, allowed)
            picked = None if c.shape[2] <= self.cfg.index_topk else self.indexer.top(scores, visible[:, 0])
            if self.shares:
                ctx.slot(Selections).by_layer[self.index] = picked
        else:
            made = ctx.slot(Selections).by_layer
            if self.source not in made:
                raise RuntimeError(f"DSA layer {self.index} shares layer {self.source}'s top-k selection, which this "
                                   "forward has not made: run the layers in order")
            picked = made[self.source]
        if picked is None:  # every visible key is selected: this is MLA
            mask = visible
            if ctx.state is not None and self.cfg.decode == "absorbed":
                out = self.attend_absorbed(q_nope, q_rope, c, k_rope, q_idx, k_idx, key_mask)
            else:
                out = self.attend_plain(q_nope, q_rope, c, k_rope, q_idx, k_idx, key_mask)
        else:  # gather each query's top-k latents and attend to those alone
            idx, ok = picked
            out = self.attend_selected(q_nope, q_rope, c, k_rope, idx, ok)
            mask = torch.zeros_like(visible[:, 0].expand(B, -1, -1)).scatter_(-1, idx, ok)[:, None]
        if own and self.training and self.cfg.indexer_loss > 0:
            target = self.attention_distribution(q_nope, q_rope, c, k_rope, mask)
            ctx.add_loss("dsa_indexer_kl", indexer_kl(target, scores, mask[:, 0].expand_as(scores)), self.cfg.indexer_loss)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def attend_selected(self, q_nope, q_rope, c, k_rope, idx, ok):
        """Absorbed attention over each query's selected latents only: ``idx`` (B, Tq, k) the keys,
        ``ok`` whether each is allowed. Costs O(k) per query whatever the context (and holds the
        gathered (B, Tq, k, kv_lora_rank + rope) latents)."""
        w_uk, w_uv = self.up_weights()
        q = torch.cat([torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk.to(q_nope.dtype)), q_rope], dim=-1)
        mesh = getattr(self, "_tp_mesh", None)
        if mesh is not None:  # whole on every process, read here by its own heads only (k_rope's is summed already)
            c = grad_summed(c, mesh)
        kv = torch.cat([c, k_rope], dim=-1)[:, 0]  # (B, Tk, kv_lora_rank + rope)
        picked = kv[torch.arange(kv.shape[0], device=kv.device)[:, None, None], idx]  # (B, Tq, k, C + rope)
        s = torch.einsum("bhtc,btkc->bhtk", q, picked) * self.scale
        p = torch.softmax(s.masked_fill(~ok[:, None], float("-inf")), dim=-1, dtype=at_least_fp32(q.dtype)).to(q.dtype)
        o_lat = torch.einsum("bhtk,btkc->bhtc", p, picked[..., : self.kv_lora_rank])
        return torch.einsum("bhtc,hvc->bhtv", o_lat, w_uv.to(o_lat.dtype))

    @torch.no_grad()
    def attention_distribution(self, q_nope, q_rope, c, k_rope, mask):
        """The main attention's probabilities under ``mask``, summed over heads and renormalised:
        (B, Tq, Tk), the target the indexer learns (no gradient)."""
        w_uk, _ = self.up_weights()
        q_lat = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk.to(q_nope.dtype))
        s = (q_lat @ c.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)).to(at_least_fp32(c.dtype)) * self.scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).sum(1)
        mesh = getattr(self, "_tp_mesh", None)
        if mesh is not None:  # this process's heads summed: the sum over every head
            from torch.distributed.tensor import DTensor, Partial

            p = DTensor.from_local(p, mesh, [Partial()], run_check=False).full_tensor()
        return p / p.sum(-1, keepdim=True)

    # -- what this part states about itself ---------------------------------------------------------
    def parallelize(self, tp_mesh) -> None:
        """MLA's plan for the attention (its heads sharded, the latents whole on every process); the
        indexer stays whole on every process and runs on the gathered sequence, so each process scores
        every index head and selects the top-k one process selects. Its inputs are detached and its loss
        is its own, computed whole on every process from the main attention's distribution summed over
        all heads (this process's heads summed, then all-reduced), so its gradients are whole there too
        and are not summed again. Attending to the selected keys reads the latents directly: their
        gradient, from this process's heads alone, is summed over the processes."""
        super().parallelize(tp_mesh)

    @classmethod
    def reads_from(cls, cfg, *, spec, index):
        """A shared indexer's source: the nearest earlier full layer (:func:`selection_source`)."""
        return selection_source(spec, index) if cfg.indexer == "shared" else None

    @staticmethod
    def shrink(cfg, *, head_dim: int = 8, **sizes) -> dict:
        """MLA's tiny copy plus 2 indexer heads of ``head_dim`` and a top-4 selection, so that short
        test sequences are already sparse."""
        out = MLA.shrink(cfg, head_dim=head_dim, **sizes)
        out.update(q_lora_rank=3 * head_dim // 2, index_n_heads=2, index_head_dim=max(head_dim, out["qk_rope_head_dim"]),
                   index_topk=4)
        return out

    def cost(self, context: int) -> Cost:
        """MLA's attention over ``min(context, index_topk)`` keys, plus the indexer's scores over
        every key (``2 index_n_heads index_head_dim`` FLOPs per key for the dot products and
        ``2 index_n_heads`` for weighting the heads); the state adds ``index_head_dim`` per token.
        A layer sharing another's selection has neither the indexer's FLOPs nor its keys."""
        dense = super().cost(context)
        per_key = dense.flops / context
        own = self.source is None
        index_per_key = 2 * self.cfg.index_n_heads * (self.cfg.index_head_dim + 1) if own else 0
        topk = self.cfg.index_topk
        D = self.cfg.index_head_dim if own else 0
        return Cost(flops=per_key * keys_seen(context, topk) + index_per_key * context,
                    flops_mean=per_key * keys_seen(context, topk, mean=True) + index_per_key * (context + 1) / 2,
                    state_per_token=dense.state_per_token + D, state_at_context=dense.state_at_context + D * context)

    def facts(self) -> dict:
        out = {**super().facts(), "attention": "MLA + DSA", "index_n_heads": self.cfg.index_n_heads,
               "index_head_dim": self.cfg.index_head_dim, "index_topk": self.cfg.index_topk}
        if self.source is None:
            out["state_per_token"] += self.cfg.index_head_dim
        else:
            out["indexer"] = f"shared: layer {self.source}'s selection"
        rows = []
        for context in (4096, 32768, 131072):
            dsa, mla = self.cost(context).flops, MLA.cost(self, context).flops
            rows.append(f"{context // 1024}k: {dsa / 1e6:.3g} vs {mla / 1e6:.3g} MFLOP ({mla / dsa:.2f}x)")
        out["attention FLOPs/token DSA vs dense MLA"] = "; ".join(rows)
        return out

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token, training: while every key is selected (``seq_len`` at most ``index_topk``), MLA's;
        beyond, MLA's latents (whole on every process) and, of this process's heads, the selected path: the
        projected queries, the queries absorbed into the latent space, the gathered latents and rotary key
        parts of the ``index_topk`` keys with their indices and mask, the float32 probabilities and their copy, the latent output and
        the output projection's input, plus the rotated key part. A layer with its own indexer and a loss
        for it adds, whole on every process (it runs on the gathered sequence): the key's LayerNorm, the
        keys and queries of the score product, the per-head scores before the ReLU (``index_n_heads``
        per key of the ``seq_len``), the head weights, and the loss's log-probabilities and terms (one
        float32 per key, each with its mask)."""
        c, w = dtype.itemsize, max(dtype.itemsize, 4)  # activations; the float32 (at least) of the indexer
        k = self.cfg.index_topk
        if seq_len <= k:
            out = super().activation_bytes(seq_len, dtype, tp=tp, device=device)
        else:
            H, C, R = self.n_heads / tp, self.kv_lora_rank, self.rope
            out = self._latent_activation_bytes(seq_len, dtype, device=device) + 2 * R * c \
                + k * ((C + R) * c + 1 + 8) + H * (c * (self.qk_dim + C + R + C + self.v_dim) + k * (w + c))
        if self.source is None and self.cfg.indexer_loss > 0:
            HI, D = self.cfg.index_n_heads, self.cfg.index_head_dim
            out += D * c + 8 + D * w + HI * D * w + HI * w + seq_len * (HI * w + 2 * w + 2)
        return out


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over queries of ``KL(target || softmax(scores))`` over the keys in ``mask`` (B, Tq, Tk)."""
    log_q = torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    terms = torch.where(mask & (target > 0), target * (target.clamp_min(1e-30).log() - log_q), 0.0)
    return terms.sum(-1).mean()
