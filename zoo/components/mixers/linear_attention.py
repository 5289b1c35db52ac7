"""Linear attention and lightning attention: token mixers whose decode state is one matrix per head.

Both run the shared scalar-decay core (:mod:`zoo.components.mixers._recurrent`): the chunked form for a
whole sequence or a prompt, the one-step form for a single new token. Their state does not grow
with the context: ``n_heads x head_dim x head_dim`` numbers per layer and sequence.

- ``linear_attention``: ``S_t = g S_{t-1} + phi(k_t) v_t^T``, ``y_t = phi(q_t)^T S_t`` with a feature map
  ``phi`` (``identity``, ``elu1`` = elu + 1, ``relu``, ``silu``), no decay (``g = 1``, the notes' form)
  or a fixed decay per head (RetNet's ``1 - 2^(-5 - h)``, one number for all heads, or one per head),
  and optionally the normalisation of Katharopoulos et al. (``y_t / (phi(q_t)^T z_t)``, ``z_t`` the
  decayed sum of ``phi(k)``).
- ``lightning_attention`` (MiniMax-Text-01): ``q, k, v = act(W x)`` from one projection laid out per
  head, a per-head decay ``exp(-slope_h)`` whose slopes shrink with depth, RMSNorm over all heads'
  outputs, then a sigmoid gate from the layer's input, then the output projection.

On CUDA the chunked form runs a Triton kernel (component key ``scalar_decay``); the PyTorch core is
the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kernels
from zoo.components.mixers import _recurrent as recurrent
from zoo.components.norms import RMSNorm
from zoo.core.kinds import Cost, Mixer
from zoo.core.parallel import rank_of
from zoo.core.spec import build_part
from zoo.core.registry import register
from zoo.core.state import FixedState
from zoo.core.spec import Part, SpecError, part_field, positive

FEATURE_MAPS = {
    "identity": lambda x: x,
    "elu1": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
    "silu": F.silu,
}


class ScalarDecayMixer(Mixer):
    """What the two mixers share: heads, the state, the choice between chunked and one-step forms,
    the Triton fast path, and the cost of a recurrence."""

    kernel: ClassVar[str] = "scalar_decay"
    backends: ClassVar[tuple] = ("triton", "torch")

    n_heads: int
    head_dim: int
    value_dim: int  # the width of a head's state columns (head_dim, plus one for a normaliser)
    chunk: int

    def new_state(self, batch, max_len, *, dtype, device):
        return FixedState(batch, device, S=((self.n_heads, self.head_dim, self.value_dim), dtype))

    #: The heads this process computes: all, or its share under tensor parallelism.
    here: slice = slice(None)

    def _padding(self, ctx, T):
        """(B, T, 1) with 0 at padding slots, or None."""
        if ctx.key_mask is None:
            return None
        return ctx.key_mask[:, ctx.slots][..., None]

    def recur(self, q, k, v, log_decay, ctx):
        """Run the recurrence on (B, H, T, D) heads and (B, H, T) log-decays, from and into this
        layer's decode state when there is one. Returns (B, H, T, Dv)."""
        B, H, T, _ = q.shape
        layer = ctx.state.layers[self.index] if ctx.state is not None else None
        S0 = layer.get(B)[0] if layer is not None else None
        if S0 is not None and T == 1:
            y, S = recurrent.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], log_decay[:, :, 0], S0)
            y = y[:, :, None]
        else:
            fast = kernels.fast(self, q)
            run = fast if fast is not None else recurrent.chunked
            y, S = run(q, k, v, log_decay, S0, chunk=self.chunk)
        if layer is not None:
            layer.S.copy_(S)
        return y

    # -- what this part states about itself ---------------------------------------------------------
    tp_divides = ("n_heads",)

    @classmethod
    def rotary_dim(cls, cfg, d_model):
        return None  # no position encoding: the decay and the order of the recurrence carry position

    def cost(self, context):
        H, Dk, Dv = self.n_heads, self.head_dim, self.value_dim
        step = 4 * H * Dk * Dv  # add k v^T to the decayed state, read it with q
        return Cost(flops=step, flops_mean=step, state_fixed=H * Dk * Dv)

    def parallelize(self, tp_mesh) -> None:
        """Tensor parallelism by heads, as each mixer's ``tp_plan`` says: the sequence gathered, the
        projections into heads sharded by their heads' rows (each head's rows are consecutive), the
        projection out by its columns and reduce-scattered back onto the sequence slice; and each process
        decays its own heads (a slice of the per-head decays, which are buffers, whole on every process)."""
        super().parallelize(tp_mesh)
        n, r = self.n_heads // tp_mesh.size(), rank_of(tp_mesh)
        self.here = slice(r * n, (r + 1) * n)


