"""Mixture-of-Experts: the ``moe`` FFN and its routers (registry kind ``router``).

An ``moe`` FFN holds ``n_experts`` experts stored stacked in its ``experts`` module
(a registered expert kind, below: ``experts.w_gate``, ``experts.w_up``:
E x d_ff x d_model; ``experts.w_down``: E x d_model x d_ff; optional biases ``experts.b_*``), a router
that picks ``top_k`` of them per token, and optionally a shared expert every token uses (gated by a sigmoid, as in Qwen-MoE). The output is

    sum_{e in top-k} routed_scaling * w_e * expert_e(x)  +  [sigmoid(g . x)] * shared(x)

where the routing weights ``w_e`` are renormalised to sum to one when ``norm_topk_prob``.

A *latent* MoE (``latent_dim``, Nemotron 3) routes on the token as it is, then runs the routed
experts on ``up(sum_e w_e expert_e(down(x)))``: ``latent_down`` projects the token to ``latent_dim``
values before the experts (so a token copy sent to an expert is that narrow) and ``latent_up``
projects their weighted sum back; the shared expert sees the whole token.

Routers run in float32 whatever the model's dtype. Each is a registered part (a plugin may add
one): ``softmax_topk`` (Qwen, OLMoE), ``topk_softmax`` (Mixtral, DBRX), ``sigmoid_group``
(DeepSeek-V3: sigmoid scores, a selection bias, group-limited top-k) and ``greedy_group``
(DeepSeek-V2: softmax scores, group-limited greedy).

Balancing, each a named loss term weighted from the spec (0 = off), through the forward context:

- ``moe_switch``: the Switch loss per layer as the lecture notes write it, ``E * sum_i f_i P_i``
  with ``f_i`` the fraction of tokens routed to expert i and ``P_i`` its mean router probability;
  the layers' terms add up;
- ``moe_switch_pooled``: transformers' convention: every layer's counts and probabilities pooled
  before one product is taken (its ``load_balancing_loss_func``; softmax of the logits);
- ``moe_sequence``: DeepSeek-V3's sequence-wise loss; ``moe_device``: DeepSeek-V2's device-level
  loss over ``n_devices`` equal groups of experts;
- ``router_z``: ST-MoE's router z-loss, the mean over tokens of ``logsumexp(logits)^2``;
- auxiliary-loss-free balancing (``bias_update``): the router's selection bias, a buffer, moves by
  ``bias_rate`` after each optimizer step from the load counted since the last one, summed over
  every process: ``"sign"`` is the paper's rule ``b_i += rate * sign(mean_load - load_i)``,
  ``"sign_centered"`` the same step re-centred to mean zero.

Metrics: each MoE layer's load (the largest expert's share over the mean share, ``moe_load_max``,
and per layer ``moe_load_max.<j>``) and the router's entropy (``router_entropy``).

The experts are a registered kind (``expert``, the contract :class:`zoo.core.kinds.Experts`), chosen by
name: :class:`GroupedExperts` computes ``down(activate(gate(x), up(x)))`` per expert, ``act(gate) * up``
for the gated kinds and ``act(up)`` for ``mlp``, with the settings (``activation``, ``bias``) and defaults
of the dense FFN of the same name: ``swiglu`` and ``glu`` (SiLU), ``geglu`` (GeLU), ``reglu`` (ReLU),
``mlp`` (two matrices, GeLU). With ``bias = true`` the experts hold ``b_gate``, ``b_up`` (E x d_ff) and
``b_down`` (E x d_model). Another activation of gate and up (gpt-oss's clamped SwiGLU) is a subclass
overriding ``activate``, registered under its own name.

Dispatch sorts the token copies by expert and hands them, with each expert's count, to the experts
module, which runs each expert on its contiguous run: as one grouped matmul (``torch._grouped_mm``)
where torch has it for the device and dtype and the widths are 16-byte aligned, else expert by expert
(the reference path, always available; ``dispatch = "loop"`` forces it). Under expert parallelism
(``parallel.ep``, :meth:`MoE.parallelize_experts`) each process holds ``n_experts / ep`` of the experts,
and the experts module sends the token copies to the process holding their expert and back
(:class:`zoo.core.parallel.ExpertParallel`); router, shared expert, losses and metrics stay local.
Under tensor parallelism (``parallel.tp``, :meth:`MoE.parallelize`) each process runs the MoE on its own
slice of the sequence with the parameters whole, their gradients and the balance statistics summed over
the tensor-parallel processes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core.context import recomputing
from zoo.core.kinds import FFN, Cost, Experts
from zoo.components.ffn.dense import GLU, MLP, GeGLU, ReGLU
from zoo.components.ffn.routers import Routing
from zoo.core import registry as _registry
from zoo.core.registry import register
from zoo.core.spec import Part, SpecError, build_part, finite, part_field, positive



# ------------------------------------------------------------------------------------- routers



# ----------------------------------------------------------------------------------- dispatch

@functools.lru_cache(maxsize=None)
def _grouped_mm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` runs on this device (not only its type: two GPUs of one machine may
    differ) for this dtype (it needs rows aligned to 16 bytes: see :class:`GroupedExperts`)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(8, 16, device=device).to(dtype)
        w = torch.randn(2, 16, 16, device=device).to(dtype)
        torch._grouped_mm(x, w, offs=torch.tensor([3, 8], device=device, dtype=torch.int32))
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _experts_grouped(xs, counts, w_gate, w_up, w_down, activate, biases=(None, None, None)):
    """Each projection one grouped matmul over the experts' runs; a bias added per row by its expert."""
    offs = counts.cumsum(0).to(torch.int32)
    b_gate, b_up, b_down = biases

    def project(x, w, b):
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return y if b is None else y + torch.repeat_interleave(b, counts, dim=0, output_size=x.shape[0])

    gate = project(xs, w_gate, b_gate) if w_gate is not None else None
    return project(activate(gate, project(xs, w_up, b_up)), w_down, b_down)


