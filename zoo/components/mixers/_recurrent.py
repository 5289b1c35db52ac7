"""The shared core of the recurrent mixers whose state decays by one scalar per head and step.

Per head, with a key width ``Dk`` and a value width ``Dv``::

    S_t = exp(a_t) * S_{t-1} + k_t v_t^T          S: (Dk, Dv), a_t = log of the decay, <= 0
    y_t = q_t^T S_t                                y_t: (Dv,)

Plain linear attention has ``a_t = 0``, RetNet a fixed ``log(gamma)`` per head, lightning attention
(MiniMax) a fixed per-head slope, Mamba-2 a data-dependent ``dt_t * A``. Two equal forms:

- :func:`chunked` (training and prefill): the sequence is cut into chunks of ``chunk`` tokens.
  Within a chunk the output is a masked matmul ``((q k^T) * L) v`` whose mask ``L[i, j] =
  exp(a_{j+1} + ... + a_i)`` (j <= i) comes from segment sums of the log-decays; across chunks a
  state is passed, one step per chunk. O(T * chunk) work, a Python loop over chunks only.
- :func:`step` (decoding): one token onto the state.

What it suits: any mixer whose state is a (Dk, Dv) matrix per head, decayed by one scalar per head
and step and then written by one outer product (linear attention, RetNet, lightning attention,
Mamba-2's SSD; a restart, a decay of 0, is ``a_t = -inf``). It does not suit a per-channel
(diagonal, vector) decay such as RecurrentGemma's RG-LRU or GLA's (write those as their own scan),
nor a delta rule, whose write depends on the state (Gated DeltaNet has its own core).

Numerics: only sums of log-decays over a segment are exponentiated, and those are <= 0, so nothing
exponentiates a large positive number however long the sequence or strong the decay, and no two are
subtracted, so a log-decay of ``-inf`` (a decay of exactly 0: a restart that forgets the state, as at
a document boundary) gives exactly what the recurrence gives instead of ``inf - inf``. The state
is carried in float32 whatever the input dtype; the outputs come back in ``v``'s dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def _check(q, k, v, log_decay, state, *, steps: bool):
    lead = q.shape[:-1]
    if k.shape != q.shape:
        raise ValueError(f"recurrent core: k has shape {tuple(k.shape)}, q {tuple(q.shape)}; they must agree")
    if v.shape[:-1] != lead:
        raise ValueError(f"recurrent core: v has shape {tuple(v.shape)}; its leading dims must be q's {tuple(lead)}")
    if log_decay is not None and log_decay.shape != lead:
        raise ValueError(f"recurrent core: log_decay has shape {tuple(log_decay.shape)}; it must be {tuple(lead)} "
                         f"(one log-decay per head and {'token' if steps else 'row'})")
    want = (*q.shape[:2], q.shape[-1], v.shape[-1])
    if state is not None and tuple(state.shape) != want:
        raise ValueError(f"recurrent core: state has shape {tuple(state.shape)}; it must be {want} (B, H, Dk, Dv)")


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i`` and ``-inf`` above the
    diagonal, from ``a`` (..., C): the log of the decay from step ``j`` to step ``i``. Summed directly
    (not as a difference of two cumulative sums), so it is exact where the sums cancel."""
    C = a.shape[-1]
    x = a[..., None, :].expand(*a.shape, C).transpose(-1, -2)  # x[..., i, j] = a[..., i]
    below = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1)
    x = x.masked_fill(~below, 0).cumsum(-2)
    return x.masked_fill(~below.logical_or(torch.eye(C, dtype=torch.bool, device=a.device)), float("-inf"))


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: Optional[torch.Tensor] = None,
            state: Optional[torch.Tensor] = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The parallel (chunked) form over a whole sequence.

    ``q``, ``k``: (B, H, T, Dk); ``v``: (B, H, T, Dv); ``log_decay``: (B, H, T), each ``<= 0`` (None:
    no decay, plain linear attention); ``state``: (B, H, Dk, Dv), the state before the first token
    (None: zeros); ``chunk``: tokens per chunk (any positive size; T need not divide by it).
    Returns ``y`` (B, H, T, Dv) in ``v``'s dtype and the state after the last token (B, H, Dk, Dv),
    float32.
    """
    _check(q, k, v, log_decay, state, steps=True)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"recurrent core: chunk must be a positive integer, got {chunk!r}")
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    out_dtype = v.dtype
    S = q.new_zeros(B, H, Dk, Dv, dtype=torch.float32) if state is None else state.float()
    if T == 0:
        return v.new_zeros(B, H, 0, Dv), S
    a = q.new_zeros(B, H, T, dtype=torch.float32) if log_decay is None else log_decay.float()
    C = min(chunk, T)
    pad = -T % C
    q, k, v = (F.pad(t.float(), (0, 0, 0, pad)) for t in (q, k, v))  # padded steps: k = 0, a = 0, S unchanged
    a = F.pad(a, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.view(B, H, N, C, -1) for t in (q, k, v))
    a = a.view(B, H, N, C)
    cum = a.cumsum(-1)                                      # log decay from the chunk's start to step i
    total = cum[..., -1]                                    # (B, H, N): over the whole chunk
    L = torch.exp(segsum(a))                                # (B, H, N, C, C)
    y = ((q @ k.transpose(-1, -2)) * L) @ v                 # within each chunk
    to_end = L[..., -1, :]                                  # decay from step j to the chunk's end (<= 1)
    updates = (k * to_end[..., None]).transpose(-1, -2) @ v  # (B, H, N, Dk, Dv): each chunk's own state
    q_carry = q * torch.exp(cum)[..., None]                 # what the state before the chunk meets
    carried = []
    for n in range(N):                                      # pass the state from chunk to chunk
        carried.append(q_carry[:, :, n] @ S)
        S = torch.exp(total[:, :, n])[..., None, None] * S + updates[:, :, n]
    y = y + torch.stack(carried, 2)
    return y.reshape(B, H, N * C, Dv)[:, :, :T].to(out_dtype), S


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: Optional[torch.Tensor] = None,
         state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form: one token. ``q``, ``k``: (B, H, Dk); ``v``: (B, H, Dv); ``log_decay``:
    (B, H) (None: no decay); ``state``: (B, H, Dk, Dv) (None: zeros). Returns ``y`` (B, H, Dv) in
    ``v``'s dtype and the new state (B, H, Dk, Dv), float32."""
    _check(q, k, v, log_decay, state, steps=False)
    B, H, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1], dtype=torch.float32) if state is None else state.float()
    if log_decay is not None:
        S = torch.exp(log_decay.float())[..., None, None] * S
    S = S + k.float()[..., :, None] * v.float()[..., None, :]
    y = (q.float()[..., None, :] @ S).squeeze(-2)
    return y.to(v.dtype), S


