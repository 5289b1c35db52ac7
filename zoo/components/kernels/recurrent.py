"""The chunked scalar-decay recurrence (``zoo.components.mixers._recurrent.chunked``) as Triton kernels,
forward and backward.

One program per (batch and head, block of value columns) walks the sequence chunk by chunk with its
columns of the state ``S`` (Dk x BV, fp32) held on chip: within a chunk the output is the masked matmul ``((q k^T) * L) v`` plus what the
carried state contributes, and the state is decayed and updated once per chunk. Nothing of size T x
T or per-chunk states is written to memory.

The backward runs two more sweeps: forward again (rebuilding the carried states) for ``dq``, and
backward from the final state's gradient for ``dk``, ``dv`` and the initial state's gradient. The
log-decays' gradient follows from those without another kernel: with ``c`` the cumulative
log-decay, ``d a_m = sum_{t >= m} (q_t . dq_t - k_t . dk_t) + <dS_T, S_T>``, summed from ``dq`` and
``dk`` in fp32 before they are rounded to the inputs' dtype (a reversed cumulative sum of a
difference would otherwise add up their rounding errors).

The value columns are split into blocks of 64 (or 32) when that divides them and they are wider
than 64, as in the gated delta kernel: no program holds a whole 256 x 256 state, which would not
fit an H100's shared memory. ``dq`` and ``dk`` then get one share per block, summed in PyTorch.
The launch configurations are chosen by the block sizes (:func:`_configs`) and autotuned among on
a GPU (:mod:`zoo.components.kernels.tuning`); ``tests/kernels/test_kernels_fit.py`` compiles each for sm_90.

Products run in fp32 (IEEE for fp32 inputs, TF32 tensor cores otherwise: the inputs were 16-bit).
The grid is (batch x heads, value blocks): the first axis may hold 2^31 - 1 programs, the second
65,535. Forward and backward are custom operators (``zoo::scalar_decay`` and its backward), which
``torch.compile`` calls as they are.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from zoo.components.kernels import on_device
from zoo.components.kernels.tuning import launch


@triton.jit
def _chunk_decays(A, base, t0, T, BT: tl.constexpr):
    """Cumulative log-decay within the chunk starting at t0 (0 past the end), and its total."""
    offs = t0 + tl.arange(0, BT)
    a = tl.load(A + base + offs, mask=offs < T, other=0.0).to(tl.float32)
    c = tl.cumsum(a, 0)
    return c, tl.sum(a, 0)


@triton.jit
def _tile(X, base, t0, T, D, BT: tl.constexpr, BD: tl.constexpr):
    t = t0 + tl.arange(0, BT)
    d = tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D)
    return tl.load(X + base + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _store_tile(X, base, t0, T, D, value, BT: tl.constexpr, BD: tl.constexpr):
    t = t0 + tl.arange(0, BT)
    d = tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D)
    tl.store(X + base + t[:, None] * D + d[None, :], value.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _decay_matrix(c, BT: tl.constexpr):
    """L[i, j] = exp(c_i - c_j) for j <= i, else 0 (the exponent is masked before exp)."""
    i = tl.arange(0, BT)
    causal = i[:, None] >= i[None, :]
    return tl.exp(tl.where(causal, c[:, None] - c[None, :], float("-inf")))


@triton.jit
def _state_ptrs(S, bh, Dk, Dv, BK: tl.constexpr, BV: tl.constexpr):
    k = tl.arange(0, BK)
    v = tl.arange(0, BV)
    return S + bh * Dk * Dv + k[:, None] * Dv + v[None, :], (k[:, None] < Dk) & (v[None, :] < Dv)


@triton.jit
def _initial_state(S0, bh, Dk, Dv, HAS_S0: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    S = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_S0:
        s_ptrs, s_mask = _state_ptrs(S0, bh, Dk, Dv, BK, BV)
        S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    return S


@triton.jit
def _advance(S, k, v, c, total, PREC: tl.constexpr):
    """The state after the chunk: exp(total) S + sum_j exp(total - c_j) k_j v_j^T."""
    k_end = k * tl.exp(total - c)[:, None]
    return S * tl.exp(total) + tl.dot(tl.trans(k_end), v, input_precision=PREC)


@triton.jit
def _fwd(Q, K, V, A, S0, Y, ST, T, Dk, Dv, HAS_S0: tl.constexpr, PREC: tl.constexpr,
         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BV
    S = _initial_state(S0 + v0, bh, Dk, Dv, HAS_S0, BK, BV)
    for t0 in range(0, T, BT):
        c, total = _chunk_decays(A, bh * T, t0, T, BT)
        q, _ = _tile(Q, bh * T * Dk, t0, T, Dk, BT, BK)
        k, _ = _tile(K, bh * T * Dk, t0, T, Dk, BT, BK)
        v, _ = _tile(V + v0, bh * T * Dv, t0, T, Dv, BT, BV)
        att = tl.dot(q, tl.trans(k), input_precision=PREC) * _decay_matrix(c, BT)
        y = tl.dot(att, v, input_precision=PREC)
        y += tl.dot(q * tl.exp(c)[:, None], S, input_precision=PREC)
        _store_tile(Y + v0, bh * T * Dv, t0, T, Dv, y, BT, BV)
        S = _advance(S, k, v, c, total, PREC)
    st_ptrs, st_mask = _state_ptrs(ST + v0, bh, Dk, Dv, BK, BV)
    tl.store(st_ptrs, S, mask=st_mask)


@triton.jit
def _bwd_dq(Q, K, V, A, S0, DY, DQ, T, Dk, Dv, HAS_S0: tl.constexpr, PREC: tl.constexpr,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """dq_i = sum_{j<=i} L_ij (dy_i . v_j) k_j + exp(c_i) S_in dy_i, rebuilding S_in chunk by chunk:
    this block of value columns' share, written to DQ's slice for the block."""
    bh = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BV
    part = tl.program_id(1) * tl.num_programs(0).to(tl.int64)  # the block's slice, in (batch, head) rows
    S = _initial_state(S0 + v0, bh, Dk, Dv, HAS_S0, BK, BV)
    for t0 in range(0, T, BT):
        c, total = _chunk_decays(A, bh * T, t0, T, BT)
        k, _ = _tile(K, bh * T * Dk, t0, T, Dk, BT, BK)
        v, _ = _tile(V + v0, bh * T * Dv, t0, T, Dv, BT, BV)
        dy, _ = _tile(DY + v0, bh * T * Dv, t0, T, Dv, BT, BV)
        datt = tl.dot(dy, tl.trans(v), input_precision=PREC) * _decay_matrix(c, BT)
        dq = tl.dot(datt, k, input_precision=PREC)
        dq += tl.dot(dy, tl.trans(S), input_precision=PREC) * tl.exp(c)[:, None]
        _store_tile(DQ, (part + bh) * T * Dk, t0, T, Dk, dq, BT, BK)
        S = _advance(S, k, v, c, total, PREC)


@triton.jit
def _bwd_dkv(Q, K, V, A, DY, DST, DK, DV, DS0, T, Dk, Dv, HAS_DST: tl.constexpr, PREC: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """From the last chunk back: dk, dv from within the chunk and from the state gradient dS carried
    back from later chunks; dS_in = exp(total) dS + sum_i exp(c_i) q_i dy_i^T. dk is this block of value
    columns' share (DK's slice for the block); dv and dS are the block's own columns."""
    bh = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BV
    part = tl.program_id(1) * tl.num_programs(0).to(tl.int64)
    dS = _initial_state(DST + v0, bh, Dk, Dv, HAS_DST, BK, BV)
    n_chunks = tl.cdiv(T, BT)
    for n in range(n_chunks):
        t0 = (n_chunks - 1 - n) * BT
        c, total = _chunk_decays(A, bh * T, t0, T, BT)
        q, _ = _tile(Q, bh * T * Dk, t0, T, Dk, BT, BK)
        k, _ = _tile(K, bh * T * Dk, t0, T, Dk, BT, BK)
        v, _ = _tile(V + v0, bh * T * Dv, t0, T, Dv, BT, BV)
        dy, _ = _tile(DY + v0, bh * T * Dv, t0, T, Dv, BT, BV)
        L = _decay_matrix(c, BT)
        to_end = tl.exp(total - c)[:, None]
        datt = tl.dot(dy, tl.trans(v), input_precision=PREC) * L  # [i, j]
        att = tl.dot(q, tl.trans(k), input_precision=PREC) * L
        dk = tl.dot(tl.trans(datt), q, input_precision=PREC)
        dk += tl.dot(v, tl.trans(dS), input_precision=PREC) * to_end
        dv = tl.dot(tl.trans(att), dy, input_precision=PREC)
        dv += tl.dot(k, dS, input_precision=PREC) * to_end
        _store_tile(DK, (part + bh) * T * Dk, t0, T, Dk, dk, BT, BK)
        _store_tile(DV + v0, bh * T * Dv, t0, T, Dv, dv, BT, BV)
        dS = dS * tl.exp(total) + tl.dot(tl.trans(q * tl.exp(c)[:, None]), dy, input_precision=PREC)
    ds_ptrs, ds_mask = _state_ptrs(DS0 + v0, bh, Dk, Dv, BK, BV)
    tl.store(ds_ptrs, dS, mask=ds_mask)


