"""The chunked gated delta rule (``zoo.components.mixers.gated_deltanet.chunk_gated_delta_rule``) as Triton
kernels, forward and backward.

Per value head and chunk of ``C`` tokens, with ``G`` the cumulative log decay from the chunk's start
and ``D[i, j] = exp(G_i - G_j)`` (``j <= i``), the chunked form is::

    (I + A) [u | w] = [beta v | beta k exp(G)]      A: strictly lower part of (beta k k^T) * D
    v' = u - w S
    out = (q exp(G)) S + ((q k^T) * D) v'
    S  <- exp(G_C) S + (k exp(G_C - G))^T v'

What runs where:

- PyTorch: padding to a whole number of chunks, the cumulative sums ``G`` of the log decays within
  each chunk (autograd gives their backward), and the sums of the kernels' per-value-head gradient
  shares over blocks of value columns and over the value heads a key head serves.
- Triton, the UT transform (:func:`_ut_fwd`, :func:`_ut_bwd`, :func:`_ut_transform` and its
  backward): one program per (chunk, batch and value head), all chunks in parallel. It builds ``A``,
  inverts ``I + A`` by forward substitution (row ``r`` of the inverse ``T`` is ``e_r - sum_{j<r}
  A_rj T_j``: exact, as a triangular solve is) and multiplies out ``u`` and ``w``; its backward
  rebuilds ``T`` and gives ``dk``, ``dv``, ``dG`` and ``dbeta`` through ``T``, ``A`` and the right-hand side.
- Triton, the inter-chunk pass (:func:`_fwd`, :func:`_inter_chunk`): one program per (batch, value
  head, block of value columns) walks the chunks in order with its columns of ``S`` (Dk x BV,
  fp32) on chip and computes ``v'``, the masked ``(q k^T) * D``, the decayed ``q`` and ``k``, the
  outputs and the next state. Its backward (:func:`_bwd`) is a reverse sweep carrying ``dS`` back
  from the final state's gradient, giving ``du = dv'``, ``dw``, ``dq``, ``dk`` (within the chunk
  and through the state), ``dG`` (through ``D``, the decayed ``q`` and ``k`` and ``exp(G_C)``) and
  the initial state's gradient. The states before each chunk and ``v'`` are not kept from the
  forward: keeping them would hold ``Dk * Dv / C`` floats per token and value head (512 at
  Qwen3-Next's 128 x 128 heads and the 32-token chunk used there: more than q, k and v together)
  from every layer's forward to its backward. Nor does the backward hold all N of them: it works
  in segments of about sqrt(N) chunks (:func:`_segment`). One rerun of :func:`_fwd` writes ``v'``
  and the state before each segment; then, from the last segment back, a rerun over the segment
  writes the states before its chunks and :func:`_bwd` sweeps it, carrying ``dS`` to the segment
  before. About 2 sqrt(N) states (B, H, Dk, Dv) are held, for one more forward sweep.

The key head of value head ``h`` is ``h // (H / Hk)``: grouped q and k are read, never repeated.
The value columns are split into blocks only when a block width divides ``Dv`` (so the scalar-decay
kernel's tile helpers, imported from it, mask them right); otherwise one block holds them all.
Products run in fp32: IEEE for fp32 inputs, TF32 tensor cores for 16-bit ones (which carry no more
precision). Every grid has B x H (for the UT transform, B x H x chunks) on its first axis, which may
hold 2^31 - 1 programs (the others 65,535). The launch configurations are the scalar-decay
kernel's (:func:`zoo.components.kernels.recurrent._configs`), autotuned among on a GPU. Each pass
and its backward are custom operators (``zoo::gated_delta_ut``, ``zoo::gated_delta_chunks``), which
``torch.compile`` calls as they are.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from zoo.components.kernels import on_device
from zoo.components.kernels.recurrent import _advance, _decay_matrix, _state_ptrs, _store_tile, _tile
from zoo.components.kernels.recurrent import _blocks as scalar_decay_blocks
from zoo.components.kernels.recurrent import _configs, _precision
from zoo.components.kernels.tuning import launch


@triton.jit
def _decays(Gp, bh, n, Tp, C: tl.constexpr):
    """The chunk's cumulative log decays ``G`` (C,) and its total ``G_C``."""
    i = tl.arange(0, C)
    G = tl.load(Gp + bh * Tp + n * C + i)
    return G, tl.sum(tl.where(i == C - 1, G, 0.0), 0)