def chunked_bytes(heads: float, dk: int, dv: int, chunk: int, *, device: str = "cuda") -> float:
    """Per token, the bytes the chunked form keeps for backward on ``heads`` heads (float32 whatever the
    input dtype), chunks of ``chunk`` tokens. The reference (:func:`chunked`): the float32 queries, keys
    and values with the copies its matmuls make (``4 dk + 2 dv`` per head), the decay masks and scores
    within a chunk (``3 chunk``), the cumulative decay, and the state carried into each chunk (``dk dv``
    per head and chunk). The Triton kernel (CUDA): its inputs and the log-decays."""
    if device == "cuda":
        return 4 * heads * (2 * dk + dv + 1)
    return 4 * heads * (4 * dk + 2 * dv + 3 * chunk + 1 + (dk * dv + 1) / chunk)


# ------------------------------------------------------------------- the parts around the cores

class ShortConv(nn.Conv1d):
    """The short causal depthwise convolution of Mamba-2 and Gated DeltaNet, then an activation: each
    channel ``y_t = act(sum_k w[k] x_{t-K+1+k} + bias)`` over the last ``K = kernel`` inputs.
    ``activation`` is ``"silu"`` (Mamba-2, Gated DeltaNet; the default) or None (no activation: the
    plain convolution of RecurrentGemma's recurrent block, of Hyena and H3 style short filters).

    Its parameters are ``nn.Conv1d``'s (``weight`` (channels, 1, K), optional ``bias``), so checkpoint
    names and initialisation are a depthwise convolution's. It takes and returns (B, T, channels), and
    computes K shifted products along T, which on the CPU beats F.conv1d's grouped path 2-3x (the same
    sums in the same order). With a decode state (B, channels, ``state_width``), the window continues from
    the inputs it holds, and it then holds the last ``state_width`` inputs: ``kernel - 1`` as
    transformers' qwen3_next cache does, or ``kernel`` as its mamba2 cache does."""

    ACTIVATIONS = {"silu": lambda x: F.silu(x, inplace=True), None: lambda x: x}

    def __init__(self, channels: int, kernel: int, *, bias: bool, state_width: int, activation: Optional[str] = "silu"):
        super().__init__(channels, channels, kernel, groups=channels, bias=bias)
        if state_width not in (kernel - 1, kernel):
            raise ValueError(f"ShortConv: state_width must be kernel - 1 or kernel ({kernel - 1} or {kernel}), "
                             f"got {state_width}")
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"ShortConv: activation must be one of {', '.join(map(repr, self.ACTIVATIONS))}, "
                             f"got {activation!r}")
        self.state_width = state_width
        self.act = self.ACTIVATIONS[activation]

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """``nn.Conv1d``'s initialisation (Kaiming-uniform weight, uniform bias in +-1/sqrt(fan_in)),
        drawn from ``generator``."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5), generator=generator)
            if self.bias is not None:
                bound = 1 / math.sqrt(self.weight[0].numel())
                nn.init.uniform_(self.bias, -bound, bound, generator=generator)

    def forward(self, x: torch.Tensor, state: Optional[torch.Tensor] = None, documents=None) -> torch.Tensor:
        """``documents`` (B, T): packed documents; an input of another document than the output's is
        not in its window (as if each document were convolved alone)."""
        K, T = self.kernel_size[0], x.shape[1]
        if state is None:
            window = F.pad(x, (0, 0, K - 1, 0))
        else:
            window = torch.cat([state[..., state.shape[-1] - (K - 1):].transpose(1, 2).to(x.dtype), x], 1)
            if T:
                state.copy_(window[:, -self.state_width:].transpose(1, 2))
        w = self.weight[:, 0].t().to(x.dtype)  # (K, channels)
        if documents is not None:
            theirs = F.pad(documents, (K - 1, 0), value=-1)  # the window's documents
            window = [window[:, k : k + T] * (theirs[:, k : k + T] == documents)[..., None].to(x.dtype) for k in range(K)]
        else:
            window = [window[:, k : k + T] for k in range(K)]
        out = window[0] * w[0]
        for k in range(1, K):
            out.addcmul_(window[k], w[k])
        if self.bias is not None:
            out += self.bias.to(x.dtype)
        return self.act(out)


class GatedRMSNorm(nn.Module):
    """A gated RMSNorm with a weight, in float32 at least: ``w * rms_norm(x) * silu(z)`` (``norm_before_gate``,
    Qwen3-Next's order) or ``w * rms_norm(x * silu(z))`` (Mamba-2's ``RMSNormGated`` with
    ``norm_before_gate=False``); the RMS is taken over each of ``groups`` equal slices of the features."""

    def __init__(self, dim: int, eps: float, *, groups: int = 1, norm_before_gate: bool = True):
        super().__init__()
        if dim % groups:
            raise ValueError(f"GatedRMSNorm: {groups} groups do not divide {dim} features")
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))
        self._group_of = None  # under tensor parallelism: (tp mesh, this process's group, all groups, group width)

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def parallelize(self, tp_mesh, *, sharded: bool) -> None:
        """Tensor parallelism, the features arriving as this process's heads. ``sharded`` (Mamba-2's norm,
        whose weight and groups span every head's features): the weight sharded with the heads; each group
        this process holds is whole (``tp`` divides ``groups``) or a slice of one group, whose sum of
        squares is then summed over the processes (:func:`~zoo.core.parallel.summed`). Otherwise (one norm
        over each head, Qwen3-Next's): the weight replicated, its gradient summed over the processes."""
        from torch.distributed.tensor import Replicate, distribute_tensor

        from zoo.core.parallel import shard_rows, units_here

        tp = tp_mesh.size()
        if not sharded:
            self.weight = nn.Parameter(distribute_tensor(self.weight, tp_mesh, [Replicate()], src_data_rank=None))
            return
        shard_rows(self, tp_mesh)
        if self.groups % tp == 0:
            self.groups //= tp
            return
        first, _ = units_here(self.groups, tp_mesh)
        self._group_of = (tp_mesh, first, self.groups, self.weight.shape[0] // self.groups)
        self.groups = 1

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        if self._group_of is not None:  # a slice of one group: its sum of squares summed over the processes
            from zoo.core.parallel import summed

            mesh, group, groups, width = self._group_of
            squares = F.pad(h.pow(2).sum(-1, keepdim=True), (group, groups - group - 1))  # (..., groups): 0 but its own
            total = summed(squares, mesh)[..., group : group + 1]
            return h * torch.rsqrt(total / width + self.eps)
        g = h.unflatten(-1, (self.groups, -1)) if self.groups > 1 else h
        g = F.rms_norm(g, (g.shape[-1],), eps=self.eps)  # g / sqrt(mean(g^2) + eps), one fused pass
        return g.flatten(-2) if self.groups > 1 else g

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        from zoo.core.parallel import local

        dtype = x.dtype
        f32 = torch.promote_types(dtype, torch.float32)
        gate = F.silu(z.to(f32))
        weight = local(self.weight)
        if self.norm_before_gate:
            h = self._norm(x.to(f32)).to(dtype)
            return (weight * h).mul_(gate).to(dtype)
        return weight * self._norm(x.to(f32).mul(gate)).to(dtype)
