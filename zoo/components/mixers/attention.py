"""Causal self-attention: MHA, GQA and MQA as one part, chosen by the number of kv heads.

head_dim is independent of d_model; the score scale can be set (Gemma's
``query_pre_attn_scalar``); a causal sliding window; QK-norm per head (Gemma 3) or over the whole
projection (OLMo 2); tanh soft-capping of scores (Gemma 2, Grok-1); q, k and v clamped to
``[-clip_qkv, clip_qkv]`` as they leave their projections (DBRX). Runs on
``scaled_dot_product_attention`` (GQA without repeating K/V) whenever the semantics allow, and on
the eager path (the reference) when they do not (soft-capping) or when asked.

What happens to the scores (soft-cap, window, and in variants sinks, chunks, temperatures) is the
part's score hook, :meth:`Attention.scores`, which every path honours
(:mod:`zoo.components.mixers.scores`; docs/guides/attention-variants.md).
"""

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kernels
from zoo.core.kinds import Cost, Mixer
from zoo.core.registry import register
from zoo.core.spec import MAX_HEAD_DIM, SpecError, at_most, positive
from zoo.core.state import KVState

from zoo.components.mixers._masks import causal_mask, dense_mask  # noqa: F401  (causal_mask: importable from its old home)
from zoo.components.mixers.scores import Scores, grid, scale_queries, softcapped


def attention_kind(n_heads: int, n_kv_heads: int) -> str:
    """MHA, MQA or GQA-<kv heads>."""
    if n_kv_heads == n_heads:
        return "MHA"
    if n_kv_heads == 1:
        return "MQA"
    return f"GQA-{n_kv_heads}"


