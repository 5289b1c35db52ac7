"""A test plugin, loaded as a user's plugin is (``zoo.load_plugin("toy_plugin")``), that adds what the
core did not use to admit: a recurrent token mixer with its own fixed-size decode state, a top-2
mixture-of-experts FFN with an auxiliary loss, a metric and a post-step bias update, a checkpoint
format that saves both, and a deliberately broken variant of each part for the conformance suite
to catch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import zoo
from zoo.checkpoints.hf.format import CheckpointFormat, Fields
from zoo.checkpoints.hf.maps import rule
from zoo.core.kinds import Cost
from zoo.core.spec import ModelSpec


# ------------------------------------------------------------------------------ recurrent mixer

class RecurrentState:
    """The fixed-size state of a decayed linear attention: S (B, H, Dk, Dv), whatever the length."""

    def __init__(self, batch: Optional[int], heads: int, dim: int, dtype, device):
        self.shape, self.dtype, self.device = (heads, dim, dim), dtype, device
        self.S = None if batch is None else torch.zeros(batch, *self.shape, dtype=dtype, device=device)

    def get(self, batch: int) -> torch.Tensor:
        if self.S is None:
            self.S = torch.zeros(batch, *self.shape, dtype=self.dtype, device=self.device)
        return self.S

    def nbytes(self) -> int:
        return 0 if self.S is None else self.S.numel() * self.S.element_size()

    def to_static(self, max_len: int) -> "RecurrentState":
        return self  # already of fixed size; updated in place


class ToyRecurrent(nn.Module):
    """Decayed linear attention: ``S_t = g S_{t-1} + k_t v_t^T``, ``y_t = q_t S_t`` per head, with a
    learned decay ``g`` in (0, 1). The full forward uses the parallel form
    ``y = ((q k^T) * g^(t-s) [s <= t]) v``; decoding carries S."""

    @dataclass(frozen=True)
    class Config:
        n_heads: int = 4
        head_dim: int = 8

    def __init__(self, cfg, *, d_model, layer, spec, index=0):
        super().__init__()
        self.cfg, self.index = cfg, index
        H, D = cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(d_model, H * D, bias=False)
        self.k_proj = nn.Linear(d_model, H * D, bias=False)
        self.v_proj = nn.Linear(d_model, H * D, bias=False)
        self.o_proj = nn.Linear(H * D, d_model, bias=False)
        self.decay = nn.Parameter(torch.empty(H))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.constant_(self.decay, 2.0)  # g = sigmoid(2) = 0.88 (elementwise: works on sharded parameters too)

    @staticmethod
    def shrink(cfg, *, head_dim=8, **_):
        return {"n_heads": 2, "head_dim": head_dim}

    def new_state(self, batch, max_len, *, dtype, device):
        return RecurrentState(batch, self.cfg.n_heads, self.cfg.head_dim, dtype, device)

    def cost(self, context):
        H, D = self.cfg.n_heads, self.cfg.head_dim
        return Cost(flops=4 * H * D * D, flops_mean=4 * H * D * D, state_fixed=H * D * D)

    def facts(self):
        return {"recurrent heads": f"{self.cfg.n_heads} x {self.cfg.head_dim}, decayed linear attention"}

    def _heads(self, x, ctx):
        B, T, _ = x.shape
        H, D = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = (p(x).view(B, T, H, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if ctx.key_mask is not None:  # padding adds nothing to the state
            k = k * ctx.key_mask[:, ctx.slots][:, None, :, None].to(k.dtype)
        return q, k, v

    def forward(self, x, ctx, pos):
        B, T, _ = x.shape
        q, k, v = self._heads(x, ctx)
        log_g = F.logsigmoid(self.decay.float())[None, :, None, None]  # (1, H, 1, 1)
        t = torch.arange(T, device=x.device, dtype=torch.float32)
        dist = t[:, None] - t[None, :]
        decay = torch.where(dist >= 0, torch.exp(log_g * dist.clamp(min=0)), torch.zeros(()))
        y = ((q @ k.transpose(-1, -2)) * decay.to(q.dtype)) @ v  # (B, H, T, D)
        if ctx.state is not None:
            layer = ctx.state.layers[self.index]
            S = layer.get(B)
            y = y + (q * self._carry(log_g, t).to(q.dtype)) @ S
            w = torch.exp(log_g * (T - 1 - t)[None, None, :, None]).to(k.dtype)  # g^(T-1-s)
            S.copy_(torch.exp(log_g * T).to(S.dtype) * S + (k * w).transpose(-1, -2) @ v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _carry(self, log_g, t):
        """What the state before this chunk contributes to position t of it: g^(t+1)."""
        return torch.exp(log_g * (t + 1)[None, None, :, None])


class ToyRecurrentBroken(ToyRecurrent):
    """Forgets to decay the carried state within a chunk: the full forward is right, decoding is not."""

    def _carry(self, log_g, t):
        return torch.ones_like(torch.exp(log_g * (t + 1)[None, None, :, None]))


# ----------------------------------------------------------------------------------- toy MoE

class ToyMoE(nn.Module):
    """Top-k of ``n_experts`` SwiGLU experts (stacked), softmax router in float32, a Switch-style
    balance loss ``n * sum_e f_e P_e`` weighted by ``balance_weight``, a router-entropy metric, and a
    selection bias (a buffer) nudged towards balance after every optimizer step."""

    @dataclass(frozen=True)
    class Config:
        n_experts: int = 4
        top_k: int = 2
        d_ff: int = 32
        balance_weight: float = 0.01
        bias_rate: float = 0.01

    def __init__(self, cfg, *, d_model):
        super().__init__()
        self.cfg = cfg
        E, F_ = cfg.n_experts, cfg.d_ff
        self.router = nn.Linear(d_model, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, F_, d_model))
        self.w_up = nn.Parameter(torch.empty(E, F_, d_model))
        self.w_down = nn.Parameter(torch.empty(E, d_model, F_))
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("counts", torch.zeros(E), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            for w in (self.w_gate, self.w_up, self.w_down):
                w.normal_(0.0, 0.02)
            self.expert_bias.zero_()
            self.counts.zero_()

    @staticmethod
    def shrink(cfg, *, d_ff=64, **_):
        return {"d_ff": d_ff}

    def facts(self):
        return {"experts": f"top-{self.cfg.top_k} of {self.cfg.n_experts}", "d_ff": self.cfg.d_ff}

    def cost(self, context):
        per_expert = self.w_gate[0].numel() + self.w_up[0].numel() + self.w_down[0].numel()
        return Cost(active_params=self.router.weight.numel() + self.cfg.top_k * per_expert)

    def route(self, x):
        scores = F.linear(x.float(), self.router.weight.float()).softmax(-1)  # (N, E), float32 whatever the dtype
        top = torch.topk(scores + self.expert_bias, self.cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, top)
        return scores, top, weights / weights.sum(-1, keepdim=True)

    def forward(self, x, ctx=None):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, top, weights = self.route(flat)
        out = torch.zeros_like(flat)
        for slot in range(self.cfg.top_k):
            e = top[:, slot]
            g = torch.einsum("nd,nfd->nf", flat, self.w_gate[e])
            u = torch.einsum("nd,nfd->nf", flat, self.w_up[e])
            y = torch.einsum("nf,ndf->nd", F.silu(g) * u, self.w_down[e])
            out = out + weights[:, slot, None].to(y.dtype) * y
        E = self.cfg.n_experts
        chosen = F.one_hot(top, E).sum(1).float()  # (N, E)
        if self.training:
            self.counts += chosen.sum(0).detach()
        if ctx is not None:
            f = chosen.mean(0) / self.cfg.top_k
            ctx.add_loss("moe_balance", E * (f * scores.mean(0)).sum(), self.cfg.balance_weight)
            ctx.add_metric("router_entropy", -(scores * scores.clamp_min(1e-9).log()).sum(-1).mean())
        return out.reshape(shape)

    def after_optimizer_step(self, *, reduce):
        counts = reduce(self.counts)
        self.expert_bias += self.cfg.bias_rate * torch.sign(counts.mean() - counts)
        self.counts.zero_()


class ToyMoEBroken(ToyMoE):
    """Routes each token by the mean over its whole sequence: one token's change moves every other
    token's output, which the FFN contract (position-wise) must catch."""

    def route(self, x):
        return super().route(x.mean(0, keepdim=True).expand_as(x))


