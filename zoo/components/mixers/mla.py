"""Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434; DeepSeek-V3).

Keys and values come from one shared latent ``c = RMSNorm(W_DKV x)`` of ``kv_lora_rank`` values per
token, up-projected per head by ``kv_b_proj`` into a key part without position (``qk_nope_head_dim``)
and a value (``v_head_dim``). Position enters through a separate ``qk_rope_head_dim`` part: every
query head has its own, the key part is one vector shared by all heads (``W_KR x``, rotated).
Queries come from ``x`` directly, or through a low-rank latent of ``q_lora_rank`` with its own
RMSNorm (DeepSeek-V2-Lite has none). Per head::

    q = [q_nope ; RoPE(q_rope)]      k = [W_UK c ; RoPE(k_rope)]      v = W_UV c
    softmax scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * (YaRN's mscale_all_dim term)^2

The decode state holds only ``c`` (after its norm) and the rotated ``k_rope`` of each token: a
:class:`~zoo.core.state.KVState` with one "head" whose keys are the latent and whose values are the
rotated key part, exactly what transformers' cache stores for these models. Nothing per head is
kept.

Decoding is *absorbed* by default: ``W_UK`` is folded into the query (``q_nope W_UK`` lives in the
latent space) and ``W_UV`` into the output, so the new queries attend over the cached latents
directly, as multi-query attention with one key/value head of width ``kv_lora_rank (+ rope)``;
the per-head keys and values of the cache are never built. Without a decode state (training,
a full forward) the plain path up-projects the latents and attends per head, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core.kinds import Cost, Mixer
from zoo.core.parallel import grad_summed
from zoo.core.precision import dense_weight
from zoo.core.registry import register
from zoo.core.spec import Part, SpecError, part_field, positive
from zoo.core.state import KVState

from zoo.components.mixers._masks import dense_mask


def softmax_factor(spec, layer) -> float:
    """What the layer's RoPE scaling multiplies the softmax scale by (DeepSeek's YaRN: the square
    of its ``mscale_all_dim`` term); 1 without one."""
    position = layer.position if layer.position is not None else spec.position
    scaling = getattr(position.config, "scaling", None) if position is not None else None
    fn = getattr(scaling.cls, "softmax_factor", None) if scaling is not None else None
    return float(fn(scaling.config)) if callable(fn) else 1.0


@register("mixer", "mla")
class MLA(Mixer):
    """Multi-head latent attention: keys and values from a compressed latent, a decoupled rotary
    key shared by the heads; the decode state is the latent and the rotated key part."""

    documents: ClassVar[bool] = True  # packed documents: a mask keeps attention inside each

    @dataclass(frozen=True)
    class Config:
        n_heads: int
        kv_lora_rank: int
        qk_nope_head_dim: int
        qk_rope_head_dim: int
        v_head_dim: int
        q_lora_rank: Optional[int] = None  # None: queries straight from x (DeepSeek-V2-Lite)
        bias: bool = False  # on q_a_proj, kv_a_proj and o_proj (transformers' attention_bias)
        latent_norm: Part = part_field("norm", "rmsnorm")  # on the q and kv latents
        decode: Literal["absorbed", "plain"] = "absorbed"  # how a decode state is attended

        def check(self):
            for name in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                positive(name, getattr(self, name), allow_none=False)
            positive("q_lora_rank", self.q_lora_rank)
            if self.qk_rope_head_dim % 2:
                raise SpecError("qk_rope_head_dim", f"is rotated in pairs and must be even, got {self.qk_rope_head_dim}")

    def __init__(self, cfg, *, d_model: int, layer, spec, index: int = 0):
        super().__init__()
        self.cfg, self.index = cfg, index
        H, C = cfg.n_heads, cfg.kv_lora_rank
        self.n_heads, self.kv_lora_rank = H, C
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.scale = self.qk_dim ** -0.5 * softmax_factor(spec, layer)
        self.dropout = spec.dropout
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_norm = cfg.latent_norm.build(dim=cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(d_model, C + self.rope, bias=cfg.bias)
        self.kv_a_norm = cfg.latent_norm.build(dim=C)
        self.kv_b_proj = nn.Linear(C, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d_model, bias=cfg.bias)

    def new_state(self, batch, max_len, *, dtype=None, device=None) -> KVState:
        """One single-"head" KV state: keys are the normed latent (kv_lora_rank), values the rotated
        key part (qk_rope_head_dim)."""
        return KVState(window=None, max_len=max_len)

    def queries(self, x):
        """(B, H, T, nope) and (B, H, T, rope) query parts, before rotation."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, T, -1, self.qk_dim).transpose(1, 2)  # -1: this process's heads
        return q.split([self.nope, self.rope], dim=-1)

    def latents(self, x):
        """(B, 1, T, kv_lora_rank) normed latent and (B, 1, T, rope) key part, before rotation."""
        B, T, _ = x.shape
        c, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope], dim=-1)
        mesh = getattr(self, "_tp_mesh", None)
        if mesh is not None:  # whole on every process, used by its own heads only: sum its gradient
            k_rope = grad_summed(k_rope, mesh)
        return self.kv_a_norm(c).view(B, 1, T, -1), k_rope.view(B, 1, T, -1)

    def up_weights(self):
        """``W_UK`` (H, nope, kv_lora_rank) and ``W_UV`` (H, v, kv_lora_rank), views of kv_b_proj (of this
        process's heads under tensor parallelism)."""
        w = dense_weight(self.kv_b_proj)
        if hasattr(w, "to_local"):  # sharded by heads under tensor parallelism: this process's heads
            w = w.to_local()
        w = w.view(-1, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, ctx, pos):
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x)
        c, k_rope = self.latents(x)
        if pos is not None:
            q_rope, k_rope = pos.rotate(q_rope, k_rope)
            q_rope, k_rope = q_rope.to(x.dtype), k_rope.to(x.dtype)
        q_idx = k_idx = ctx.slots
        if ctx.state is not None:
            c, k_rope, k_idx = ctx.state.layers[self.index].update(c, k_rope, q_idx)
        key_mask = ctx.key_mask
        if key_mask is not None and k_idx is not q_idx:
            key_mask = key_mask[:, k_idx]
        if ctx.state is not None and self.cfg.decode == "absorbed":
            out = self.attend_absorbed(q_nope, q_rope, c, k_rope, q_idx, k_idx, key_mask, ctx.documents)
        else:
            out = self.attend_plain(q_nope, q_rope, c, k_rope, q_idx, k_idx, key_mask, ctx.documents)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def _mask(self, q_idx, k_idx, key_mask, documents=None):
        """(None, True) for a plain causal forward over its own slots, else (boolean mask, False)."""
        if key_mask is None and documents is None and k_idx is q_idx:
            return None, True
        return dense_mask(q_idx, k_idx, None, key_mask, documents), False

    def attend_plain(self, q_nope, q_rope, c, k_rope, q_idx, k_idx, key_mask, documents=None):
        """Up-project every latent into per-head keys and values, then attend per head."""
        B, H, _, _ = q_nope.shape
        Tk = c.shape[2]
        kv = self.kv_b_proj(c[:, 0]).view(B, Tk, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, Tk, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        mask, causal = self._mask(q_idx, k_idx, key_mask, documents)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              dropout_p=self.dropout if self.training else 0.0)

    def attend_absorbed(self, q_nope, q_rope, c, k_rope, q_idx, k_idx, key_mask, documents=None):
        """Attend over the latents themselves: ``W_UK`` folded into the queries, ``W_UV`` applied
        to the weighted sum of latents. Every head meets the same key ``[c ; k_rope]`` (multi-query
        attention), so the heads are folded into the rows of one matrix product per batch row; the
        cache is read in place (SDPA would expand it to every head)."""
        B, H, T, _ = q_nope.shape
        w_uk, w_uv = self.up_weights()
        q_lat = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk.to(q_nope.dtype))
        c, k_rope = c[:, 0], k_rope[:, 0]  # (B, Tk, kv_lora_rank), (B, Tk, rope)
        scores = q_lat.reshape(B, H * T, -1) @ c.transpose(1, 2) + q_rope.reshape(B, H * T, -1) @ k_rope.transpose(1, 2)
        scores = (scores * self.scale).view(B, H, T, -1)
        mask = dense_mask(q_idx, k_idx, None, key_mask, documents)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(c.dtype)
        probs = F.dropout(probs, self.dropout, self.training)
        o_lat = (probs.view(B, H * T, -1) @ c).view(B, H, T, -1)  # (B, H, T, kv_lora_rank)
        return torch.einsum("bhtc,hvc->bhtv", o_lat, w_uv.to(o_lat.dtype))

    # -- what this part states about itself ---------------------------------------------------------
    @classmethod
    def rotary_dim(cls, cfg, d_model: int) -> int:
        """RoPE rotates only the decoupled part of each query head and the shared key part."""
        return cfg.qk_rope_head_dim

    @classmethod
    def check_in_model(cls, cfg, *, spec, layer):
        position = layer.position if layer.position is not None else spec.position
        if position is None or position.cls.applies_to != "qk":
            return
        rd = getattr(position.config, "rotary_dim", None)
        fraction = getattr(position.config, "rotary_fraction", 1.0)
        if (rd is not None and rd != cfg.qk_rope_head_dim) or fraction != 1.0:
            raise SpecError("qk_rope_head_dim", f"{cfg.qk_rope_head_dim} is the width RoPE rotates in MLA; the position "
                            f"encoding asks for rotary_dim {rd} / rotary_fraction {fraction}: drop them")

    @staticmethod
    def shrink(cfg, *, head_dim: int = 8, **_) -> dict:
        """A tiny copy: 4 heads, a 16-wide kv latent, the nope/rope/value widths from ``head_dim``."""
        out = {"n_heads": 4, "kv_lora_rank": 2 * head_dim, "qk_nope_head_dim": head_dim,
               "qk_rope_head_dim": max(2, head_dim // 2), "v_head_dim": head_dim + head_dim // 2}
        if cfg.q_lora_rank is not None:
            out["q_lora_rank"] = 3 * head_dim // 2
        return out

    def cost(self, context: int) -> Cost:
        """The plain path's scores and weighted sum (``2 H (nope + rope) + 2 H v`` FLOPs per key);
        the decode state is ``kv_lora_rank + qk_rope_head_dim`` values per token."""
        per_key = 2 * self.n_heads * (self.qk_dim + self.v_dim)
        state = self.kv_lora_rank + self.rope
        return Cost(flops=per_key * context, flops_mean=per_key * (context + 1) / 2,
                    state_per_token=state, state_at_context=state * context)

    def facts(self) -> dict:
        return {"attention": "MLA", "n_heads": self.n_heads, "q_lora_rank": self.cfg.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.nope, "qk_rope_head_dim": self.rope,
                "v_head_dim": self.v_dim, "state_per_token": self.kv_lora_rank + self.rope,
                "mha_state_per_token": self.n_heads * (self.qk_dim + self.v_dim), "decode": self.cfg.decode}

    def _latent_activation_bytes(self, seq_len, dtype, *, device="cuda"):
        """Of :meth:`activation_bytes`, what every process keeps whole: the input the projections read and
        the latents with their norms'."""
        c = dtype.itemsize
        out = self.kv_a_proj.in_features * c + self.kv_lora_rank * c \
            + self.kv_a_norm.activation_bytes(seq_len, dtype, device=device)
        if self.cfg.q_lora_rank is not None:
            out += self.cfg.q_lora_rank * c + self.q_a_norm.activation_bytes(seq_len, dtype, device=device)
        return out

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Per token (the plain path training takes): the input the projections read (gathered under
        tensor parallelism) and, whole on every process, the query latent and the key-value latent, each
        with its norm's own; of this process's heads, the projected queries, the up-projected keys and
        values, the concatenated queries and keys attention reads, its output and float32 log-sum-exp."""
        c = dtype.itemsize
        H = self.n_heads / tp
        return self._latent_activation_bytes(seq_len, dtype, device=device) \
            + H * (c * (3 * self.qk_dim + self.nope + 2 * self.v_dim) + 4)

    def parallelize(self, tp_mesh) -> None:
        """Tensor parallelism by heads: the sequence gathered; the per-head projections (``q_proj`` or
        ``q_b_proj``, ``kv_b_proj``) sharded by their heads' rows, ``o_proj`` by its columns and
        reduce-scattered back onto the sequence slice. The latents (``q_a_proj``, ``kv_a_proj`` and their
        norms) are small and stay whole on every process: their gradients arrive summed over the
        processes through the head projections they feed, and through :func:`~zoo.core.parallel.grad_summed`
        for the rotary key part every local head shares."""
        from torch.distributed.tensor.parallel import parallelize_module

        from zoo.core.parallel import heads_in, heads_out, local_count, sequence_input

        local_count(self.n_heads, tp_mesh, "n_heads", self)
        parallelize_module(self, tp_mesh, sequence_input(tp_mesh, local=True))
        q = "q_proj" if self.cfg.q_lora_rank is None else "q_b_proj"
        parallelize_module(self, tp_mesh, {q: heads_in(), "kv_b_proj": heads_in(), "o_proj": heads_out()})
        self._tp_mesh = tp_mesh
