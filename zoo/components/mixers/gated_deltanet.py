"""Gated DeltaNet: the delta rule with a data-dependent decay, as Qwen3-Next's linear-attention layers use it.

Per value head, with L2-normalised keys ``k_t`` and queries ``q_t`` (the query also scaled by
``key_dim ** -0.5``), a write strength ``beta_t = sigmoid(b_t)`` and a decay
``gamma_t = exp(g_t)``, ``g_t = -exp(A_log) * softplus(a_t + dt_bias)``::

    S_t = gamma_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        y_t = S_t^T q_t

Two forms compute it. The recurrent form (:func:`recurrent_gated_delta_rule`) takes one step per
token and decodes. The chunked form (:func:`chunk_gated_delta_rule`) is the parallel one for
training and prefill: within a chunk of ``C`` tokens the updates are condensed by the UT transform
(one unit-lower-triangular solve, the WY representation of a product of Householder-like factors),
so the only loop is over chunks and the cost is O(T * C). Both are written after transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` and compute in float32.

Around the core: one projection gives q, k, v and the output gate z (``in_proj_qkvz``, rows
``[q | k | v | z]``, each head after head; Qwen3-Next's checkpoints group them per key head, which
the format's ``grouped_qkvz`` transform reorders), another gives b and a (``[b | a]``); q, k and v pass a short causal depthwise convolution with SiLU; there are
``n_heads`` value heads served by ``n_key_heads`` key heads (each key head serves
``n_heads / n_key_heads`` consecutive value heads); the output is RMS-normalised per head, then
multiplied by ``silu(z)`` (norm, then gate), and projected back.

The decode state is fixed in size: the last ``conv_kernel - 1`` convolution inputs and the
(key_dim x value_dim) matrix of each value head, whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kernels
from zoo.core.state import FixedState
from zoo.components.mixers._recurrent import GatedRMSNorm, ShortConv
from zoo.core.context import document_starts
from zoo.core.kinds import Cost, Mixer
from zoo.core.registry import register
from zoo.core.spec import SpecError, positive


# ----------------------------------------------------------------------------------- the two forms

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the FLA library's, which Qwen3-Next uses)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state: Optional[torch.Tensor] = None):
    """The recurrent form, one step per token.

    ``q``, ``k``: (B, H, T, Dk), normalised (and ``q`` scaled); ``v``: (B, H, T, Dv); ``g`` (log
    decay, <= 0) and ``beta``: (B, H, T); ``state``: (B, H, Dk, Dv) or None (zeros). All float32.
    Returns the outputs (B, H, T, Dv) and the state after the last token.
    """
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state
    out = torch.empty_like(v)
    decay = g.exp()
    for t in range(T):
        S = S * decay[:, :, t, None, None]
        k_t = k[:, :, t, None, :]  # (B, H, 1, Dk)
        delta = (v[:, :, t, None, :] - k_t @ S) * beta[:, :, t, None, None]  # (B, H, 1, Dv)
        S = S + k_t.transpose(-1, -2) @ delta
        out[:, :, t] = (q[:, :, t, None, :] @ S).squeeze(-2)
    return out, S


#: In the chunked form, exp() of a log-decay below this (e^-50 < 2e-22) is taken as exactly 0. Each such
#: factor multiplies a term that is added to one ~1e21 times larger (every output and state
#: update has an undecayed term, exp(0) = 1), so float32 cannot see it; kept, it and its products turn
#: subnormal, and the CPU computes with subnormal floats many times slower (2-3x on the whole core at
#: decays a randomly initialised Qwen3-Next has).
FLUSH_LOG_DECAY = -50.0

#: The chunked form computes what depends on one chunk only for this many chunks at a time: fewer, larger
#: ops than one chunk at a time (at narrow heads the per-op cost dominates), still small enough to stay
#: in cache (all chunks at once is slower on the CPU). The result does not depend on it.
BLOCK = 8


def _exp_flushed_(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in place, exactly 0 where ``x < FLUSH_LOG_DECAY``."""
    return x.masked_fill_(x < FLUSH_LOG_DECAY, float("-inf")).exp_()