@register("mixer", "linear_attention")
class LinearAttention(ScalarDecayMixer):
    """Linear attention (optionally with RetNet's fixed decay per head); see the module notes."""

    @dataclass(frozen=True)
    class Config:
        n_heads: int
        head_dim: Optional[int] = None  # None: d_model // n_heads
        feature_map: Literal["identity", "elu1", "relu", "silu"] = "identity"
        # None: no decay; "retnet": gamma_h = 1 - 2^(-5 - h); a number: one gamma for every head;
        # a list: one gamma per head. Each gamma in (0, 1].
        decay: Union[None, Literal["retnet"], float, tuple[float, ...]] = None
        normalize: Literal["none", "sum"] = "none"  # "sum": divide by phi(q)^T (decayed sum of phi(k))
        eps: float = 1e-6  # added to the normaliser
        bias: bool = False  # on the q, k, v projections
        chunk: int = 64  # tokens per chunk of the parallel form

        def check(self):
            positive("n_heads", self.n_heads, allow_none=False)
            positive("head_dim", self.head_dim)
            positive("chunk", self.chunk, allow_none=False)
            positive("eps", self.eps, allow_none=False)
            if self.normalize == "sum" and self.feature_map in ("identity", "silu"):
                raise SpecError("normalize", f"'sum' divides by phi(q)^T z, which needs a non-negative feature "
                                             f"map; feature_map is {self.feature_map!r} (use 'elu1' or 'relu')")
            gammas = self.decay if isinstance(self.decay, tuple) else (self.decay,) if isinstance(self.decay, float) else ()
            if isinstance(self.decay, tuple) and len(self.decay) != self.n_heads:
                raise SpecError("decay", f"has {len(self.decay)} entries for {self.n_heads} heads")
            for g in gammas:
                if not 0.0 < g <= 1.0:
                    raise SpecError("decay", f"each gamma must be in (0, 1], got {g}")

    def __init__(self, cfg, *, d_model, layer=None, spec=None, index=0):
        super().__init__()
        self.cfg, self.index, self.chunk = cfg, index, cfg.chunk
        self.n_heads = H = cfg.n_heads
        self.head_dim = D = cfg.head_dim or d_model // H
        self.value_dim = D + (cfg.normalize == "sum")
        self.phi = FEATURE_MAPS[cfg.feature_map]
        self.q_proj = nn.Linear(d_model, H * D, bias=cfg.bias)
        self.k_proj = nn.Linear(d_model, H * D, bias=cfg.bias)
        self.v_proj = nn.Linear(d_model, H * D, bias=cfg.bias)
        self.o_proj = nn.Linear(H * D, d_model, bias=False)
        self.register_buffer("log_gamma", self.gammas().log(), persistent=False)

    def gammas(self) -> torch.Tensor:
        d, H = self.cfg.decay, self.n_heads
        if d is None:
            return torch.ones(H)
        if d == "retnet":
            return 1.0 - torch.exp2(-5.0 - torch.arange(H, dtype=torch.float64)).float()
        return torch.tensor(d if isinstance(d, tuple) else (d,) * H, dtype=torch.float32)

    def reset_parameters(self):
        self.log_gamma.copy_(self.gammas().log())

    def forward(self, x, ctx, pos=None):
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = (p(x).view(B, T, -1, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        H = q.shape[1]  # this process's heads
        q, k = self.phi(q), self.phi(k)
        keep = self._padding(ctx, T)
        if keep is not None:  # padding adds nothing to the state
            k = k * keep[:, None].to(k.dtype)
        if self.cfg.normalize == "sum":
            v = torch.cat([v, v.new_ones(B, H, T, 1)], -1)
        a = self.log_gamma[self.here][None, :, None].expand(B, H, T)
        y = self.recur(q, k, v, a, ctx)
        if self.cfg.normalize == "sum":
            y = y[..., :D] / (y[..., D:] + self.cfg.eps)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))

    # -- what this part states about itself ---------------------------------------------------------
    tp_plan = {"": "gather_sequence", "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}

    @staticmethod
    def shrink(cfg, *, head_dim=8, **_):
        decay = cfg.decay[:2] if isinstance(cfg.decay, tuple) else cfg.decay
        return {"n_heads": 2, "head_dim": head_dim, "decay": decay}

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token: the input the projections read (gathered under tensor parallelism); of this process's
        heads, the queries and keys a feature map other than the identity keeps, the chunked recurrence's
        own (:func:`~zoo.components.mixers._recurrent.chunked_bytes`), with the sum normaliser its output
        and the divisor, and the output ``o_proj`` reads."""
        c, H, D = dtype.itemsize, self.n_heads / tp, self.head_dim
        mapped = 0 if self.cfg.feature_map == "identity" else 2 * H * D * c
        core = recurrent.chunked_bytes(H, D, self.value_dim, min(self.chunk, seq_len), device=device)
        normed = H * (self.value_dim + 1) * c if self.cfg.normalize == "sum" else 0
        return self.q_proj.in_features * c + mapped + core + normed + H * D * c

    def facts(self):
        d = self.cfg.decay
        decay = "none" if d is None else "RetNet 1 - 2^(-5-h)" if d == "retnet" else f"fixed {d}"
        return {"recurrent heads": f"{self.n_heads} x {self.head_dim}, linear attention",
                "feature map": self.cfg.feature_map, "decay": decay, "normalize": self.cfg.normalize}


@register("mixer", "lightning_attention")
class LightningAttention(ScalarDecayMixer):
    """MiniMax-Text-01's lightning attention; see the module notes.

    The decay of head ``h`` in layer ``i`` of ``n`` is ``exp(-slope_h)`` with ``slope_h = 2^(-8 (h + 1) /
    H) * (1 - i / (n - 1 + 1e-5) + 1e-5)``: layers near the top forget least. The slopes are a buffer,
    stored in checkpoints as ``slope_rate``."""

    @dataclass(frozen=True)
    class Config:
        n_heads: int
        head_dim: Optional[int] = None  # None: d_model // n_heads
        activation: Part = part_field("activation", "silu")  # applied to the fused q, k, v projection
        norm_eps: float = 1e-6  # of the RMSNorm over all heads' outputs
        chunk: int = 256  # tokens per chunk of the parallel form (MiniMax's block_size)

        def check(self):
            positive("n_heads", self.n_heads, allow_none=False)
            positive("head_dim", self.head_dim)
            positive("chunk", self.chunk, allow_none=False)
            positive("norm_eps", self.norm_eps, allow_none=False)

    def __init__(self, cfg, *, d_model, layer=None, spec=None, index=0):
        super().__init__()
        self.cfg, self.index, self.chunk = cfg, index, cfg.chunk
        self.n_layers = spec.n_layers if spec is not None else 1
        self.n_heads = H = cfg.n_heads
        self.head_dim = self.value_dim = D = cfg.head_dim or d_model // H
        self.act = build_part(cfg.activation, "activation")
        self.qkv_proj = nn.Linear(d_model, 3 * H * D, bias=False)  # rows per head: [q_h; k_h; v_h]
        self.output_gate = nn.Linear(d_model, H * D, bias=False)
        self.norm = RMSNorm(RMSNorm.Config(eps=cfg.norm_eps), dim=H * D)
        self.out_proj = nn.Linear(H * D, d_model, bias=False)
        self.register_buffer("slope", self.slopes())

    def slopes(self) -> torch.Tensor:
        """The per-head decay rates of this layer (its depth sets their scale)."""
        H = self.n_heads
        base = 1 / (2 ** (8 / H))
        factor = 1 - self.index / (self.n_layers - 1 + 1e-5) + 1e-5
        return base ** (torch.arange(H) + 1) * factor

    def reset_parameters(self):
        self.slope.copy_(self.slopes())

    def forward(self, x, ctx, pos=None):
        B, T, _ = x.shape
        D = self.head_dim
        qkv = self.act(self.qkv_proj(x))
        keep = self._padding(ctx, T)
        if keep is not None:
            qkv = qkv * keep.to(qkv.dtype)
        q, k, v = qkv.view(B, T, -1, 3 * D).transpose(1, 2).split(D, dim=-1)
        H = q.shape[1]  # this process's heads
        a = -self.slope[self.here].float()[None, :, None].expand(B, H, T)
        y = self.recur(q, k, v, a, ctx)
        y = self.norm(y.transpose(1, 2).reshape(B, T, H * D))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * y)

    # -- what this part states about itself ---------------------------------------------------------
    #: As the scalar-decay mixers shard (:meth:`ScalarDecayMixer.parallelize`); the RMSNorm over all heads'
    #: outputs gathers its features to normalise each row whole.
    tp_plan = {"": "gather_sequence", "qkv_proj": "colwise", "output_gate": "colwise", "out_proj": "rowwise",
               "norm": "split_features"}

    @staticmethod
    def shrink(cfg, *, head_dim=8, **_):
        return {"n_heads": 2, "head_dim": head_dim, "chunk": 4}

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token: the input both projections read (gathered under tensor parallelism); of this process's
        heads, the projection's output its activation keeps, the chunked recurrence's own
        (:func:`~zoo.components.mixers._recurrent.chunked_bytes`), the gate's sigmoid and the normed
        output it multiplies, and their product ``out_proj`` reads; the norm's own over whole rows (it
        gathers every head's features)."""
        c, H, D = dtype.itemsize, self.n_heads / tp, self.head_dim
        core = recurrent.chunked_bytes(H, D, D, min(self.chunk, seq_len), device=device)
        return (self.qkv_proj.in_features * c + 3 * H * D * c + core + 3 * H * D * c
                + self.norm.activation_bytes(seq_len, dtype, device=device))

    def facts(self):
        return {"recurrent heads": f"{self.n_heads} x {self.head_dim}, lightning attention (decay exp(-slope) per head)",
                "chunk": self.chunk}


