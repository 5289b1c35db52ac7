"""Mamba-2 (SSD, Dao & Gu 2024): the ``mamba2`` token mixer, its fixed-size decode state, and the
``mixer_only`` block of a Mamba-2 model (a layer with no FFN).

One layer, for an input ``u`` (B, T, d_model), with ``H`` heads of width ``P``, ``G`` groups and a
state of ``N`` per head::

    z, xBC, dt = in_proj(u)                        # gate (H*P), conv input (H*P + 2*G*N), step (H)
    x, B, C    = silu(causal depthwise conv(xBC))  # the short convolution, window conv_kernel
    dt         = clamp(softplus(dt + dt_bias), dt_limit)
    S_t        = exp(dt_t * A) * S_{t-1} + B_t (dt_t x_t)^T     A = -exp(A_log) < 0, per head
    y_t        = C_t^T S_t + D * x_t                            the D skip
    out        = out_proj(GroupRMSNorm(y * silu(z)))            gated, then normed in G groups

so the SSM is the decayed linear attention ``S_t = g_t S_{t-1} + k_t v_t^T`` with keys ``B``,
queries ``C``, values ``x * dt`` and a data-dependent log-decay ``dt * A`` per head and token (B and
C are shared by the ``H / G`` heads of a group). Its parallel form is the shared chunked core
(:mod:`zoo.components.mixers._recurrent`), O(T * chunk_size); its recurrent form one step per token.

As transformers' torch path does: the SSM runs in float32 whatever the model's dtype, its state is
float32, the gate and norm are applied in float32 (norm after gating: ``norm_before_gate=False``).
The decode state is the last ``conv_kernel`` inputs of the convolution (transformers keeps that many)
and the SSM state, stored (B, H, N, P): the same numbers transformers stores as (B, H, P, N).

Padding (a left-padded batch) enters the convolution as zeros and is a step of ``dt = 0``: it
neither decays the state nor adds to it, so a padded row computes what the row alone computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kernels
from zoo.components.mixers import _recurrent as recurrent
from zoo.core.context import document_starts
from zoo.core.kinds import Cost, Mixer
from zoo.core.registry import register
from zoo.core.state import FixedState
from zoo.core.spec import SpecError, positive


#: On the CPU the parallel form cuts chunks of at most this many tokens. A chunk of C tokens costs each
#: token ~C * (N + P) per head within the chunk and ~2 * N * P across chunks, so for Mamba-2's widths
#: (N, P = 64..128) C ~ 64 does the least work; checkpoints say 256, sized for GPUs. The result does not
#: depend on the chunk (only the order of float32 sums does; tests check several sizes agree).
CPU_CHUNK = 64


@register("mixer", "mamba2")
class Mamba2(Mixer):
    """The Mamba-2 (SSD) mixer; see the module's docstring for the computation."""

    # The chunked form runs on the shared core, whose Triton kernel is chosen on CUDA.
    kernel: ClassVar[str] = "scalar_decay"
    backends: ClassVar[tuple] = ("triton", "torch")
    documents: ClassVar[bool] = True  # packed documents: the state and the convolution restart at each

    @dataclass(frozen=True)
    class Config:
        n_heads: int
        head_dim: int = 64
        state_size: int = 128  # N: the width of B and C, the state's key side
        n_groups: int = 1  # B and C are shared by n_heads / n_groups heads; the gated norm has as many groups
        conv_kernel: int = 4
        chunk_size: int = 256  # tokens per chunk of the parallel form (at most; see CPU_CHUNK)
        bias: bool = False  # on in_proj and out_proj
        conv_bias: bool = True
        norm_eps: float = 1e-5  # of the gated RMSNorm
        dt_limit_min: float = 0.0  # softplus(dt + dt_bias) is clamped to [dt_limit_min, dt_limit_max]
        dt_limit_max: Optional[float] = None  # None: no upper limit
        # Initialisation only: dt_bias is the inverse softplus of a log-uniform draw from [dt_min, dt_max]
        # floored at dt_floor; A_log = log(1..n_heads); D = 1.
        dt_min: float = 0.001
        dt_max: float = 0.1
        dt_floor: float = 1e-4

        def check(self):
            for name in ("n_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise SpecError(name, f"must be a positive integer, got {value!r}")
            if self.n_heads % self.n_groups:
                raise SpecError("n_groups", f"n_heads {self.n_heads} is not divisible by n_groups {self.n_groups} "
                                            "(each group's B and C serve n_heads / n_groups heads)")
            for name in ("norm_eps", "dt_min", "dt_max", "dt_floor"):
                positive(name, getattr(self, name), allow_none=False)
            if self.dt_limit_min < 0:
                raise SpecError("dt_limit_min", f"must be >= 0, got {self.dt_limit_min}")
            if self.dt_limit_max is not None and self.dt_limit_max <= self.dt_limit_min:
                raise SpecError("dt_limit_max", f"must exceed dt_limit_min {self.dt_limit_min}, got {self.dt_limit_max}")

    def __init__(self, cfg, *, d_model: int, layer=None, spec=None, index: int = 0):
        super().__init__()
        self.cfg, self.index = cfg, index
        H, P, N, G = cfg.n_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
        self.d_inner = H * P
        self.conv_dim = H * P + 2 * G * N
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + H, bias=cfg.bias)
        self.conv1d = recurrent.ShortConv(self.conv_dim, cfg.conv_kernel, bias=cfg.conv_bias,
                                          state_width=cfg.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = recurrent.GatedRMSNorm(self.d_inner, cfg.norm_eps, groups=G, norm_before_gate=False)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=cfg.bias)
        self.here = (H, G)  # the heads and groups this process computes (all; its share under tensor parallelism)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None):
        """A = -(1..n_heads), D = 1, and softplus(dt_bias) log-uniform in [dt_min, dt_max]."""
        if self.A_log.is_meta:
            return
        cfg = self.cfg
        self.A_log.copy_(torch.log(torch.arange(1, cfg.n_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        lo, hi = math.log(cfg.dt_min), math.log(cfg.dt_max)
        dt = torch.exp(torch.rand(cfg.n_heads, generator=generator, device=self.A_log.device) * (hi - lo) + lo).clamp(min=cfg.dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def new_state(self, batch, max_len, *, dtype, device) -> "Mamba2State":
        """The last ``conv_kernel`` convolution inputs (B, conv_dim, K) in the model's dtype and the SSM
        state (B, H, N, P) in float32: of fixed size whatever the length (and able to drop the tokens of
        its last short update: :class:`Mamba2State`)."""
        cfg = self.cfg
        return Mamba2State(batch, device, conv=((self.conv_dim, cfg.conv_kernel), dtype),
                           ssm=((cfg.n_heads, cfg.state_size, cfg.head_dim), torch.float32))

    def forward(self, u: torch.Tensor, ctx, pos=None) -> torch.Tensor:
        from zoo.core.parallel import local

        cfg = self.cfg
        u = local(u)  # the whole sequence, this process computing its heads' share
        Bsz, T, _ = u.shape
        P, N = cfg.head_dim, cfg.state_size
        H, G = self.here
        d_inner = H * P
        state = ctx.state.layers[self.index] if ctx is not None and ctx.state is not None else None
        mask = ctx.key_mask[:, ctx.slots] if ctx is not None and ctx.key_mask is not None else None
        z, xBC, dt = self.in_proj(u).split([d_inner, d_inner + 2 * G * N, H], -1)
        if mask is not None:
            xBC = xBC * mask[..., None].to(xBC.dtype)
        keep = state is not None and 1 < T <= Mamba2State.KEEP  # an update truncate() can undo in part
        before = (ctx.slots, state.get(Bsz)[0].clone(), state.get(Bsz)[1].clone(), xBC) if keep else None
        if state is not None and state.undo is not None:
            state.undo = None
        documents = ctx.documents if ctx is not None else None
        xBC = self.conv1d(xBC, state.get(Bsz)[0] if state is not None else None, documents)  # then SiLU
        x, Bm, Cm = xBC.split([d_inner, G * N, G * N], -1)
        dt = F.softplus(dt.float() + local(self.dt_bias).float()).clamp(cfg.dt_limit_min, cfg.dt_limit_max)
        if mask is not None:
            dt = dt * mask[..., None]  # a padded step: no decay, no input
        x = x.float().view(Bsz, T, H, P)
        heads = lambda t: t.float().view(Bsz, T, G, 1, N).expand(-1, -1, -1, H // G, -1).reshape(Bsz, T, H, N)  # noqa: E731
        q, k = heads(Cm).transpose(1, 2), heads(Bm).transpose(1, 2)  # (B, H, T, N)
        v = (x * dt[..., None]).transpose(1, 2)  # (B, H, T, P)
        log_decay = (dt * -torch.exp(local(self.A_log).float())).transpose(1, 2)  # (B, H, T), <= 0
        if documents is not None:  # a decay of 0 at each document's first token: its state starts empty
            log_decay = log_decay.masked_fill(document_starts(documents)[:, None], float("-inf"))
        S = state.get(Bsz)[1] if state is not None else None
        if state is not None and T == 1:
            y, S_new = recurrent.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], log_decay[:, :, 0], S)
            y = y[:, :, None]
        else:
            fast = kernels.fast(self, q) if documents is None else None  # the core's Triton kernel on CUDA
            run = fast if fast is not None else recurrent.chunked
            chunk = cfg.chunk_size if u.device.type != "cpu" else min(cfg.chunk_size, CPU_CHUNK)
            y, S_new = run(q, k, v, log_decay, S, chunk=chunk)
        if state is not None:
            S.copy_(S_new)
        if keep:
            state.undo = (*before, k, v, log_decay)
        y = y.transpose(1, 2) + local(self.D).float()[:, None] * x  # (B, T, H, P), the D skip
        y = self.norm(y.reshape(Bsz, T, d_inner), z)
        return self.out_proj(y.to(u.dtype))

    # -- what this part states about itself ---------------------------------------------------------
    #: The per-head decay rate, skip and time-step offset take no weight decay.
    no_decay = ("A_log", "D", "dt_bias")

    @staticmethod
    def shrink(cfg, *, head_dim: int = 8, **_) -> dict:
        """A tiny copy: 4 heads of ``head_dim``, state 8, the groups kept (1 or 2), chunks of 4 tokens so
        that short test sequences cross chunk boundaries."""
        return {"n_heads": 4, "head_dim": head_dim, "state_size": 8, "n_groups": 1 if cfg.n_groups == 1 else 2,
                "chunk_size": 4}

    def cost(self, context: int) -> Cost:
        """Per token: the convolution (``2 * conv_dim * conv_kernel``), the state update and read-out
        (``4 * H * N * P``), whatever the context; the state is the convolution window plus ``H * N *
        P``, fixed. (The SSM state is held in float32; the figure counts elements.)"""
        cfg = self.cfg
        ssm = cfg.n_heads * cfg.state_size * cfg.head_dim
        flops = 2 * self.conv_dim * cfg.conv_kernel + 4 * ssm
        return Cost(flops=flops, flops_mean=flops, state_fixed=self.conv_dim * cfg.conv_kernel + ssm)

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token, of this process's heads and groups: the input ``in_proj`` reads (the whole sequence,
        gathered under tensor parallelism); the convolution's window and output; the float32 ``x``, ``dt``
        and its softplus; the chunked SSM's own (:func:`~zoo.components.mixers._recurrent.chunked_bytes`);
        the float32 gate (a view of the projection's output when that is float32), the gated and D-skipped
        outputs the norm reads and keeps, its reciprocal RMS; the normed output ``out_proj`` reads."""
        cfg, c = self.cfg, dtype.itemsize
        H, P, N = cfg.n_heads / tp, cfg.head_dim, cfg.state_size
        G = max(cfg.n_groups / tp, 1)
        conv, inner = H * P + 2 * G * N, H * P
        chunk = min(cfg.chunk_size, CPU_CHUNK, seq_len)  # the reference's chunks (the kernel keeps no chunks)
        ssm = recurrent.chunked_bytes(H, N, P, chunk, device=device)
        z = (inner + conv + H) * 4 if c == 4 else inner * 4
        x = conv * 4 if c == 4 else inner * 4
        return self.in_proj.in_features * c + 2 * conv * c + x + 3 * H * 4 + ssm + z + 4 * inner * 4 + 4 + inner * c

    def facts(self) -> dict:
        cfg = self.cfg
        return {"mamba2 heads": f"{cfg.n_heads} x {cfg.head_dim}, state {cfg.state_size}, {cfg.n_groups} group(s)",
                "conv kernel": cfg.conv_kernel, "chunk": cfg.chunk_size}

    def parallelize(self, tp_mesh) -> None:
        """Tensor parallelism by heads: the sequence gathered; the packed ``in_proj`` (``[z | x | B | C |
        dt]``) and the convolution over ``[x | B | C]`` compute this process's rows of each section
        (:func:`~zoo.core.parallel.packed_in`): its heads' ``z``, ``x`` and ``dt``, and the B and C of the
        groups they belong to (``n_groups / tp`` groups, or the one group ``tp / n_groups`` processes
        share, its gradient summed over them); ``dt_bias``, ``A_log``, ``D`` and the norm's weight sharded
        by heads; the gated norm over each group whole or summed over the processes holding a slice of
        it; ``out_proj`` by its columns, reduce-scattered back onto the sequence slice."""
        from torch.distributed.tensor.parallel import parallelize_module

        from zoo.core.parallel import heads_out, local_count, packed_in, section_rows, sequence_input, shard_rows

        cfg = self.cfg
        H, P, N, G, tp = cfg.n_heads, cfg.head_dim, cfg.state_size, cfg.n_groups, tp_mesh.size()
        heads = local_count(H, tp_mesh, "n_heads", self)
        if G % tp and tp % G:
            raise NotImplementedError(f"{type(self).__name__}: n_groups = {G} and tp = {tp}: each process's heads "
                                      f"must lie in whole groups or in one group; choose a tp that divides "
                                      f"n_groups or that n_groups divides")
        groups = max(G // tp, 1)
        x, bc = (H, P), (G, N)
        parallelize_module(self, tp_mesh, sequence_input(tp_mesh))
        packed_in(self.in_proj, section_rows([x, x, bc, bc, (H, 1)], tp_mesh), tp_mesh)
        packed_in(self.conv1d, section_rows([x, bc, bc], tp_mesh), tp_mesh)
        parallelize_module(self, tp_mesh, {"out_proj": heads_out()})
        shard_rows(self, tp_mesh)  # dt_bias, A_log, D: one per head
        self.norm.parallelize(tp_mesh, sharded=True)
        self.here = (heads, groups)


class Mamba2State(FixedState):
    """Mamba-2's decode state (``conv``, ``ssm``), which can forget the tokens of its last update when
    that update took several tokens and at most :attr:`KEEP` (speculative decoding feeds the main model
    two and may drop the second): it keeps the state from before that update and the update's
    convolution inputs and SSM terms, and :meth:`truncate` steps the recurrence again over the tokens
    that stay, as single-token decoding would have."""

    KEEP = 8

    def __init__(self, batch, device, **tensors):
        super().__init__(batch, device, **tensors)
        # (slots, conv before, ssm before, convolution inputs (B, T, C), k (B, H, T, N), v (B, H, T, P),
        # log decay (B, H, T)) of the last update, when it can be undone
        self.undo = None

    def truncate(self, n: int) -> None:
        if self.undo is None:
            raise ValueError(f"this Mamba-2 state cannot drop slot {n} and later: only slots that its last update "
                             f"wrote with 2 to {self.KEEP} tokens at once can be dropped")
        slots, conv, ssm, inputs, k, v, log_decay = self.undo
        first, T = int(slots[0]), len(slots)
        if n >= first + T:
            return
        if n < first:
            raise ValueError(f"this Mamba-2 state cannot drop slot {n} and later: its last update began at slot {first}")
        m = n - first
        S = ssm
        for t in range(m):
            S = recurrent.step(k[:, :, t], k[:, :, t], v[:, :, t], log_decay[:, :, t], S)[1]
        self.ssm.copy_(S)
        self.conv.copy_(torch.cat([conv, inputs[:, :m].transpose(1, 2).to(conv.dtype)], -1)[..., -conv.shape[-1]:])
        self.undo = None