# -------------------------------------------------------------------------------- the format

H, Z = "model.layers.{i}.", "layers.{i}."


class ToyHybrid(CheckpointFormat):
    """``toy-hybrid``: recurrent layers, then attention, alternating; every FFN a toy MoE."""

    model_type, architecture = "toy-hybrid", "ToyHybridForCausalLM"
    tiny = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_experts": 4, "intermediate_size": 32}

    def rules(self, spec):
        rec = [rule(f"{H}mixer.{p}_proj.weight", f"{Z}mixer.{p}_proj.weight") for p in "qkvo"]
        return [
            rule("model.embed_tokens.weight", "embed.weight"),
            *rec,
            rule(f"{H}mixer.decay", f"{Z}mixer.decay"),
            *[rule(f"{H}mlp.{w}", f"{Z}ffn.{w}") for w in ("router.weight", "w_gate", "w_up", "w_down",
                                                             "expert_bias")],
            rule(f"{H}input_layernorm.weight", f"{Z}attn_norm.weight"),
            rule(f"{H}post_attention_layernorm.weight", f"{Z}ffn_norm.weight"),
            rule("model.norm.weight", "final_norm.weight"),
            rule("lm_head.weight", "lm_head.weight"),
        ]

    def config_to_spec(self, config, *, strict=True):
        f = Fields(config, self.model_type)
        ffn = {"name": "toy_moe", "n_experts": f.require("num_experts"), "d_ff": f.require("intermediate_size")}
        heads = f.require("num_attention_heads")
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": f.require("hidden_size"),
            "n_layers": f.require("num_hidden_layers"), "max_seq_len": 64, "final_norm": "rmsnorm",
            "layers": {
                "rec": {"mixer": {"name": "toy_recurrent", "n_heads": heads, "head_dim": 8}, "ffn": ffn},
                "att": {"mixer": {"name": "attention", "n_heads": heads, "n_kv_heads": f.require("num_key_value_heads")},
                        "ffn": ffn},
            },
            "layer_pattern": ["rec", "att"],
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    def spec_to_config(self, spec):
        rec, att = spec.layers["rec"], spec.layers["att"]
        return {"vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
                "num_attention_heads": rec.mixer.n_heads, "num_key_value_heads": att.mixer.n_kv_heads,
                "num_experts": rec.ffn.n_experts, "intermediate_size": rec.ffn.d_ff}


@zoo.hookimpl
def zoo_register(registry):
    registry.add_mixer("toy_recurrent", ToyRecurrent)
    registry.add_mixer("toy_recurrent_broken", ToyRecurrentBroken)
    registry.add_ffn("toy_moe", ToyMoE)
    registry.add_ffn("toy_moe_broken", ToyMoEBroken)
    registry.add_checkpoint_format("toy-hybrid", ToyHybrid())


#: A hybrid of the toy parts: recurrent first (sharing the model's RoPE, which it does not take),
#: then attention; every FFN the toy MoE.
SPEC = {
    "vocab_size": 64, "d_model": 32, "n_layers": 4, "max_seq_len": 64, "position": "rope", "final_norm": "rmsnorm",
    "layers": {
        "rec": {"mixer": {"name": "toy_recurrent", "n_heads": 4, "head_dim": 8}, "ffn": {"name": "toy_moe"}},
        "att": {"mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2}, "ffn": {"name": "toy_moe"}},
    },
    "layer_pattern": ["rec", "att"],
}