def chunk_gated_delta_rule(q, k, v, g, beta, state: Optional[torch.Tensor] = None, chunk_size: int = 64,
                           resets: Optional[torch.Tensor] = None):
    """The chunked (parallel) form: the same arguments and results as :func:`recurrent_gated_delta_rule`,
    except that ``q`` and ``k`` may have fewer heads than ``v`` (each serving a group of consecutive
    value heads): what depends only on them is computed once per group.

    Within each chunk of ``C`` tokens, with ``G`` the cumulative log decay from the chunk's start,
    ``D[i, j] = exp(G_i - G_j)`` for ``j <= i`` and ``A`` the strictly lower part of
    ``(beta k k^T) * D``: ``(I + A) [u | w] = [beta v | beta k exp(G)]`` (one triangular solve).
    Then, from the state ``S`` before the chunk: ``v' = u - w S``, outputs
    ``(q exp(G)) S + ((q k^T) * D) v'``, and ``S <- exp(G_C) S + (k exp(G_C - G))^T v'``.
    The work is O(T * C); the loop runs over the T / C chunks only. Decay factors below
    ``exp(FLUSH_LOG_DECAY)`` are taken as 0. The outputs come as a (B, H, T, Dv) view of a
    (B, T, H, Dv) tensor.

    ``resets`` (B, T), True at the first token of each packed document: the state is emptied there.
    Within a chunk the steps are then numbered by segment (the resets so far), ``G`` counts no decay
    at a reset, and every decay factor between two segments is 0, so nothing crosses a reset and no
    ``-inf`` is subtracted from another.
    """
    B, Hk, T, Dk = k.shape
    H, Dv = v.shape[1], v.shape[-1]
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:  # padded steps have k = v = 0 and g = 0: they neither write nor decay the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    # (B, key heads, value heads per key head, chunks, C, .): q and k broadcast over the group.
    q, k = (x.reshape(B, Hk, 1, N, C, Dk) for x in (q, k))
    v = v.reshape(B, Hk, H // Hk, N, C, Dv)
    seg = None
    if resets is not None:
        resets = F.pad(resets, (0, pad)) if pad else resets
        g = g.masked_fill(resets[:, None], 0.0)
        seg = resets.view(B, 1, 1, N, C).cumsum(-1)  # (B, 1, 1, N, C): resets in the chunk up to each step
    G = g.reshape(B, Hk, H // Hk, N, C).cumsum(-1)
    eG = _exp_flushed_(G.clone())  # decay from the chunk's start
    to_end = _exp_flushed_(G[..., -1:] - G)  # from each step to the chunk's end
    decay = _exp_flushed_(G[..., -1].clone())  # over the whole chunk
    if seg is not None:  # nothing decays across a reset: it is 0
        eG = eG.masked_fill(seg > 0, 0.0)
        to_end = to_end.masked_fill(seg != seg[..., -1:], 0.0)
        decay = decay.masked_fill(seg[..., -1] > 0, 0.0)
    eG, to_end = eG[..., None], to_end[..., None, :]
    decay = decay.flatten(1, 2)[..., None, None]
    beta = beta.reshape(B, Hk, H // Hk, N, C, 1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state
    out = []
    # What depends on one chunk only is computed for BLOCK chunks at a time (one batched op each, small
    # enough to stay in cache); then the state passes from chunk to chunk, a few ops per chunk.
    for n0 in range(0, N, BLOCK):
        qb, kb, vb, Gb, bb, eGb, te = (x[:, :, :, n0 : n0 + BLOCK] for x in (q, k, v, G, beta, eG, to_end))
        D = _exp_flushed_((Gb[..., :, None] - Gb[..., None, :]).masked_fill_(upper, float("-inf")))
        if seg is not None:
            sb = seg[:, :, :, n0 : n0 + BLOCK]
            D = D.masked_fill(sb[..., :, None] != sb[..., None, :], 0.0)
        kt = kb.transpose(-1, -2)
        A = (kb @ kt).mul(bb).mul_(D)  # solve_triangular reads only its strictly lower part
        uw = torch.linalg.solve_triangular(A, torch.cat([vb * bb, kb * (bb * eGb)], -1), upper=False,
                                           unitriangular=True).flatten(1, 2)  # (B, H, chunks, C, Dv + Dk)
        wq = torch.cat([uw[..., Dv:], (qb * eGb).flatten(1, 2)], -2)  # w and q exp(G): read S at once
        attn = ((qb @ kt) * D).flatten(1, 2)
        k_end = (kt * te).flatten(1, 2)  # (B, H, chunks, Dk, C)
        for i in range(wq.shape[2]):
            read = wq[:, :, i] @ S
            v_new = uw[:, :, i, :, :Dv] - read[..., :C, :]
            y = torch.baddbmm(read[..., C:, :].flatten(0, 1), attn[:, :, i].flatten(0, 1), v_new.flatten(0, 1))
            out.append(y.view(B, H, C, Dv).transpose(1, 2))
            S = S * decay[:, :, n0 + i] + k_end[:, :, i] @ v_new
    # (B, H, T, Dv), a view of one (B, T, H, Dv) tensor: the layout the gated norm reads next
    return torch.cat(out, 1)[:, :T].transpose(1, 2), S


def chunked_bytes(heads: float, key_heads: float, dk: int, dv: int, chunk: int, *, device: str = "cuda") -> float:
    """Per token, the bytes (float32) :func:`chunk_gated_delta_rule` keeps for backward, its normalised
    queries and keys included: per value head, four (chunk x chunk) products and one mask within a chunk,
    the value copy and corrected values, the solved ``[u | w]``, ``w`` beside the decayed queries, the keys
    to the chunk's end, the state carried into each chunk (``dk dv`` per chunk); per key head, the queries,
    keys, their copies and their two products within a chunk. (Measured exact to 0.3% where a key head
    serves several value heads and key_dim <= value_dim; up to 30% over otherwise.) The Triton kernels
    (CUDA): their inputs and the solved ``[u | w]``."""
    if device == "cuda":
        return 4 * (2 * key_heads * dk + heads * (3 * dv + 2 * dk + 3))
    return (4 * (4 * heads * chunk + 2 * key_heads * chunk + 4 * heads * dk + 2 * heads * dv + 6 * key_heads * dk
                 + heads * dk * dv / chunk + 3 * heads) + heads * chunk)


# ----------------------------------------------------------------------------------------- mixer

@register("mixer", "gated_deltanet")
class GatedDeltaNet(Mixer):
    """Gated DeltaNet with its short convolution, L2-normalised q/k and gated RMSNorm (see the module)."""

    # The chunked form runs Triton kernels on CUDA (zoo/components/kernels/gated_deltanet.py).
    kernel: ClassVar[str] = "gated_delta"
    backends: ClassVar[tuple] = ("triton", "torch")
    documents: ClassVar[bool] = True  # packed documents: the state and the convolution restart at each

    @dataclass(frozen=True)
    class Config:
        n_heads: int  # value heads (each has its own state matrix)
        n_key_heads: Optional[int] = None  # query/key heads; None: as many as n_heads
        key_dim: int = 128  # per head
        value_dim: int = 128  # per head
        conv_kernel: int = 4
        chunk_size: int = 64  # tokens per chunk of the parallel form
        norm_eps: float = 1e-6

        def check(self):
            for name in ("n_heads", "n_key_heads", "key_dim", "value_dim", "conv_kernel", "chunk_size", "norm_eps"):
                positive(name, getattr(self, name), allow_none=name == "n_key_heads")
            if self.n_key_heads is not None and self.n_heads % self.n_key_heads:
                raise SpecError("n_key_heads", f"n_heads {self.n_heads} (value heads) is not divisible by "
                                f"n_key_heads {self.n_key_heads}: each key head serves a whole group of value heads")
            if self.conv_kernel < 2:
                raise SpecError("conv_kernel", f"must be at least 2 (a causal convolution over past tokens), "
                                f"got {self.conv_kernel}")
            if self.chunk_size & (self.chunk_size - 1):
                raise SpecError("chunk_size", f"must be a power of two (the chunked kernels work on power-of-two "
                                f"blocks), got {self.chunk_size}")

    def __init__(self, cfg, *, d_model: int, layer=None, spec=None, index: int = 0):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.n_heads, self.n_key_heads = cfg.n_heads, cfg.n_key_heads or cfg.n_heads
        Hv, Hk, Dk, Dv, K = self.n_heads, self.n_key_heads, cfg.key_dim, cfg.value_dim, cfg.conv_kernel
        self.conv_dim = 2 * Hk * Dk + Hv * Dv
        self.in_proj_qkvz = nn.Linear(d_model, 2 * Hk * Dk + 2 * Hv * Dv, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * Hv, bias=False)
        self.conv1d = ShortConv(self.conv_dim, K, bias=False, state_width=K - 1)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.empty(Hv))
        self.norm = GatedRMSNorm(Dv, cfg.norm_eps)
        self.out_proj = nn.Linear(Hv * Dv, d_model, bias=False)
        self.here = (Hv, Hk)  # the value and key heads this process computes (all; its share under tensor parallelism)
        self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None):
        """dt_bias 1 and A = exp(A_log) uniform in [1, 16]."""
        with torch.no_grad():
            nn.init.ones_(self.dt_bias)
            self.A_log.uniform_(1.0, 16.0, generator=generator).log_()

    def new_state(self, batch, max_len, *, dtype, device) -> FixedState:
        """The last ``conv_kernel - 1`` convolution inputs (B, channels, K - 1) and ``S`` (B, value heads,
        key_dim, value_dim): of fixed size whatever the length."""
        cfg = self.cfg
        return FixedState(batch, device, conv=((self.conv_dim, cfg.conv_kernel - 1), dtype),
                          S=((self.n_heads, cfg.key_dim, cfg.value_dim), dtype))

    def forward(self, x, ctx, pos=None):
        from zoo.core.parallel import local

        x = local(x)  # the whole sequence, this process computing its heads' share
        B, T, _ = x.shape
        (Hv, Hk), Dk, Dv = self.here, self.cfg.key_dim, self.cfg.value_dim
        r = Hv // Hk
        conv_dim = 2 * Hk * Dk + Hv * Dv
        f32 = torch.promote_types(x.dtype, torch.float32)  # the recurrence runs in float32 at least
        if ctx.key_mask is not None:  # padding writes nothing: its inputs are zeros
            x = x * ctx.key_mask[:, ctx.slots][..., None].to(x.dtype)
        mixed, z = self.in_proj_qkvz(x).split([conv_dim, Hv * Dv], -1)
        b, a = self.in_proj_ba(x).split([Hv, Hv], -1)
        state = ctx.state.layers[self.index] if ctx.state is not None else None
        mixed = self.conv1d(mixed, state.get(B)[0] if state is not None else None, ctx.documents)  # (B, T, channels)
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2).to(f32)  # (B, heads, T, d)
                   for t, d in zip(mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], -1), (Dk, Dk, Dv)))
        q, k = l2norm(q) * Dk ** -0.5, l2norm(k)
        beta = b.transpose(1, 2).to(f32).sigmoid()
        g = (-local(self.A_log).to(f32).exp() * F.softplus(a.to(f32) + local(self.dt_bias))).transpose(1, 2)
        S0 = state.get(B)[1].to(f32) if state is not None else None
        if state is not None and T == 1:  # each key head serves r consecutive value heads
            y, S = recurrent_gated_delta_rule(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, g, beta, S0)
        elif ctx.documents is not None:  # packed documents: the reference core, reset at each document's start
            y, S = chunk_gated_delta_rule(q, k, v, g, beta, S0, self.cfg.chunk_size, document_starts(ctx.documents))
        else:
            y, S = (kernels.fast(self, v) or chunk_gated_delta_rule)(q, k, v, g, beta, S0, self.cfg.chunk_size)
        if state is not None:
            state.S.copy_(S)
        y = self.norm(y.transpose(1, 2).to(x.dtype), z.view(B, T, Hv, Dv))
        return self.out_proj(y.reshape(B, T, Hv * Dv))

    # -- what this part states about itself ---------------------------------------------------------
    #: The per-head decay rate and time-step offset take no weight decay.
    no_decay = ("A_log", "dt_bias")

    @staticmethod
    def shrink(cfg, *, head_dim: int = 8, **_) -> dict:
        """4 value heads of ``head_dim``, 2 key heads when the model groups them."""
        grouped = cfg.n_key_heads is not None and cfg.n_key_heads != cfg.n_heads
        return {"n_heads": 4, "n_key_heads": 2 if grouped else None, "key_dim": head_dim, "value_dim": head_dim}

    def cost(self, context: int) -> Cost:
        """Per token the state is decayed, read by the key, written and read by the query:
        ``6 * key_dim * value_dim`` FLOPs per value head (the recurrent form's count); the state
        is the convolution window plus one matrix per value head, whatever the context."""
        per_head = self.cfg.key_dim * self.cfg.value_dim
        flops = 6 * self.n_heads * per_head
        return Cost(flops=flops, flops_mean=flops,
                    state_fixed=self.n_heads * per_head + self.conv_dim * (self.cfg.conv_kernel - 1))

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token, of this process's heads: the input the projections read (the whole sequence, gathered
        under tensor parallelism); the convolution's window and output, and q and k in float32; the float32
        reciprocal norms of q and k, beta and the decay's two factors; the chunked rule's own
        (:func:`chunked_bytes`); the gated norm's float32 input, its normed and weighted outputs, the float32
        gate and its input (a view of the projection's output when that is float32), the reciprocal RMS; the
        output ``out_proj`` reads."""
        cfg, c = self.cfg, dtype.itemsize
        H, Dk, Dv = self.n_heads / tp, cfg.key_dim, cfg.value_dim
        Hk = max(self.n_key_heads / tp, 1)  # one key head shared by processes when tp exceeds them
        conv = 2 * Hk * Dk + H * Dv
        core = chunked_bytes(H, Hk, Dk, Dv, min(cfg.chunk_size, seq_len), device=device)
        x = (conv if c == 4 else 2 * Hk * Dk) * 4  # q and k in float32: a view of the convolution's output, or a copy
        z = self.in_proj_qkvz.out_features * 4 if c == 4 else H * Dv * 4  # the gate's input: a view, or a copy
        norm = H * Dv * (8 + 2 * c) + z + H * 4
        return self.in_proj_qkvz.in_features * c + 2 * conv * c + x + (2 * Hk + 3 * H) * 4 + core + norm + H * Dv * c

    def facts(self) -> dict:
        return {"recurrence": "gated delta rule", "value heads": self.n_heads, "key heads": self.n_key_heads,
                "key_dim": self.cfg.key_dim, "value_dim": self.cfg.value_dim, "conv_kernel": self.cfg.conv_kernel,
                "chunk_size": self.cfg.chunk_size}

    def parallelize(self, tp_mesh) -> None:
        """Tensor parallelism by value heads: the sequence gathered; the packed ``in_proj_qkvz`` (``[q | k |
        v | z]``), ``in_proj_ba`` (``[b | a]``) and the convolution over ``[q | k | v]`` compute this process's
        rows of each section (:func:`~zoo.core.parallel.packed_in`): its value heads' v, z, b and a, and the
        q and k of the key heads serving them (``n_key_heads / tp`` key heads, or the one key head ``tp /
        n_key_heads`` processes share, its gradient summed over them); ``dt_bias`` and ``A_log`` sharded by
        value heads; the gated norm, per head, with its weight replicated (its gradient summed over the
        processes); ``out_proj`` by its columns, reduce-scattered back onto the sequence slice."""
        from torch.distributed.tensor.parallel import parallelize_module

        from zoo.core.parallel import heads_out, local_count, packed_in, section_rows, sequence_input, shard_rows

        Hv, Hk, Dk, Dv, tp = self.n_heads, self.n_key_heads, self.cfg.key_dim, self.cfg.value_dim, tp_mesh.size()
        heads = local_count(Hv, tp_mesh, "n_heads", self)
        if Hk % tp and tp % Hk:
            raise NotImplementedError(f"{type(self).__name__}: n_key_heads = {Hk} and tp = {tp}: each process's value "
                                      f"heads must be served by whole key heads or by one; choose a tp that divides "
                                      f"n_key_heads or that n_key_heads divides")
        qk, v = (Hk, Dk), (Hv, Dv)
        parallelize_module(self, tp_mesh, sequence_input(tp_mesh))
        packed_in(self.in_proj_qkvz, section_rows([qk, qk, v, v], tp_mesh), tp_mesh)
        packed_in(self.in_proj_ba, section_rows([(Hv, 1), (Hv, 1)], tp_mesh), tp_mesh)
        packed_in(self.conv1d, section_rows([qk, qk, v], tp_mesh), tp_mesh)
        parallelize_module(self, tp_mesh, {"out_proj": heads_out()})
        shard_rows(self, tp_mesh)  # dt_bias, A_log: one per value head
        self.norm.parallelize(tp_mesh, sharded=False)
        self.here = (heads, max(Hk // tp, 1))