def _blocks(Dk, Dv):
    """(BT, BK, BV): the chunk, the key width and the width of a block of value columns (64 or 32
    when that divides Dv and Dv is wider than 64, else all of Dv). The chunk shrinks for wide tiles
    so that a program's tiles fit."""
    BK = max(16, triton.next_power_of_2(Dk))
    BV = next((b for b in (64, 32) if Dv > 64 and Dv % b == 0), max(16, triton.next_power_of_2(Dv)))
    BT = 64 if max(BK, BV) <= 64 else 32 if max(BK, BV) <= 128 else 16
    return BT, BK, BV


def _configs(BK, BV):
    """The (num_warps, num_stages) a launch at these widths may take, the first off a GPU. Two
    pipeline stages: three put the gated delta backward over sm_90's shared memory (with fp32 inputs
    at 128-wide heads, with bf16 at 64-wide ones in chunks of 64). Wide tiles try eight warps first,
    as they spill about half of four's stack (docs/reference/kernels.md)."""
    return ((8, 2), (4, 2)) if max(BK, BV) > 64 else ((4, 2),)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
             s0: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, final fp32 state) from contiguous q, k, v, fp32 log-decays ``a`` and fp32 ``s0``."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    y = torch.empty_like(v)
    st = torch.empty(B, H, Dk, Dv, device=q.device, dtype=torch.float32)
    BT, BK, BV = _blocks(Dk, Dv)
    with on_device(q):
        launch(_fwd, (B * H, triton.cdiv(Dv, BV)), _configs(BK, BV), q, k, v, a, s0 if s0 is not None else st,
               y, st, T, Dk, Dv, HAS_S0=s0 is not None, PREC=_precision(q), BT=BT, BK=BK, BV=BV)
    return y, st


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, s0: Optional[torch.Tensor],
              st: torch.Tensor, dy: Optional[torch.Tensor], dst: Optional[torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, da, ds0): ``ds0`` is empty without an initial state."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    BT, BK, BV = _blocks(Dk, Dv)
    NV = triton.cdiv(Dv, BV)
    dy = torch.zeros_like(v) if dy is None else dy.contiguous()
    # dq and dk in fp32, one share per block of value columns: summed, and the log-decays'
    # gradient taken from them, before they are rounded to the inputs' dtype
    dq, dk = (torch.empty(NV, B, H, T, Dk, device=q.device, dtype=torch.float32) for _ in range(2))
    dv = torch.empty_like(v)
    ds0 = torch.empty(B, H, Dk, Dv, device=q.device, dtype=torch.float32)
    dst_ = dst.float().contiguous() if dst is not None else None
    grid, configs, prec = (B * H, NV), _configs(BK, BV), _precision(q)
    with on_device(q):
        launch(_bwd_dq, grid, configs, q, k, v, a, s0 if s0 is not None else st, dy, dq, T, Dk, Dv,
               HAS_S0=s0 is not None, PREC=prec, BT=BT, BK=BK, BV=BV)
        launch(_bwd_dkv, grid, configs, q, k, v, a, dy, dst_ if dst_ is not None else ds0, dk, dv, ds0, T, Dk, Dv,
               HAS_DST=dst_ is not None, PREC=prec, BT=BT, BK=BK, BV=BV)
    dq, dk = dq.sum(0), dk.sum(0)
    # d a_m = sum_{t >= m} (q_t . dq_t - k_t . dk_t) + <dS_T, S_T>
    per_step = (q.float() * dq).sum(-1) - (k.float() * dk).sum(-1)
    da = per_step.flip(-1).cumsum(-1).flip(-1)
    if dst_ is not None:
        da = da + (dst_ * st).sum((-1, -2))[..., None]
    return dq.to(q.dtype), dk.to(k.dtype), dv, da, ds0 if s0 is not None else ds0.new_empty(0)