def _experts_loop(xs, counts, w_gate, w_up, w_down, activate, biases=(None, None, None)):
    # unbind once: indexing w[e] per expert would make backward allocate a whole (E, ...) gradient per expert
    ws = [w.unbind(0) if w is not None else None for w in (w_gate, w_up, w_down)]
    bs = [b.unbind(0) if b is not None else None for b in biases]
    at = lambda stack, e: stack[e] if stack is not None else None  # noqa: E731
    outs = []
    for e, chunk in enumerate(torch.split(xs, counts.tolist())):
        if chunk.shape[0] == 0:
            continue
        h = F.linear(chunk, ws[1][e], at(bs[1], e))
        gate = F.linear(chunk, ws[0][e], at(bs[0], e)) if w_gate is not None else None
        outs.append(F.linear(activate(gate, h), ws[2][e], at(bs[2], e)))
    return torch.cat(outs) if outs else xs.new_zeros(0, w_down.shape[1])


def _local(w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This process's experts of ``w``: its local shard under expert parallelism (a DTensor), else ``w``."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


@register("expert", "swiglu")
@register("expert", "glu")
class GroupedExperts(Experts):
    """The routed experts of an :class:`~zoo.components.ffn.moe.MoE`, stacked: ``w_gate``, ``w_up``
    (E x d_ff x d_model) and ``w_down`` (E x d_model x d_ff), with biases ``b_gate``, ``b_up`` (E x d_ff)
    and ``b_down`` (E x d_model) when ``bias``; ``act(gate) * up`` between (the ``glu`` and ``swiglu``
    kinds; the others are subclasses). ``forward(xs, counts)`` takes token copies already grouped by
    expert (``counts[e]`` rows for expert ``e``, in expert order) and returns each row's expert output,
    in the same order: as one grouped matmul (``torch._grouped_mm``) where torch has it for the device
    and dtype and the widths are 16-byte aligned, else expert by expert (the reference path;
    ``dispatch = "loop"`` forces it). Routing, weighting and summing stay with the MoE, so an
    expert-parallel style (:class:`zoo.core.parallel.ExpertParallel`) can wrap this module alone: under
    it the parameters are this process's experts (DTensors sharded on dim 0) and ``counts`` theirs."""

    Config = GLU.Config  # activation (SiLU), bias (False); the dense FFN's width settings are unused here
    gated: ClassVar[bool] = True

    def __init__(self, cfg: Any = None, d_model: Optional[int] = None, d_ff: Optional[int] = None, *,
                 n_experts: Optional[int] = None, dispatch: str = "auto", gated: Optional[bool] = None,
                 act: Optional[nn.Module] = None):
        super().__init__()
        if isinstance(cfg, int):  # GroupedExperts(n_experts, d_model, d_ff, gated=, act=): built directly
            cfg, n_experts = None, cfg
        self.cfg = cfg
        self.gated = type(self).gated if gated is None else gated
        self.act = act if act is not None else build_part(cfg.activation, "activation")
        self.dispatch, self.d_model, self.d_ff = dispatch, d_model, d_ff
        E, bias = n_experts, bool(cfg is not None and cfg.bias)
        self.w_gate = nn.Parameter(torch.empty(E, d_ff, d_model)) if self.gated else None
        self.w_up = nn.Parameter(torch.empty(E, d_ff, d_model))
        self.w_down = nn.Parameter(torch.empty(E, d_model, d_ff))
        self.b_gate = nn.Parameter(torch.empty(E, d_ff)) if bias and self.gated else None
        self.b_up = nn.Parameter(torch.empty(E, d_ff)) if bias else None
        self.b_down = nn.Parameter(torch.empty(E, d_model)) if bias else None
        self.reset_parameters()

    def activate(self, gate: Optional[torch.Tensor], up: torch.Tensor) -> torch.Tensor:
        """The expert's hidden values from its gate and up projections (gate None for a two-matrix
        expert): ``act(gate) * up``, or ``act(up)``. Override it for another activation of gate and up."""
        return self.act(gate) * up if gate is not None else self.act(up)

    def reset_parameters(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        """Each expert matrix Normal(0, ``std``) (the spec's ``init_std`` when the model initialises it);
        the biases zero."""
        with torch.no_grad():
            for w in (self.w_gate, self.w_up, self.w_down):
                if w is not None and not w.is_meta:
                    w.normal_(0.0, std, generator=generator)
            for b in self.biases():
                if b is not None and not b.is_meta:
                    b.zero_()

    def biases(self) -> tuple:
        """(b_gate, b_up, b_down), each None where absent (FP8 copies have none)."""
        return tuple(getattr(self, n, None) for n in ("b_gate", "b_up", "b_down"))

    #: Under tensor parallelism (:meth:`MoE.parallelize`): the mesh over which each expert's gradient is
    #: summed (the experts are whole on every process of it, each running its own tokens), else None.
    tp_mesh: Any = None

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = tuple(self._used(w) for w in (self.w_gate, self.w_up, self.w_down))
        biases = tuple(self._used(b) for b in self.biases())
        # Under autocast the products run in its dtype (bf16 over float32 weights and activations): the
        # grouped matmul is chosen, and run, for that dtype, as autocast would run F.linear.
        device = xs.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else xs.dtype
        if self.choose_path(xs.device, dtype)[0] == "grouped":
            cast = lambda ts: tuple(t if t is None else t.to(dtype) for t in ts)  # noqa: E731
            return _experts_grouped(xs.to(dtype), counts, *cast(weights), self.activate, cast(biases))
        return _experts_loop(xs, counts, *weights, self.activate, biases)

    def choose_path(self, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
        """The path the forward takes for tokens on ``device`` computing in ``dtype``, and why:
        ``"grouped"`` (one ``torch._grouped_mm`` per projection, no host read) or ``"loop"`` (expert by
        expert; it reads the token counts on the host). ``zoo describe --backends DEVICE`` prints it."""
        dt = str(dtype).removeprefix("torch.")
        if self.dispatch != "auto":
            return self.dispatch, f"dispatch = {self.dispatch!r} in the spec"
        if torch.compiler.is_compiling():  # the grouped kernel's fake-tensor rule wants bf16
            return "loop", "under torch.compile"
        if not hasattr(torch, "_grouped_mm"):
            return "loop", f"torch {torch.__version__} has no torch._grouped_mm"
        size = torch.empty((), dtype=dtype).element_size()
        if any(n * size % 16 for n in (self.d_model, self.d_ff)):
            return "loop", f"d_model {self.d_model} and d_ff {self.d_ff} in {dt} are not all multiples of 16 bytes"
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            return "unprobed", f"no CUDA device here to probe torch._grouped_mm for {dt}"
        if not _grouped_mm_ok(device, dtype):
            return "loop", f"torch._grouped_mm does not run on {device} for {dt}"
        return "grouped", f"torch._grouped_mm on {device}, {dt}"

    def _used(self, w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``w`` as the forward uses it: this process's experts, their gradient summed over ``tp_mesh``."""
        w = _local(w)
        if w is None or self.tp_mesh is None:
            return w
        from zoo.core.parallel import grad_summed

        return grad_summed(w, self.tp_mesh)


    # -- what this part states about itself ---------------------------------------------------------
    #: Every parameter is stacked by expert on dim 0 (expert parallelism splits them over ``ep``).
    expert_parameters = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
    #: The biases take no weight decay.
    no_decay = ("b_gate", "b_up", "b_down")


@register("expert", "geglu")
class GeGLUExperts(GroupedExperts):
    """Stacked GeGLU experts: ``gelu(gate) * up`` (Grok-1's, with the tanh approximation)."""

    Config = GeGLU.Config


@register("expert", "reglu")
class ReGLUExperts(GroupedExperts):
    """Stacked ReGLU experts: ``relu(gate) * up``."""

    Config = ReGLU.Config


@register("expert", "mlp")
class MLPExperts(GroupedExperts):
    """Stacked two-matrix experts: ``down(act(up(x)))`` (GeLU by default; Nemotron-H's are ReLU squared)."""

    Config = MLP.Config
    gated: ClassVar[bool] = False

# ----------------------------------------------------------------------------------- the FFN

LOSSES = ("switch_loss", "switch_pooled_loss", "sequence_loss", "device_loss", "z_loss")


@register("ffn", "moe")
class MoE(FFN):
    """``n_experts`` stacked experts (a registered expert kind chosen by name, ``expert``: any gated or
    plain two-matrix kind, biased or not, SwiGLU by default), ``top_k`` chosen per token by the ``router``; optional shared expert."""

    @dataclass(frozen=True)
    class Config:
        n_experts: int = 8
        top_k: int = 2
        d_ff: int = 64  # each expert's width
        expert: Part = part_field("expert", "swiglu")  # a registered expert kind (zoo/components/ffn/experts.py)
        router: Part = part_field("router", "softmax_topk")
        norm_topk_prob: bool = False
        routed_scaling: float = 1.0
        shared_d_ff: Optional[int] = None  # width of the shared expert (None: no shared expert)
        shared_gate: bool = False  # sigmoid(g . x) times the shared expert's output (Qwen-MoE)
        # Loss weights (0: the term is not computed).
        switch_loss: float = 0.0
        switch_pooled_loss: float = 0.0
        sequence_loss: float = 0.0
        device_loss: float = 0.0
        n_devices: int = 1
        z_loss: float = 0.0
        bias_update: Literal["none", "sign", "sign_centered"] = "none"
        bias_rate: float = 0.001
        dispatch: Literal["auto", "grouped", "loop"] = "auto"
        # Each expert takes at most ceil(capacity_factor * tokens * top_k / n_experts) token copies per
        # forward; the rest are dropped (None: no limit). A batch-level rule: tokens then depend on
        # their neighbours in the batch, so incremental decoding no longer equals the full forward.
        capacity_factor: Optional[float] = None
        # The routed experts' width (None: d_model), between a down- and an up-projection of the token.
        latent_dim: Optional[int] = None
        latent_bias: bool = False  # biases on latent_down and latent_up

        def check(self):
            for name in ("n_experts", "top_k", "d_ff", "shared_d_ff", "n_devices", "capacity_factor", "latent_dim"):
                positive(name, getattr(self, name), allow_none=name in ("shared_d_ff", "capacity_factor", "latent_dim"))
            if self.top_k > self.n_experts:
                raise SpecError("top_k", f"top_k = {self.top_k} is more than n_experts = {self.n_experts}")
            positive("routed_scaling", self.routed_scaling, allow_none=False)  # 0 or less: no expert contributes
            finite("bias_rate", self.bias_rate)
            if self.bias_rate < 0:
                raise SpecError("bias_rate", f"must be >= 0 (a negative rate moves the bias toward the busiest "
                                             f"experts), got {self.bias_rate}")
            # At n_experts / top_k every token copy fits (an expert sees each token at most once).
            if self.capacity_factor is not None and self.capacity_factor > self.n_experts / self.top_k:
                raise SpecError("capacity_factor", f"{self.capacity_factor} is beyond its limit n_experts / top_k = "
                                f"{self.n_experts / self.top_k:g}, where no token is dropped; set it at most that, or "
                                "leave it unset (None) for no limit")
            if self.shared_gate and self.shared_d_ff is None:
                raise SpecError("shared_gate", "gates a shared expert: set shared_d_ff too")
            for name in LOSSES:
                if getattr(self, name) < 0:
                    raise SpecError(name, f"a loss weight must be >= 0, got {getattr(self, name)}")
            if self.n_experts % self.n_devices:
                raise SpecError("n_devices", f"{self.n_devices} devices do not divide {self.n_experts} experts")
            if self.shared_d_ff is not None and self.expert.name not in _registry.manager().registry("ffn"):
                raise SpecError("shared_d_ff", f"a shared expert is the dense FFN of the experts' kind, and expert "
                                f"{self.expert.name!r} has no FFN of that name; leave shared_d_ff unset")
            try:
                self.router.cls.check_experts(self.router.config, self.n_experts, self.top_k)
            except SpecError as exc:
                raise exc.under("router") from None
            except AttributeError:
                pass  # a plugin router without the check
            if self.bias_update != "none" and not getattr(self.router.config, "selection_bias", False):
                raise SpecError("bias_update", "moves the router's selection bias: set router.selection_bias = true")

    def __init__(self, cfg, *, d_model: int):
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        E, Fd = cfg.n_experts, cfg.d_ff
        width = self.width = cfg.latent_dim or d_model  # what the routed experts read and write
        self.router = cfg.router.build(d_model=d_model, n_experts=E, top_k=cfg.top_k)
        self.experts = cfg.expert.build(n_experts=E, d_model=width, d_ff=Fd, dispatch=cfg.dispatch)
        self.gated = bool(type(self.experts).gated)
        self.act = self.experts.act  # the experts' activation module (zoo 0.2's MoE held it)
        if cfg.latent_dim is not None:
            self.latent_down = nn.Linear(d_model, width, bias=cfg.latent_bias)
            self.latent_up = nn.Linear(width, d_model, bias=cfg.latent_bias)
        self.shared = None
        self.shared_gate = None
        if cfg.shared_d_ff is not None:
            shared = Part("ffn", cfg.expert.name, _with(cfg.expert.config, d_ff=cfg.shared_d_ff))
            self.shared = shared.build(d_model=d_model)
            if cfg.shared_gate:
                self.shared_gate = nn.Linear(d_model, 1, bias=False)
        # Tokens routed to each expert since the last optimizer step (aux-loss-free balancing).
        self.register_buffer("load", torch.zeros(E), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None, std: float = 0.02) -> None:
        """The load counter to zero; the experts, the router and the shared expert initialise themselves
        (each from its own generator)."""
        if not self.load.is_meta:
            self.load.zero_()

    # zoo 0.2 held the stacked experts on the MoE itself: ``moe.w_up`` reads ``moe.experts.w_up``, and warns.
    w_gate = property(lambda self: _old_expert(self, "w_gate"))
    w_up = property(lambda self: _old_expert(self, "w_up"))
    w_down = property(lambda self: _old_expert(self, "w_down"))

    def route(self, flat: torch.Tensor) -> Routing:
        r = self.router(flat)
        w = r.weights
        if self.cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if self.cfg.routed_scaling != 1.0:
            w = w * self.cfg.routed_scaling
        return Routing(r.logits, r.probs, r.indices, w)

    def routed(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Sum over each token's chosen experts of weight x expert(token): the token copies sorted
        by expert, run by :class:`GroupedExperts` (``self.experts``), the results added back per token.
        With a capacity factor, each expert takes at most ``ceil(factor * N * k / E)`` copies (the earliest
        tokens first); the rest are dropped (they add nothing: the residual carries the token).
        Returns the output and the number of dropped copies (a tensor with a capacity factor: read
        on the host only when logged, so the forward does not wait for the device)."""
        N, k = indices.shape
        E = self.cfg.n_experts
        order = indices.reshape(-1).argsort(stable=True)
        counts = torch.bincount(indices.reshape(-1), minlength=E)
        dropped = 0
        if self.cfg.capacity_factor is not None:
            capacity = math.ceil(self.cfg.capacity_factor * N * k / E)
            expert = indices.reshape(-1)[order]
            rank = torch.arange(N * k, device=flat.device) - (counts.cumsum(0) - counts)[expert]
            keep = rank < capacity
            dropped = (~keep).sum()
            order, counts = order[keep], counts.clamp(max=capacity)
        token = order // k
        ys = self.experts(flat.index_select(0, token), counts)
        # Weighted and summed in the input's dtype: under autocast over float32 weights the expert
        # matmuls return bfloat16 and the tokens (and the residual) are float32.
        ys = ys.to(flat.dtype) * weights.reshape(-1)[order, None].to(flat.dtype)
        return torch.zeros_like(flat).index_add_(0, token, ys), dropped

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        if self._tp_mesh is None:
            return self._forward(x, ctx)
        from zoo.core.parallel import parameters_grad_summed

        others = [m for name, m in self.named_children() if name != "experts"]  # the experts sum their own
        with parameters_grad_summed(others, self._tp_mesh):
            return self._forward(x, ctx)

    def _forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = self.route(flat)
        if self.cfg.latent_dim is None:
            out, dropped = self.routed(flat, r.indices, r.weights)
        else:
            out, dropped = self.routed(self.latent_down(flat), r.indices, r.weights)
            out = self.latent_up(out)
        if self.shared is not None:
            s = self.shared(flat)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(flat)) * s
            out = out + s
        if self.training and self.cfg.bias_update != "none" and not recomputing():  # once per forward
            with torch.no_grad():
                self.load += torch.bincount(r.indices.reshape(-1), minlength=self.cfg.n_experts).to(self.load.dtype)
        if ctx is not None:
            self.report(r, ctx, shape[:-1])
            if self.cfg.capacity_factor is not None:
                ctx.add_metric("moe_dropped", dropped / r.indices.numel())
        return out.reshape(shape)

    _tp_mesh: Any = None

    def _summed(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, a sum over this process's tokens, summed over the tensor-parallel processes (no-op without)."""
        if self._tp_mesh is None:
            return t
        from zoo.core.parallel import statistic_summed

        return statistic_summed(t, self._tp_mesh)

    def report(self, r: Routing, ctx, lead: torch.Size) -> None:
        """Add this layer's loss terms and metrics to the forward context."""
        cfg, E, k = self.cfg, self.cfg.n_experts, self.cfg.top_k
        mask = _token_mask(ctx, lead, r.logits.device, self._tp_mesh)  # (N,) 1 for real tokens
        chosen = torch.zeros_like(r.probs).scatter_(1, r.indices, 1.0)  # (N, E)
        # Sums over the tokens (under tensor parallelism: over every process's), then the means.
        real = self._summed(mask.sum()).clamp(min=1)
        f = self._summed((chosen * mask[:, None]).sum(0)) / real  # fraction of tokens routed to each expert (sums to k)
        P = self._summed((r.probs * mask[:, None]).sum(0)) / real
        if cfg.switch_loss:
            ctx.add_loss("moe_switch", E * (f * P).sum(), cfg.switch_loss)
        if cfg.switch_pooled_loss:
            self._pool(r, ctx, mask)
        if cfg.sequence_loss or cfg.device_loss:
            B = lead[0] if len(lead) == 2 else 1
            m = mask.view(B, -1, 1)
            real_b = self._summed(m.sum(1)).clamp(min=1)  # (B, 1)
            f_seq = self._summed((chosen.view(B, -1, E) * m).sum(1)) / real_b * (E / k)  # (B, E)
            P_seq = self._summed((r.probs.view(B, -1, E) * m).sum(1)) / real_b
            if cfg.sequence_loss:
                ctx.add_loss("moe_sequence", (f_seq * P_seq).sum(-1).mean(), cfg.sequence_loss)
            if cfg.device_loss:
                D = cfg.n_devices
                f_dev = f_seq.view(B, D, E // D).mean(-1)
                P_dev = P_seq.view(B, D, E // D).sum(-1)
                ctx.add_loss("moe_device", (f_dev * P_dev).sum(-1).mean(), cfg.device_loss)
        if cfg.z_loss:
            z = torch.logsumexp(r.logits, dim=-1).pow(2)
            ctx.add_loss("router_z", self._summed((z * mask).sum()) / real, cfg.z_loss)
        with torch.no_grad():
            seen = ctx.slot(MoEForward)
            j, seen.layers = seen.layers, seen.layers + 1
            load = f / k
            ratio = load.max() / load.mean()
            ctx.add_metric("moe_load_max", ratio)
            ctx.add_metric(f"moe_load_max.{j}", ratio)
            entropy = -(r.probs * r.probs.clamp_min(1e-20).log()).sum(-1)
            ctx.add_metric("router_entropy", self._summed((entropy * mask).sum()) / real)

    def _pool(self, r: Routing, ctx, mask: torch.Tensor) -> None:
        """Gather this layer's counts and probabilities for the loss pooled over every layer, as
        transformers' ``load_balancing_loss_func`` computes it (softmax of the logits, top-k of it)."""
        cfg, E = self.cfg, self.cfg.n_experts
        probs = r.logits.softmax(-1)
        top = probs.topk(cfg.top_k, dim=-1).indices
        counts = torch.zeros_like(probs).scatter_(1, top, 1.0)
        pool = ctx.slot(MoEForward)
        if pool.n_experts is None:
            pool.n_experts, pool.weight = E, cfg.switch_pooled_loss
        if pool.n_experts != E:
            raise ValueError(f"moe switch_pooled_loss pools layers of {pool.n_experts} and {E} experts; use switch_loss")
        pool.counts = pool.counts + self._summed((counts * mask[:, None]).sum(0))
        pool.probs = pool.probs + self._summed((probs * mask[:, None]).sum(0))
        pool.rows = pool.rows + self._summed(mask.sum())
        ctx.at_end("moe_switch_pooled", _pooled_loss)

    @torch.no_grad()
    def after_optimizer_step(self, *, reduce) -> None:
        """Auxiliary-loss-free balancing: move the selection bias towards balance by the global load."""
        if self.cfg.bias_update == "none":
            return
        load = reduce(self.load.clone())
        step = self.cfg.bias_rate * torch.sign(load.mean() - load)
        if self.cfg.bias_update == "sign_centered":
            step = step - step.mean()
        self.router.bias += step.to(self.router.bias.dtype)
        self.load.zero_()

    # -- what this part states about itself ---------------------------------------------------------
    #: The stacked experts, split by expert over the ``ep`` processes under expert parallelism.
    expert_parameters = ("experts.w_gate", "experts.w_up", "experts.w_down", "experts.b_gate", "experts.b_up",
                         "experts.b_down")

    @classmethod
    def check_in_model(cls, cfg, *, spec, layer):
        if cfg.latent_dim is not None and cfg.latent_dim >= spec.d_model:
            raise SpecError("latent_dim", f"{cfg.latent_dim} does not fit: the latent the routed experts run on "
                                          f"projects the token down, so it is narrower than d_model {spec.d_model}")

    @staticmethod
    def shrink(cfg, *, d_ff: int = 64, **_) -> dict:
        E = min(cfg.n_experts, 8)
        out: dict[str, Any] = {"n_experts": E, "top_k": min(cfg.top_k, 2), "d_ff": max(d_ff // 4, 8),
                               "n_devices": 1 if E % cfg.n_devices else cfg.n_devices}
        if cfg.shared_d_ff is not None:
            out["shared_d_ff"] = d_ff
        router = cfg.router.cls.shrink_to(cfg.router.config, E)
        if router:
            out["router"] = {**cfg.router.to_dict(), **router}
        return out

    def facts(self) -> dict:
        shared = f" + shared {self.cfg.shared_d_ff}" if self.shared is not None else ""
        latent = f" on a {self.cfg.latent_dim}-wide latent" if self.cfg.latent_dim is not None else ""
        return {"experts": f"top-{self.cfg.top_k} of {self.cfg.n_experts} ({self.cfg.router.name}){latent}{shared}",
                "d_ff": self.cfg.d_ff}

    def cost(self, context: int) -> Cost:
        experts = self.experts
        per_expert = sum(w[0].numel() for w in experts.parameters())  # every expert's stack, biases included
        rest = sum(p.numel() for n, p in self.named_parameters() if not n.startswith("experts."))
        return Cost(active_params=rest + self.cfg.top_k * per_expert)

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token: the router's; for each of its ``top_k`` copies, the copy dispatched, the expert's
        own (as a dense FFN of the expert's width keeps it: up, and gate, activation and product when
        gated), its output and the weighted output; the indices that sort and add them back; the shared expert's (and
        its gate's). The input itself is kept when a shared expert reads it, or in float32, where the
        router's float32 copy is the input. Under tensor parallelism each process runs its own slice of
        the sequence: a ``tp``-th of that per token."""
        c, k, D, Fd = dtype.itemsize, self.cfg.top_k, self.d_model, self.cfg.d_ff
        router = self.router.activation_bytes(seq_len, dtype, device=device)  # (a plugin router may not say)
        if router is None:
            return None
        per_feature = (3 if device == "cuda" else 4) if self.gated else 2
        out = router + k * (3 * D * c + per_feature * Fd * c + c + 16)
        if self.shared is not None:
            out += self.shared.activation_bytes(seq_len, dtype, device=device)
            if self.shared_gate is not None:
                out += D * c + c  # the shared output and the gate's sigmoid, multiplied
        elif c == 4:
            out += D * c
        return out / tp

    def parallelize(self, tp_mesh) -> None:
        """Tensor parallelism: the MoE runs token by token on this process's slice of the sequence, as
        it arrives, with its router, experts and shared expert whole on every process of ``tp_mesh``
        (no gather: each process routes, counts and sends only its own tokens). Their gradients are
        summed over the processes (:func:`~zoo.core.parallel.grad_summed` on every parameter as the
        forward uses it), and so are the statistics the balance losses and metrics are taken from
        (:func:`~zoo.core.parallel.statistic_summed`), so every process adds the one-process loss terms and each
        token is counted once. The load the selection bias moves by is this process's tokens'
        (``after_optimizer_step`` sums it over every process). Expert parallelism composes: the experts
        are then this process's ``n_experts / ep``, their gradient summed over ``tp_mesh`` too."""
        self._tp_mesh = self.experts.tp_mesh = tp_mesh

    def parallelize_experts(self, ep_mesh) -> list[nn.Module]:
        """Expert parallelism over ``ep_mesh`` (:class:`zoo.core.parallel.ExpertParallel` on
        ``self.experts``): each process holds ``n_experts / ep`` experts and runs them on the token copies
        every process of ``ep_mesh`` routes to them. The router, the shared expert, the losses, the
        metrics and the load count for the selection bias run on this process's own tokens (each token
        is counted once, by the process that holds it)."""
        from zoo.core.parallel import ExpertParallel, expert_count

        expert_count(self.cfg.n_experts, ep_mesh, self)
        ExpertParallel().apply(self.experts, ep_mesh)
        return [self.experts]


def _old_expert(moe: "MoE", name: str) -> Optional[torch.Tensor]:
    from zoo.core.deprecations import warn

    warn("MoE.w_gate, MoE.w_up, MoE.w_down", stacklevel=4)
    return getattr(moe.experts, name)


@dataclass
class MoEForward:
    """What the mixture-of-experts layers of one forward share (``ctx.slot(MoEForward)``): how many have
    run (numbering their ``moe_load_max.{j}`` metrics), and for ``switch_pooled_loss`` the expert
    counts, router probabilities and real rows summed over the layers that pool."""

    layers: int = 0
    n_experts: Optional[int] = None  # of the first pooling layer (all must agree)
    weight: float = 0.0
    counts: Any = 0.0
    probs: Any = 0.0
    rows: Any = 0.0


def _pooled_loss(ctx) -> None:
    pool = ctx.slot(MoEForward)
    rows = pool.rows.clamp(min=1)
    loss = pool.n_experts * ((pool.counts / rows) * (pool.probs / rows)).sum()
    ctx.add_loss("moe_switch_pooled", loss, pool.weight)


def _token_mask(ctx, lead: torch.Size, device, tp_mesh=None) -> torch.Tensor:
    """(N,) float: 1 for real tokens, 0 for padding (from the context's key mask); under tensor
    parallelism (``tp_mesh``) those of this process's slice of the sequence."""
    n = 1
    for d in lead:
        n *= d
    if ctx.key_mask is None or len(lead) != 2:
        return torch.ones(n, device=device)
    mask = ctx.key_mask[:, ctx.slots]
    if tp_mesh is not None:
        T = lead[1]
        mask = mask[:, tp_mesh.get_local_rank() * T:(tp_mesh.get_local_rank() + 1) * T]
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def _with(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **changes)
