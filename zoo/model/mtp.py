"""Multi-token prediction (DeepSeek-V3, section 2.2): extra modules that predict further ahead.

Module d (1-based, up to ``spec.mtp.depth``) at position i reads the hidden state of module d-1 at
i (the main model's final, normalised hidden state for d = 1) and the embedding of token t+d:

    h'  = eh_proj([enorm(embed(t[i+d])); hnorm(h[d-1][i])])     # embedding first, as the checkpoints
    h_d = block(h')                                              # one layer of the recipe's kind (or several)
    logits_d = head(norm(h_d))                                    # the main model's head, own norm

and its logits at i predict token t+1+d. Training adds ``weight / depth`` times each module's
cross-entropy through the auxiliary-loss channel (named ``mtp_1``, ``mtp_2``, ...). The embedding
and the head are the main model's own; checkpoints in DeepSeek's layout store copies of them beside
each module (layer index ``n_layers + d - 1``), which :func:`mtp_rules` maps both ways.

:func:`speculative_generate` uses module 1 as a draft model for the main one (self-speculative
decoding): greedy output identical to plain greedy decoding, at one main forward per one or two
tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import kernels as _kernels
from zoo.core.context import ForwardContext
from zoo.core import kinds as _kinds
from zoo.core.parallel import grad_summed
from zoo.core.state import DecodeState
from zoo.model.context import for_tokens
from zoo.model.loss import lm_loss, vocab_parallel_lm_loss


def mtp_layer_kinds(spec) -> tuple[str, ...]:
    """The layer kinds of each MTP module's blocks, in order: ``spec.mtp.layer`` (one kind or a list),
    else the last layer's kind."""
    layer = spec.mtp.layer or spec.layer_kind(spec.n_layers - 1)
    return layer if isinstance(layer, tuple) else (layer,)


def mtp_layer_kind(spec) -> str:
    """The layer kind of the MTP block, for a module of one block (``spec.mtp.layer``, else the last
    layer's kind)."""
    kinds = mtp_layer_kinds(spec)
    if len(kinds) > 1:
        raise ValueError(f"mtp.layer: each module here runs {len(kinds)} blocks ({', '.join(kinds)}); "
                         "this layout stores one block per module")
    return kinds[0]


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection of their concatenation, a block (or, for several
    layer kinds, a list of blocks run in order), the head's norm."""

    def __init__(self, spec, index: int):
        super().__init__()
        d = spec.d_model
        kinds = mtp_layer_kinds(spec)
        first = spec.layers[kinds[0]]
        self.enorm, self.hnorm = first.norm.build(dim=d), first.norm.build(dim=d)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # index: this depth's first entry in the MTP decode state (MTP.new_state), one per block.
        blocks = [spec.layers[k].block.build(spec=spec, layer=spec.layers[k], index=index + j) for j, k in enumerate(kinds)]
        self.block = blocks[0] if len(blocks) == 1 else nn.ModuleList(blocks)
        self.norm = spec.layers[kinds[-1]].norm.build(dim=d)  # DeepSeek's shared_head.norm

    def blocks(self) -> list[nn.Module]:
        return list(self.block) if isinstance(self.block, nn.ModuleList) else [self.block]

    def parallelize(self, tp_mesh, where: str) -> None:
        """Tensor parallelism: the norms and the projection work on this process's slice of the sequence,
        the block states its own plan. The projection's weight is whole on every process and sees only its
        slice, so its gradient is summed over the processes (:func:`~zoo.core.parallel.grad_summed`)."""
        for name in ("enorm", "hnorm", "norm"):
            _kinds.parallelize(getattr(self, name), tp_mesh, f"{where}.{name}", shard_dim=1)
        for j, block in enumerate(self.blocks()):
            at = f"{where}.block" if len(self.blocks()) == 1 else f"{where}.block.{j}"
            _kinds.parallelize(block, tp_mesh, at, prefix=at)
        self._tp_mesh = tp_mesh

    def forward(self, h: torch.Tensor, e: torch.Tensor, ctx: ForwardContext, pos) -> torch.Tensor:
        """``pos``: one position state per block."""
        x = torch.cat([self.enorm(e), self.hnorm(h)], dim=-1)
        mesh = getattr(self, "_tp_mesh", None)
        x = self.eh_proj(x) if mesh is None else F.linear(x, grad_summed(self.eh_proj.weight, mesh))
        for block, p in zip(self.blocks(), pos):
            x = block(x, ctx, p)
        return x