def _precision(q):
    """The products' precision: IEEE fp32 for fp32 inputs, TF32 tensor cores for 16-bit ones."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


# Forward and backward are custom operators, so that torch.compile calls them as they are instead of
# tracing into the Triton launches.
_forward_op = torch.library.custom_op("zoo::scalar_decay", _forward, mutates_args=())
_backward_op = torch.library.custom_op("zoo::scalar_decay_backward", _backward, mutates_args=())


@_forward_op.register_fake
def _(q, k, v, a, s0):
    return torch.empty_like(v), q.new_empty(*q.shape[:2], q.shape[-1], v.shape[-1], dtype=torch.float32)


@_backward_op.register_fake
def _(q, k, v, a, s0, st, dy, dst):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(a),
            torch.empty_like(st) if s0 is not None else st.new_empty(0))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])
    ctx.set_materialize_grads(False)  # a gradient not given (None) takes the kernels' cheaper path


def _grads(ctx, dy, dst):
    q, k, v, a, s0, st = ctx.saved_tensors
    dq, dk, dv, da, ds0 = _backward_op(q, k, v, a, s0, st, dy, dst)
    return dq, dk, dv, da, ds0 if s0 is not None else None


_forward_op.register_autograd(_grads, setup_context=_setup_context)


def chunked(q, k, v, log_decay=None, state=None, chunk=64):
    """:func:`zoo.components.mixers._recurrent.chunked` on Triton (``chunk`` is the reference's; the kernel
    picks its own from the head widths, which changes only the order of fp32 sums)."""
    if log_decay is None:
        log_decay = q.new_zeros(q.shape[:-1], dtype=torch.float32)
    q, k, v, a = (t.contiguous() for t in (q, k, v, log_decay.float()))  # autograd rounds da and ds0 back
    return _forward_op(q, k, v, a, state.float().contiguous() if state is not None else None)