@triton.jit
def _fwd(Q, K, Gp, U, W, S0, O, ST, SB, VN, Tp, H, Hk, Dk, Dv, N0, N1, EVERY, NSB,
         HAS_S0: tl.constexpr, STORE: tl.constexpr, PREC: tl.constexpr,
         C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Forward over chunks ``N0`` to ``N1`` from the state S0 (at chunk N0). ``STORE``: instead of the
    outputs and the final state, write ``v'`` (VN) and the state before every ``EVERY``-th chunk
    from N0 (SB, ``NSB`` states per value head), for the backward."""
    bh = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BV
    bk = (bh // H) * Hk + (bh % H) // (H // Hk)  # the key head serving this value head
    S = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_S0:
        s_ptrs, s_mask = _state_ptrs(S0 + v0, bh, Dk, Dv, BK, BV)
        S = tl.load(s_ptrs, mask=s_mask, other=0.0)
    for n in range(N0, N1):
        G, G_C = _decays(Gp, bh, n, Tp, C)
        q, _ = _tile(Q, bk * Tp * Dk, n * C, Tp, Dk, C, BK)
        k, _ = _tile(K, bk * Tp * Dk, n * C, Tp, Dk, C, BK)
        w, _ = _tile(W, bh * Tp * Dk, n * C, Tp, Dk, C, BK)
        u, _ = _tile(U + v0, bh * Tp * Dv, n * C, Tp, Dv, C, BV)
        vn = u - tl.dot(w, S, input_precision=PREC)
        if STORE:
            if (n - N0) % EVERY == 0:
                sb_ptrs, sb_mask = _state_ptrs(SB + v0, bh * NSB + (n - N0) // EVERY, Dk, Dv, BK, BV)
                tl.store(sb_ptrs, S, mask=sb_mask)
            _store_tile(VN + v0, bh * Tp * Dv, n * C, Tp, Dv, vn, C, BV)
        else:
            att = tl.dot(q, tl.trans(k), input_precision=PREC) * _decay_matrix(G, C)
            o = tl.dot(q * tl.exp(G)[:, None], S, input_precision=PREC) + tl.dot(att, vn, input_precision=PREC)
            _store_tile(O + v0, bh * Tp * Dv, n * C, Tp, Dv, o, C, BV)
        S = _advance(S, k, vn, G, G_C, PREC)
    if not STORE:
        st_ptrs, st_mask = _state_ptrs(ST + v0, bh, Dk, Dv, BK, BV)
        tl.store(st_ptrs, S, mask=st_mask)


@triton.jit
def _bwd(Q, K, Gp, W, SB, VN, DO, DST, DQ, DK, DG, DU, DW, DS0, Tp, H, Hk, Dk, Dv, N0, N1, NSB,
         HAS_DST: tl.constexpr, PREC: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """From chunk ``N1 - 1`` back to ``N0`` (SB: the states before them, ``NSB`` per value head), with ``dS`` the gradient of
    the state after the chunk (DST at N1; DS0 gets it at N0):
    dv' = P^T dO + kd dS (= du), dP = dO v'^T, d(q e^G) = dO S^T, d(kd) = v' dS^T, dw = -dv' S^T,
    and dS before the chunk = e^{G_C} dS + (q e^G)^T dO - w^T dv'. DQ, DK, DW, DG are this column
    block's share (per value head); DU and DS0 are whole."""
    j = tl.program_id(1)
    v0 = j * BV
    bh = tl.program_id(0).to(tl.int64)
    bk = (bh // H) * Hk + (bh % H) // (H // Hk)
    part = j * tl.num_programs(0).to(tl.int64)  # offset of this column block's shares, in value heads
    dS = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_DST:
        d_ptrs, d_mask = _state_ptrs(DST + v0, bh, Dk, Dv, BK, BV)
        dS = tl.load(d_ptrs, mask=d_mask, other=0.0)
    i = tl.arange(0, C)
    for m in range(N1 - N0):
        n = N1 - 1 - m
        G, G_C = _decays(Gp, bh, n, Tp, C)
        q, _ = _tile(Q, bk * Tp * Dk, n * C, Tp, Dk, C, BK)
        k, _ = _tile(K, bk * Tp * Dk, n * C, Tp, Dk, C, BK)
        w, _ = _tile(W, bh * Tp * Dk, n * C, Tp, Dk, C, BK)
        vn, _ = _tile(VN + v0, bh * Tp * Dv, n * C, Tp, Dv, C, BV)
        do, _ = _tile(DO + v0, bh * Tp * Dv, n * C, Tp, Dv, C, BV)
        sb_ptrs, sb_mask = _state_ptrs(SB + v0, bh * NSB + n - N0, Dk, Dv, BK, BV)
        S = tl.load(sb_ptrs, mask=sb_mask, other=0.0)
        L = _decay_matrix(G, C)
        eG = tl.exp(G)[:, None]
        to_end = tl.exp(G_C - G)[:, None]
        P = tl.dot(q, tl.trans(k), input_precision=PREC) * L
        dP = tl.dot(do, tl.trans(vn), input_precision=PREC)
        dvn = tl.dot(tl.trans(P), do, input_precision=PREC) + tl.dot(k * to_end, dS, input_precision=PREC)
        dqg = tl.dot(do, tl.trans(S), input_precision=PREC)       # d(q e^G)
        dkd = tl.dot(vn, tl.trans(dS), input_precision=PREC)      # d(k e^{G_C - G})
        dw = -tl.dot(dvn, tl.trans(S), input_precision=PREC)
        dqk = dP * L                                               # d(q k^T)
        dq = tl.dot(dqk, k, input_precision=PREC) + dqg * eG
        dk = tl.dot(tl.trans(dqk), q, input_precision=PREC) + dkd * to_end
        # dG_i: through q e^G and k e^{G_C - G} row i, and through D's row i minus its column i
        M = dP * P
        from_k = tl.sum(dkd * k * to_end, 1)
        dG = tl.sum(dqg * q * eG, 1) - from_k + tl.sum(M, 1) - tl.sum(M, 0)
        dG += tl.where(i == C - 1, tl.sum(from_k, 0) + tl.exp(G_C) * tl.sum(tl.sum(dS * S, 1), 0), 0.0)
        _store_tile(DU + v0, bh * Tp * Dv, n * C, Tp, Dv, dvn, C, BV)
        _store_tile(DQ, (part + bh) * Tp * Dk, n * C, Tp, Dk, dq, C, BK)
        _store_tile(DK, (part + bh) * Tp * Dk, n * C, Tp, Dk, dk, C, BK)
        _store_tile(DW, (part + bh) * Tp * Dk, n * C, Tp, Dk, dw, C, BK)
        tl.store(DG + (part + bh) * Tp + n * C + i, dG)
        dS = dS * tl.exp(G_C) + tl.dot(tl.trans(q * eG), do, input_precision=PREC) \
            - tl.dot(tl.trans(w), dvn, input_precision=PREC)
    ds_ptrs, ds_mask = _state_ptrs(DS0 + v0, bh, Dk, Dv, BK, BV)
    tl.store(ds_ptrs, dS, mask=ds_mask)


@triton.jit
def _ut(k, G, beta, PREC: tl.constexpr, C: tl.constexpr):
    """The chunk's A (strictly lower part of (beta k k^T) * D), its (k k^T) * D, and
    T = (I + A)^{-1} by forward substitution: row r of T is e_r - sum_{j<r} A_rj T_j."""
    i = tl.arange(0, C)
    KD = tl.dot(k, tl.trans(k), input_precision=PREC) * _decay_matrix(G, C)
    A = tl.where(i[:, None] > i[None, :], KD * beta[:, None], 0.0)
    T = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for r in range(1, C):
        a = tl.sum(tl.where(i[:, None] == r, A, 0.0), 0)  # row r of A
        T = tl.where(i[:, None] == r, T - tl.sum(a[:, None] * T, 0)[None, :], T)
    return A, KD, T


@triton.jit
def _ut_fwd(K, V, Gp, Beta, U, W, Tp, H, Hk, Dk, Dv, PREC: tl.constexpr,
            C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr):
    """One program per (batch and value head, chunk), on one axis of the grid: u = T (beta v),
    w = T (beta exp(G) k)."""
    pid = tl.program_id(0).to(tl.int64)
    n, bh = pid % (Tp // C), pid // (Tp // C)
    bk = (bh // H) * Hk + (bh % H) // (H // Hk)
    G, _ = _decays(Gp, bh, n, Tp, C)
    beta = tl.load(Beta + bh * Tp + n * C + tl.arange(0, C))
    k, _ = _tile(K, bk * Tp * Dk, n * C, Tp, Dk, C, BK)
    v, _ = _tile(V, bh * Tp * Dv, n * C, Tp, Dv, C, BVF)
    _, _, T = _ut(k, G, beta, PREC, C)
    _store_tile(U, bh * Tp * Dv, n * C, Tp, Dv, tl.dot(T, v * beta[:, None], input_precision=PREC), C, BVF)
    w = tl.dot(T, k * (beta * tl.exp(G))[:, None], input_precision=PREC)
    _store_tile(W, bh * Tp * Dk, n * C, Tp, Dk, w, C, BK)


@triton.jit
def _ut_bwd(K, V, Gp, Beta, DU, DW, DK, DV, DG, DB, Tp, H, Hk, Dk, Dv, PREC: tl.constexpr,
            C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr):
    """With R = [beta v | beta exp(G) k] and [u | w] = T R: dR = T^T [du | dw],
    dA = -T^T ([du | dw] R^T) T^T on the strictly lower part, then through A = beta_i (k k^T) * D
    and R to dk (this value head's share), dv, dG and dbeta."""
    pid = tl.program_id(0).to(tl.int64)
    n, bh = pid % (Tp // C), pid // (Tp // C)
    bk = (bh // H) * Hk + (bh % H) // (H // Hk)
    i = tl.arange(0, C)
    G, _ = _decays(Gp, bh, n, Tp, C)
    beta = tl.load(Beta + bh * Tp + n * C + i)
    k, _ = _tile(K, bk * Tp * Dk, n * C, Tp, Dk, C, BK)
    v, _ = _tile(V, bh * Tp * Dv, n * C, Tp, Dv, C, BVF)
    du, _ = _tile(DU, bh * Tp * Dv, n * C, Tp, Dv, C, BVF)
    dw, _ = _tile(DW, bh * Tp * Dk, n * C, Tp, Dk, C, BK)
    A, KD, T = _ut(k, G, beta, PREC, C)
    ek = k * tl.exp(G)[:, None]
    dRu = tl.dot(tl.trans(T), du, input_precision=PREC)
    dRw = tl.dot(tl.trans(T), dw, input_precision=PREC)
    dT = tl.dot(du, tl.trans(v * beta[:, None]), input_precision=PREC) \
        + tl.dot(dw, tl.trans(ek * beta[:, None]), input_precision=PREC)
    dA = -tl.dot(tl.dot(tl.trans(T), dT, input_precision=PREC), tl.trans(T), input_precision=PREC)
    dA = tl.where(i[:, None] > i[None, :], dA, 0.0)
    dKK = dA * beta[:, None] * _decay_matrix(G, C)
    dk = tl.dot(dKK + tl.trans(dKK), k, input_precision=PREC) + dRw * (beta * tl.exp(G))[:, None]
    Z = dA * A  # dA_ij A_ij: A_ij depends on G_i - G_j
    dG = tl.sum(Z, 1) - tl.sum(Z, 0) + tl.sum(dRw * ek, 1) * beta
    db = tl.sum(dA * KD, 1) + tl.sum(dRu * v, 1) + tl.sum(dRw * ek, 1)
    _store_tile(DK, bh * Tp * Dk, n * C, Tp, Dk, dk, C, BK)
    _store_tile(DV, bh * Tp * Dv, n * C, Tp, Dv, dRu * beta[:, None], C, BVF)
    tl.store(DG + bh * Tp + n * C + i, dG)
    tl.store(DB + bh * Tp + n * C + i, db)


def _width(d):
    return max(16, triton.next_power_of_2(d))


def _segment(N):
    """Chunks per segment of the backward: all of them up to 64, else about sqrt(N), so that the
    states held (one per segment, then one per chunk of a segment) are about 2 sqrt(N), not N."""
    return N if N <= 64 else math.isqrt(N - 1) + 1


def _inter_chunk(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                 s0: Optional[torch.Tensor], C: int, BV: int, prec: str,
                 segment: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential pass over chunks: (q, k per key head; G, u, w per value head; S0) -> (outputs,
    final state). All inputs fp32 and contiguous, the length a whole number of chunks. ``segment``
    is the backward's (chunks per segment; None chooses)."""
    B, H, Tp, Dv = u.shape
    Hk, Dk = q.shape[1], q.shape[-1]
    o = torch.empty_like(u)
    st = u.new_empty(B, H, Dk, Dv)
    BK = _width(Dk)
    with on_device(u):
        launch(_fwd, (B * H, triton.cdiv(Dv, BV)), _configs(BK, BV), q, k, G, u, w, s0 if s0 is not None else st,
               o, st, st, o, Tp, H, Hk, Dk, Dv, 0, Tp // C, 1, 1, HAS_S0=s0 is not None, STORE=False, PREC=prec,
               C=C, BK=BK, BV=BV)
    return o, st


def _inter_chunk_backward(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                          s0: Optional[torch.Tensor], do: Optional[torch.Tensor], dst: Optional[torch.Tensor],
                          C: int, BV: int, prec: str, segment: Optional[int]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dG, du, dw, ds0; ``ds0`` empty without an initial state), segment by segment from the
    last: the states before each segment are kept from one forward rerun, and each segment's states
    before its chunks are rebuilt from them just before its reverse sweep."""
    B, H, Tp, Dv = u.shape
    Hk, Dk = q.shape[1], q.shape[-1]
    N, NV, BK = Tp // C, triton.cdiv(Dv, BV), _width(Dk)
    M = min(segment or _segment(N), N)
    grid, configs, common = (B * H, NV), _configs(BK, BV), dict(PREC=prec, C=C, BK=BK, BV=BV)
    NS = triton.cdiv(N, M)
    starts, states, vn = u.new_empty(B, H, NS, Dk, Dv), u.new_empty(B, H, M, Dk, Dv), torch.empty_like(u)
    do = torch.zeros_like(u) if do is None else do.float().contiguous()
    dst = dst.float().contiguous() if dst is not None else None
    dq, dk, dw = (u.new_empty(NV, B, H, Tp, Dk) for _ in range(3))
    dG, du = u.new_empty(NV, B, H, Tp), torch.empty_like(u)
    carried = [u.new_empty(B, H, Dk, Dv) for _ in range(2 if NS > 1 else 1)]  # dS between segments
    s0_ = s0 if s0 is not None else u
    with on_device(u):
        first = starts if NS > 1 else states  # the states before each segment, or before each chunk
        launch(_fwd, grid, configs, q, k, G, u, w, s0_, vn, s0_, first, vn, Tp, H, Hk, Dk, Dv, 0, N, M if NS > 1 else 1,
               first.shape[2], HAS_S0=s0 is not None, STORE=True, **common)
        for i in reversed(range(NS)):
            n0, n1 = i * M, min(N, (i + 1) * M)
            if NS > 1:
                launch(_fwd, grid, configs, q, k, G, u, w, starts[:, :, i].contiguous(), vn, s0_, states, vn,
                       Tp, H, Hk, Dk, Dv, n0, n1, 1, M, HAS_S0=True, STORE=True, **common)
            ds_in = dst if i == NS - 1 else carried[(i + 1) % 2]
            launch(_bwd, grid, configs, q, k, G, w, states, vn, do, ds_in if ds_in is not None else u, dq, dk, dG,
                   du, dw, carried[i % 2], Tp, H, Hk, Dk, Dv, n0, n1, M, HAS_DST=ds_in is not None, **common)
    group = lambda t: t.sum(0).view(B, Hk, H // Hk, Tp, Dk).sum(2)  # noqa: E731  blocks, then heads
    return (group(dq), group(dk), dG.sum(0), du, dw.sum(0), carried[0] if s0 is not None else u.new_empty(0))


def _ut_transform(k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, C: int,
                  prec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k per key head; v, G, beta per value head) -> (u, w), each chunk on its own. All inputs fp32
    and contiguous, the length a whole number of chunks."""
    B, H, Tp, Dv = v.shape
    Hk, Dk = k.shape[1], k.shape[-1]
    u, w = torch.empty_like(v), v.new_empty(B, H, Tp, Dk)
    with on_device(v):
        launch(_ut_fwd, (Tp // C * B * H,), ((4, 2),), k, v, G, beta, u, w, Tp, H, Hk, Dk, Dv, PREC=prec, C=C,
               BK=_width(Dk), BVF=_width(Dv))
    return u, w


def _ut_transform_backward(k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor,
                           du: Optional[torch.Tensor], dw: Optional[torch.Tensor], C: int, prec: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, Tp, Dv = v.shape
    Hk, Dk = k.shape[1], k.shape[-1]
    du = torch.zeros_like(v) if du is None else du.contiguous()
    dw = v.new_zeros(B, H, Tp, Dk) if dw is None else dw.contiguous()
    dk, dv, dG, db = v.new_empty(B, H, Tp, Dk), torch.empty_like(v), torch.empty_like(G), torch.empty_like(beta)
    with on_device(v):
        launch(_ut_bwd, (Tp // C * B * H,), ((4, 2),), k, v, G, beta, du, dw, dk, dv, dG, db, Tp, H, Hk, Dk, Dv,
               PREC=prec, C=C, BK=_width(Dk), BVF=_width(Dv))
    return dk.view(B, Hk, H // Hk, Tp, Dk).sum(2), dv, dG, db


# Each pass is a pair of custom operators, so that torch.compile calls them as they are instead of
# tracing into the Triton launches.
_inter_chunk_op = torch.library.custom_op("zoo::gated_delta_chunks", _inter_chunk, mutates_args=())
_inter_chunk_backward_op = torch.library.custom_op("zoo::gated_delta_chunks_backward", _inter_chunk_backward,
                                                   mutates_args=())
_ut_op = torch.library.custom_op("zoo::gated_delta_ut", _ut_transform, mutates_args=())
_ut_backward_op = torch.library.custom_op("zoo::gated_delta_ut_backward", _ut_transform_backward,
                                          mutates_args=())


@_inter_chunk_op.register_fake
def _(q, k, G, u, w, s0, C, BV, prec, segment):
    return torch.empty_like(u), u.new_empty(*u.shape[:2], q.shape[-1], u.shape[-1])


@_inter_chunk_backward_op.register_fake
def _(q, k, G, u, w, s0, do, dst, C, BV, prec, segment):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(G), torch.empty_like(u), torch.empty_like(w),
            torch.empty_like(s0) if s0 is not None else u.new_empty(0))


@_ut_op.register_fake
def _(k, v, G, beta, C, prec):
    return torch.empty_like(v), v.new_empty(*v.shape[:3], k.shape[-1])


@_ut_backward_op.register_fake
def _(k, v, G, beta, du, dw, C, prec):
    return torch.empty_like(k), torch.empty_like(v), torch.empty_like(G), torch.empty_like(beta)


def _inter_chunk_setup(ctx, inputs, output):
    *tensors, ctx.C, ctx.BV, ctx.prec, ctx.segment = inputs
    ctx.save_for_backward(*tensors)
    ctx.set_materialize_grads(False)  # a gradient not given (None) takes the kernels' cheaper path


def _inter_chunk_grads(ctx, do, dst):
    q, k, G, u, w, s0 = ctx.saved_tensors
    grads = _inter_chunk_backward_op(q, k, G, u, w, s0, do, dst, ctx.C, ctx.BV, ctx.prec, ctx.segment)
    return (*grads[:5], grads[5] if s0 is not None else None, None, None, None, None)


def _ut_setup(ctx, inputs, output):
    *tensors, ctx.C, ctx.prec = inputs
    ctx.save_for_backward(*tensors)
    ctx.set_materialize_grads(False)


def _ut_grads(ctx, du, dw):
    return (*_ut_backward_op(*ctx.saved_tensors, du, dw, ctx.C, ctx.prec), None, None)


_inter_chunk_op.register_autograd(_inter_chunk_grads, setup_context=_inter_chunk_setup)
_ut_op.register_autograd(_ut_grads, setup_context=_ut_setup)


def _blocks(T, chunk_size, Dk, Dv, block_v):
    """The width of a block of value columns (one that divides Dv, else all of them) and the chunk:
    a power of two of at least 16 (for the tensor cores), no longer than ``chunk_size`` or than T
    needs, and shorter for wide heads as the scalar-decay kernel's (so that a program's tiles fit)."""
    BV = block_v or next((b for b in (64, 32) if Dv > 64 and Dv % b == 0), _width(Dv))
    if Dv % BV and BV < Dv:
        raise ValueError(f"gated delta kernel: block_v {BV} must divide the value width {Dv} or cover it")
    return min(_width(min(chunk_size, T)), scalar_decay_blocks(Dk, BV)[0]), BV


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, chunk_size=64, *, block_v=None, segment=None):
    """:func:`zoo.components.mixers.gated_deltanet.chunk_gated_delta_rule` on Triton: the same arguments and
    results (outputs in ``v``'s dtype, the final state in fp32). ``chunk_size`` bounds the kernels'
    chunk (see :func:`_blocks`; the chunk changes only the order of fp32 sums); ``block_v`` forces
    the width of a block of value columns and ``segment`` the chunks per segment of the backward
    (tests)."""
    B, Hk, T, Dk = k.shape
    H, Dv = v.shape[1], v.shape[-1]
    if q.shape != k.shape or v.shape[:3] != (B, H, T) or H % Hk or g.shape != (B, H, T) or beta.shape != (B, H, T):
        raise ValueError(f"gated delta kernel: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, key heads, T, Dk), "
                         f"v {tuple(v.shape)} (B, H, T, Dv) with H a multiple of the key heads, g {tuple(g.shape)} "
                         f"and beta {tuple(beta.shape)} (B, H, T)")
    prec, out_dtype = _precision(q), v.dtype
    C, BV = _blocks(T, chunk_size, Dk, Dv, block_v)
    pad = -T % C
    q, k, v = (F.pad(x.float(), (0, 0, 0, pad)) for x in (q, k, v))  # padded steps neither write nor decay
    g, beta = (F.pad(x.float(), (0, pad)) for x in (g, beta))
    N, Tp = (T + pad) // C, T + pad
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    G = g.view(B, H, N, C).cumsum(-1).view(B, H, Tp)
    u, w = _ut_op(k, v, G, beta, C, prec)
    s0 = state.float().contiguous() if state is not None else None
    out, S = _inter_chunk_op(q, k, G, u, w, s0, C, BV, prec, segment)
    return out[:, :, :T].to(out_dtype), S