@register("mixer", "attention")
class Attention(Mixer):
    """Multi-head causal attention with ``n_kv_heads`` key/value heads shared by groups of queries.

    Its decode state is a :class:`~zoo.core.state.KVState` (a ring buffer of ``window`` slots when it
    has a window).

    **The score hook.** ``scores() -> Scores`` (:class:`zoo.components.mixers.scores.Scores`) says what
    this attention does between ``q . k * scale`` and the weighted sum of values: a ``score_mod``
    (flex-style ``(score, b, h, q_slot, k_slot) -> score``: soft-cap, temperature), a ``mask_mod``
    (``(b, h, q_slot, k_slot) -> bool``), a sliding ``window``, a ``chunk`` size (chunked local
    attention), a ``sink`` (one logit per head added to the softmax's denominator and dropped) and a
    ``query_scale`` (``positions (B, Tq) -> (B, Tq)`` multipliers of the queries, applied by
    :meth:`forward` after the rotation). It is called once per forward by :meth:`attend` and by the
    fast paths; every path (eager, SDPA with a mask, FlexAttention) honours every field, or is not
    chosen (SDPA runs no ``score_mod``). The default states this part's own settings (``softcap`` as
    :func:`~zoo.components.mixers.scores.softcapped`, ``window``); a variant overrides it and extends
    its parent's::

        @register("mixer", "sink_attention")
        class SinkAttention(Attention):
            def __init__(self, cfg, **context):
                super().__init__(cfg, **context)
                self.sinks = nn.Parameter(torch.zeros(self.n_heads))

            def scores(self):
                return super().scores().but(sink=self.sinks)

    Return the same ``mask_mod`` object every forward (masks are cached by it); slots are the
    absolute places in the sequence (left padding included), as the causal mask compares them.
    The decode state is unchanged: a variant decodes incrementally as the full forward does."""

    kernel: ClassVar[str] = "attention"
    documents: ClassVar[bool] = True  # packed documents: a mask keeps attention inside each
    # flex (FlexAttention) is chosen on CUDA for what SDPA cannot fuse: soft-capping, a window.
    backends: ClassVar[tuple] = ("flex", "sdpa", "eager")

    @dataclass(frozen=True)
    class Config:
        n_heads: int
        n_kv_heads: Optional[int] = None  # None: as many as n_heads (MHA); 1: MQA
        head_dim: Optional[int] = None  # None: d_model // n_heads
        bias: bool = False  # on the q, k, v projections
        out_bias: bool = False
        scale_dim: Optional[float] = None  # scores are scaled by scale_dim ** -0.5; None: head_dim
        window: Optional[int] = None  # causal sliding window (keys with q - k < window are seen)
        softcap: Optional[float] = None  # scores -> softcap * tanh(scores / softcap)
        qk_norm: Literal["none", "head", "proj"] = "none"
        # q_proj gives each head its query and a gate; the output is multiplied by sigmoid(gate) before
        # o_proj (Qwen3-Next's gated attention).
        output_gate: bool = False
        # q, k and v clamped to [-clip_qkv, clip_qkv] as they leave their projections, before any
        # QK-norm and RoPE (DBRX clamps its fused Wqkv output; the clamp is elementwise, so it is one).
        clip_qkv: Optional[float] = None

        def check(self):
            if self.n_heads <= 0:
                raise SpecError("n_heads", f"must be positive, got {self.n_heads}")
            if self.n_kv_heads is not None:
                if self.n_kv_heads <= 0:
                    raise SpecError("n_kv_heads", f"must be positive, got {self.n_kv_heads}")
                if self.n_heads % self.n_kv_heads:
                    raise SpecError(
                        "n_kv_heads", f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
                    )
            for name in ("head_dim", "window", "softcap", "scale_dim", "clip_qkv"):
                positive(name, getattr(self, name))
            at_most("head_dim", self.head_dim, MAX_HEAD_DIM)

    @staticmethod
    def head_dim_for(cfg, d_model: int) -> int:
        return cfg.head_dim if cfg.head_dim is not None else d_model // cfg.n_heads

    def __init__(self, cfg, *, d_model: int, layer, spec, index: int = 0):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = D = self.head_dim_for(cfg, d_model)
        self.window = cfg.window
        self.scale = (cfg.scale_dim if cfg.scale_dim is not None else D) ** -0.5
        self.dropout = spec.dropout
        self.q_proj = nn.Linear(d_model, self.n_heads * D * (2 if cfg.output_gate else 1), bias=cfg.bias)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * D, bias=cfg.bias)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * D, bias=cfg.bias)
        self.o_proj = nn.Linear(self.n_heads * D, d_model, bias=cfg.out_bias)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = layer.norm.build(dim=D), layer.norm.build(dim=D)
        elif cfg.qk_norm == "proj":
            self.q_norm = layer.norm.build(dim=self.n_heads * D)
            self.k_norm = layer.norm.build(dim=self.n_kv_heads * D)
        self.backend = "auto"  # "sdpa", "eager" or any registered fast path; "auto" picks

    def scores(self) -> Scores:
        """The score hook (the class docstring): this part's soft-cap and window. Variants extend it."""
        cap = self.cfg.softcap
        return Scores(score_mod=softcapped(cap) if cap is not None else None, window=self.window)

    def new_state(self, batch, max_len, *, dtype=None, device=None) -> KVState:
        return KVState(window=self.window, max_len=max_len)

    def forward(self, x, ctx, pos):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.cfg.clip_qkv is not None:
            c = self.cfg.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        if self.cfg.output_gate:  # per head: its query, then its gate
            q, gate = q.view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.reshape(B, T, -1)
        if self.cfg.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1: the heads this process holds (all of them, or its share under tensor parallelism)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if pos is not None:
            q, k = pos.rotate(q, k)
        q = scale_queries(q, self.scores(), ctx.position_ids)  # the score hook's query temperature, if any
        q_idx = k_idx = ctx.slots
        if ctx.state is not None:
            k, v, k_idx = ctx.state.layers[self.index].update(k, v, q_idx)
        key_mask = ctx.key_mask
        if key_mask is not None and k_idx is not q_idx:  # else the same tensor for every layer: masks built once
            key_mask = key_mask[:, k_idx]
        bias = pos.score_bias(q_idx, k_idx, q.shape[1]) if pos is not None else None
        if ctx.asks("attn_logit_max"):  # the ablation lab's probe (zoo.tools.ablate.AttentionLogits)
            ctx.add_metric(f"attn_logit_max/layer{self.index}", self.logit_max(q, k, q_idx, k_idx))
        out = self.attend(q, k, v, q_idx, k_idx, key_mask, bias, documents=ctx.documents).transpose(1, 2).reshape(B, T, -1)
        if self.cfg.output_gate:
            out = out * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)

    def reference_backend(self):
        return "eager" if self.scores().score_mod is not None else "sdpa"

    def kernel_problem(self, backend, q=None, forced=False):
        if forced:
            return None
        if self.dropout and self.training:
            return "attention dropout runs on the reference path"
        T = q.shape[-2] if q is not None else None
        s = self.scores()
        if s.score_mod is None and s.sink is None and not s.masked \
                and (s.window is None or (T is not None and T <= s.window)):
            return "SDPA covers it (no soft-cap, no active window)"
        if T == 1:
            return "one query per step: the reference path is cheaper"
        return None

    @torch.no_grad()
    def logit_max(self, q, k, q_idx, k_idx) -> torch.Tensor:
        """The largest causal attention logit (the score fed to the softmax, after scaling and the
        score hook's query scale and score_mod, of the keys its masks let a query see), in float32."""
        s = self.scores()
        B, H, T, D = q.shape
        hkv = k.shape[1]
        scores = torch.matmul(q.float().view(B, hkv, H // hkv, T, D), k.float().unsqueeze(2).transpose(-1, -2))
        scores = (scores * self.scale).view(B, H, T, -1)
        if s.score_mod is not None:
            scores = s.score_mod(scores, *grid(B, H, q_idx, k_idx))
        seen = causal_mask(q_idx, k_idx, s.window, chunk=s.chunk, mask_mod=s.mask_mod, shape=(B, H))
        return scores.masked_fill(~seen, float("-inf")).amax()

    def attend(self, q, k, v, q_idx, k_idx, key_mask=None, bias=None, *, documents=None):
        """(B, H, Tq, D) queries at slots ``q_idx`` (Tq,) against (B, Hkv, Tk, D) keys/values at slots
        ``k_idx`` (Tk,) -> (B, H, Tq, D). ``key_mask`` (B, Tk) marks real keys (None: no padding);
        ``bias`` (1 or B, H, Tq, Tk) is added to the scores (a bias position encoding); ``documents``
        (B, T): packed documents, each query seeing keys of its own only. Runs the score hook
        (:meth:`scores`; its ``query_scale`` is applied by :meth:`forward`, which has the positions) on
        the backend chosen: SDPA, eager, or a registered fast one (FlexAttention), called as
        ``fn(self, q, k, v, q_idx, k_idx, key_mask, bias)`` (and ``documents=`` when there are some)."""
        s = self.scores()
        # Under autocast over fp32 weights RoPE leaves q and k in fp32 while v is in the autocast
        # dtype; SDPA and matmuls would cast them, FlexAttention and fused kernels need one dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        backend = self.backend
        if backend == "auto":
            backend = kernels.select(self, q) or self.reference_backend()
        if backend == "sdpa":
            if s.score_mod is not None:
                raise ValueError("the sdpa backend cannot run a score_mod (soft-capping, a temperature) on attention "
                                 "scores; use backend 'eager'")
            return self._sdpa(q, k, v, q_idx, k_idx, key_mask, bias, documents, s)
        if backend == "eager":
            return self._eager(q, k, v, q_idx, k_idx, key_mask, bias, documents, s)
        if documents is not None:  # flex takes them as a block mask; another backend may not know them
            if backend != "flex":
                return self._eager(q, k, v, q_idx, k_idx, key_mask, bias, documents)
            return kernels.attention_backend(backend)(self, q, k, v, q_idx, k_idx, key_mask, bias, documents=documents)
        return kernels.attention_backend(backend)(self, q, k, v, q_idx, k_idx, key_mask, bias)

    def _sdpa(self, q, k, v, q_idx, k_idx, key_mask, bias, documents=None, s=None):
        s = s or self.scores()
        B, H, Tq, _ = q.shape
        Tk = k.shape[2]
        plain = key_mask is None and bias is None and documents is None and s.sink is None and not s.masked
        own = k_idx is q_idx  # no cache: a sequence's own consecutive slots, known without reading them (no sync)
        window = s.window
        if own:
            windowed = window is not None and Tq > window
        else:  # cache rings are unordered; only asked when the mask could be skipped
            windowed = plain and window is not None and int(q_idx[-1] - k_idx.min()) >= window
        mask, is_causal = None, False
        if plain and not windowed and (own or (Tq == Tk and bool((q_idx == k_idx).all()))):
            is_causal = True
        elif plain and not windowed and Tq == 1:
            mask = None  # one new token sees every cached key
        else:
            mask = dense_mask(q_idx, k_idx, window, key_mask, documents, chunk=s.chunk, mask_mod=s.mask_mod,
                              shape=(B, H))
            if bias is not None or s.sink is not None:
                zero = bias.to(q.dtype) if bias is not None else q.new_zeros(())
                mask = torch.where(mask, zero, float("-inf"))
            if s.sink is not None:  # one more key of zeros (a zero value), its score the sink's logit
                mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
                rows = mask.shape[0]
                sink = s.sink.to(q.dtype).view(1, -1, 1, 1).expand(rows, H, Tq, 1)
                mask = torch.cat([mask.expand(rows, H, Tq, Tk), sink], dim=-1)
                k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[-1])], dim=2)
                v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], dim=2)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )

    def _eager(self, q, k, v, q_idx, k_idx, key_mask, bias, documents=None, s=None):
        """The reference: every field of the score hook, on the whole (B, H, Tq, Tk) scores."""
        s = s or self.scores()
        B, H, Tq, D = q.shape
        Hkv = k.shape[1]  # local counts (a share of the heads under tensor parallelism)
        G = H // Hkv
        qg = q.view(B, Hkv, G, Tq, D)
        scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * self.scale  # (B, Hkv, G, Tq, Tk)
        scores = scores.view(B, H, Tq, -1)
        if s.score_mod is not None:
            scores = s.score_mod(scores, *grid(B, H, q_idx, k_idx))
        if bias is not None:
            scores = scores + bias
        mask = dense_mask(q_idx, k_idx, s.window, key_mask, documents, chunk=s.chunk, mask_mod=s.mask_mod, shape=(B, H))
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        if s.sink is not None:  # one more term in the denominator, dropped after the softmax
            sink = s.sink.to(scores.dtype).view(1, -1, 1, 1).expand(B, H, Tq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        probs = F.dropout(probs.to(q.dtype), self.dropout, self.training)
        out = torch.matmul(probs.view(B, Hkv, G, Tq, -1), v.unsqueeze(2))
        return out.view(B, H, Tq, D)

    # -- what this part states about itself ---------------------------------------------------------
    #: Tensor parallelism by heads: the sequence gathered, q/k/v sharded by their heads' rows (whole heads,
    #: each with its gate), o_proj by its columns and reduce-scattered back onto the sequence slice; the
    #: forward reshapes with the local head counts. A per-head QK-norm normalises the local heads with
    #: replicated weights (their gradient summed over the processes); one over the whole projection
    #: (OLMo 2) gathers its features to normalise each row whole.
    tp_divides = ("n_heads", "n_kv_heads")

    @property
    def tp_plan(self) -> dict:
        norm = "split_features" if self.cfg.qk_norm == "proj" else "split_heads"  # (B, T, heads x D) or (B, heads, T, D)
        return {"": "gather_sequence", "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise",
                "o_proj": "rowwise", "q_norm": norm, "k_norm": norm}

    @classmethod
    def rotary_dim(cls, cfg, d_model: int) -> int:
        """A rotary position encoding rotates each head's queries and keys."""
        return cls.head_dim_for(cfg, d_model)

    @classmethod
    def resolved(cls, cfg, d_model: int) -> dict:
        """The settings with defaults made explicit, so two spellings of one attention compare equal."""
        from zoo.core.spec import to_dict

        out = to_dict(cfg)
        out["head_dim"] = cls.head_dim_for(cfg, d_model)
        out["n_kv_heads"] = cfg.n_kv_heads or cfg.n_heads
        out["scale_dim"] = cfg.scale_dim or out["head_dim"]
        return out

    @staticmethod
    def shrink(cfg, *, head_dim: int = 8, window: int = 4, **_) -> dict:
        """Settings for a tiny test copy: 4 query heads of ``head_dim``, MHA/GQA/MQA kept, short window."""
        out = {"n_heads": 4, "head_dim": head_dim}
        if cfg.n_kv_heads is not None:
            out["n_kv_heads"] = 4 if cfg.n_kv_heads == cfg.n_heads else (1 if cfg.n_kv_heads == 1 else 2)
        if cfg.window is not None:
            out["window"] = window
        if cfg.scale_dim is not None:
            out["scale_dim"] = float(head_dim)
        return out

    @classmethod
    def check_in_model(cls, cfg, *, spec, layer):
        if cfg.head_dim is None and spec.d_model % cfg.n_heads:
            raise SpecError(
                "n_heads", f"d_model {spec.d_model} is not divisible by n_heads {cfg.n_heads}; set head_dim explicitly"
            )

    def heads(self) -> tuple[int, int, int]:
        """(n_heads, n_kv_heads, head_dim), for checkpoint transforms that split fused projections."""
        return self.n_heads, self.n_kv_heads, self.head_dim

    def cost(self, context: int) -> Cost:
        """Scores and the weighted sum: ``4 * n_heads * head_dim`` FLOPs per key seen (a window caps
        the keys); keys and values of ``n_kv_heads * head_dim`` each per token held."""
        per_key = 4 * self.n_heads * self.head_dim
        w = min(self.window or context, context)
        keys = w * (w + 1) // 2 + (context - w) * w  # sum over t = 1..context of min(t, w)
        kv = 2 * self.n_kv_heads * self.head_dim
        return Cost(flops=per_key * w, flops_mean=per_key * keys / context, state_per_token=kv, state_at_context=kv * w)

    def facts(self) -> dict:
        return {"attention": attention_kind(self.n_heads, self.n_kv_heads), "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "window": self.window,
                **({"output gate": "sigmoid, from q_proj"} if self.cfg.output_gate else {}),
                **({"qkv clamp": self.cfg.clip_qkv} if self.cfg.clip_qkv is not None else {})}

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token: the input the projections read (the whole sequence, gathered under tensor
        parallelism); of this process's heads, the rotated queries and keys, the values, the output (which
        ``o_proj`` reads) and the float32 log-sum-exp of the fused kernels (SDPA, FlexAttention); the gate
        and its product when gated; a QK-norm's own. The eager path (soft-capping off CUDA) also keeps,
        per head and key, the soft-cap's tanh, the float32 probabilities and their cast."""
        c = dtype.itemsize
        H, Hkv, D = self.n_heads / tp, self.n_kv_heads / tp, self.head_dim
        out = self.q_proj.in_features * c + (2 * H + 2 * Hkv) * D * c + 4 * H
        if self.cfg.output_gate:
            out += 3 * H * D * c  # the gate's sigmoid, the ungated output and the product o_proj reads
        if self.cfg.qk_norm == "head":  # per head row; and the projected queries, which it reads
            out += H * self.q_norm.activation_bytes(seq_len, dtype, device=device) \
                + Hkv * self.k_norm.activation_bytes(seq_len, dtype, device=device) + H * D * c
        elif self.cfg.qk_norm == "proj":  # whole rows, gathered under tensor parallelism
            out += self.q_norm.activation_bytes(seq_len, dtype, device=device) \
                + self.k_norm.activation_bytes(seq_len, dtype, device=device)
        if self.cfg.softcap is not None and device != "cuda":  # the eager path: scores per key
            out += H * seq_len * (c + 4 + (c if c != 4 else 0)) + H * D * c - 4 * H  # (a copy o_proj reads, no lse)
        return out