class MTP(nn.Module):
    """The ``spec.mtp.depth`` modules, run after the main model on its hidden states."""

    def __init__(self, spec):
        super().__init__()
        self.depth, self.weight = spec.mtp.depth, spec.mtp.weight
        kinds = mtp_layer_kinds(spec)
        self.layers = nn.ModuleList(MTPModule(spec, d * len(kinds)) for d in range(self.depth))
        # For each block, the last main layer of its kind: its position encoding serves the block.
        self.like = [max(i for i in range(spec.n_layers) if spec.layer_kind(i) == kind) for kind in kinds]

    def parallelize(self, tp_mesh) -> None:
        """Tensor and sequence parallelism (from ``Decoder.parallelize``): each depth's norms, projection and
        block (:meth:`MTPModule.parallelize`); the embedding and the head are the main model's, sharded
        there. Under it :meth:`add_losses` runs every depth on the whole length (see there)."""
        for d, module in enumerate(self.layers):
            module.parallelize(tp_mesh, f"mtp.layers.{d}")

    def new_state(self, batch: Optional[int], max_len: Optional[int] = None, *, dtype, device) -> DecodeState:
        states = [b.mixer.new_state(batch, max_len, dtype=dtype, device=device) for m in self.layers for b in m.blocks()]
        return DecodeState(states, batch=batch, max_len=max_len, device=device)

    def run(self, model, depth: int, h: torch.Tensor, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Module ``depth`` (0-based) on hidden states ``h`` (B, T, d) and next tokens ``ids`` (B, T):
        its last block's output (before the head's norm)."""
        pos = [model.position_state(ctx.position_ids, h.dtype, i) for i in self.like]
        return self.layers[depth](h, model.embed_tokens(ids), ctx, pos)

    def logits(self, model, depth: int, out: torch.Tensor) -> torch.Tensor:
        return model.logits_from_hidden(self.layers[depth].norm(out))

    def add_losses(self, model, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], ctx: ForwardContext) -> None:
        """Add each depth's cross-entropy (``mtp_{d}``, weight ``weight / depth``) to ``ctx``.

        ``hidden`` (B, T, d): the main model's final hidden states; ``labels`` (B, T) with -100 where
        no token counts. Depth d (1-based) reads positions i = 0 .. T-1-d (with token i + d) and is
        scored on ``labels[:, i + 1 + d]`` where that exists.

        Under tensor parallelism ``hidden`` is this process's slice of the sequence, and every depth runs on
        the whole length T, each process on its slice: the tokens after the last are filled (with token 0,
        not padding) and their positions predict nothing. Attention is causal, so positions 0 .. T-2-d
        compute what they compute on the shorter sequence.
        """

        B, T = input_ids.shape
        whole = getattr(model, "_tp", 1) > 1  # each depth on the whole (sequence-sharded) length
        h = hidden
        for d in range(self.depth):
            n = T - 1 - d  # positions whose input token t[i+1+d] exists (the last has no target)
            if n < 2:
                break
            ids = input_ids[:, 1 + d: 1 + d + n]
            mask = attention_mask[:, :n] if attention_mask is not None else None
            if whole:
                ids = F.pad(ids, (0, T - n))
                mask = F.pad(mask, (0, T - n), value=1) if mask is not None else None
            else:
                h = h[:, :n]
            sub = for_tokens(B, ids.shape[1], input_ids.device, mask)
            h = self.run(model, d, h, ids, sub)
            sub.finish()
            target = labels[:, 1 + d + 1: 1 + d + 1 + n]
            if mask is not None:  # a padding position predicts nothing
                target = target.masked_fill(~mask[:, : target.shape[1]].bool(), -100)
            normed = self.layers[d].norm(h)
            fused = None
            if not whole:
                normed = normed[:, : target.shape[1]]
                fused = _kernels.fast(model, normed)
            if fused is not None:
                ce = fused(model, normed, target, z_loss=0.0)[0]  # the loss (= ce without z): ce carries no gradient
            elif whole:  # vocabulary-parallel, as the main loss; the filled positions' logits go
                logits, start, mesh = model._local_logits(normed)
                ce = vocab_parallel_lm_loss(logits[:, : target.shape[1]], target, start=start, tp_mesh=mesh).ce
            else:
                ce = lm_loss(model.logits_from_hidden(normed)[:, : target.shape[1]], target).ce
            ctx.add_loss(f"mtp_{d + 1}", ce, self.weight / self.depth)
            for name, value in sub.aux.items():  # a MoE block's balance loss, say
                ctx.add_loss(f"mtp_{d + 1}_{name}", value, sub.aux_weights[name])
            for name, value in sub.metrics.items():
                ctx.add_metric(f"mtp_{d + 1}_{name}", value)


