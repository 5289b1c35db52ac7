"""Multi-token prediction (DeepSeek-V3, section 2.2): extra modules that predict further ahead.

Module d (1-based, up to ``spec.mtp.depth``) at position i reads the hidden state of module d-1 at
i (the main model's final, normalised hidden state for d = 1) and the embedding of token t+d:

    h'  = eh_proj([enorm(embed(t[i+d])); hnorm(h[d-1][i])])     # embedding first, as the checkpoints
    h_d = block(h')                                              # one layer of the recipe's kind
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

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.interfaces import ForwardContext
from zoo.state import DecodeState, step_layout


def mtp_layer_kind(spec) -> str:
    """The layer kind of the MTP blocks: ``spec.mtp.layer``, else the last layer's."""
    return spec.mtp.layer or spec.layer_kind(spec.n_layers - 1)


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection of their concatenation, a block, the head's norm."""

    def __init__(self, spec, index: int):
        super().__init__()
        d = spec.d_model
        layer = spec.layers[mtp_layer_kind(spec)]
        self.enorm, self.hnorm = layer.norm.build(dim=d), layer.norm.build(dim=d)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # index: this depth's entry in the MTP decode state (MTP.new_state).
        self.block = layer.block.build(spec=spec, layer=layer, index=index)
        self.norm = layer.norm.build(dim=d)  # DeepSeek's shared_head.norm

    def forward(self, h: torch.Tensor, e: torch.Tensor, ctx: ForwardContext, pos) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        return self.block(x, ctx, pos)


class MTP(nn.Module):
    """The ``spec.mtp.depth`` modules, run after the main model on its hidden states."""

    def __init__(self, spec):
        super().__init__()
        self.depth, self.weight = spec.mtp.depth, spec.mtp.weight
        self.layers = nn.ModuleList(MTPModule(spec, d) for d in range(self.depth))
        kind = mtp_layer_kind(spec)
        # The last main layer of the same kind: its position encoding serves the MTP blocks.
        self.like = max(i for i in range(spec.n_layers) if spec.layer_kind(i) == kind)

    def new_state(self, batch: Optional[int], max_len: Optional[int] = None, *, dtype, device) -> DecodeState:
        states = [m.block.attention.new_state(batch, max_len, dtype=dtype, device=device) for m in self.layers]
        return DecodeState(states, batch=batch, max_len=max_len, device=device)

    def run(self, model, depth: int, h: torch.Tensor, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Module ``depth`` (0-based) on hidden states ``h`` (B, T, d) and next tokens ``ids`` (B, T):
        its block's output (before the head's norm)."""
        pos = model.position_state(ctx.position_ids, h.dtype, self.like)
        return self.layers[depth](h, model.embed_tokens(ids), ctx, pos)

    def logits(self, model, depth: int, out: torch.Tensor) -> torch.Tensor:
        return model.logits_from_hidden(self.layers[depth].norm(out))

    def add_losses(self, model, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], ctx: ForwardContext) -> None:
        """Add each depth's cross-entropy (``mtp_{d}``, weight ``weight / depth``) to ``ctx``.

        ``hidden`` (B, T, d): the main model's final hidden states; ``labels`` (B, T) with -100 where
        no token counts. Depth d (1-based) reads positions i = 0 .. T-1-d (with token i + d) and is
        scored on ``labels[:, i + 1 + d]`` where that exists.
        """
        from zoo import kernels as _kernels
        from zoo.model import lm_loss

        B, T = input_ids.shape
        h = hidden
        for d in range(self.depth):
            n = T - 1 - d  # positions whose input token t[i+1+d] exists (the last has no target)
            if n < 2:
                break
            h = h[:, :n]
            mask = attention_mask[:, :n] if attention_mask is not None else None
            slots, key_mask, positions = step_layout(B, n, input_ids.device, mask)
            sub = ForwardContext(position_ids=positions, slots=slots, key_mask=key_mask)
            h = self.run(model, d, h, input_ids[:, 1 + d: 1 + d + n], sub)
            sub.finish()
            target = labels[:, 1 + d + 1: 1 + d + 1 + n]
            if mask is not None:  # a padding position predicts nothing
                target = target.masked_fill(~mask[:, : target.shape[1]].bool(), -100)
            normed = self.layers[d].norm(h)[:, : target.shape[1]]
            fused = _kernels.fast(model, normed)
            if fused is not None:
                ce = fused(model, normed, target, z_loss=0.0)[1]
            else:
                ce = lm_loss(model.logits_from_hidden(normed), target).ce
            ctx.add_loss(f"mtp_{d + 1}", ce, self.weight / self.depth)
            for name, value in sub.aux.items():  # a MoE block's balance loss, say
                ctx.add_loss(f"mtp_{d + 1}_{name}", value, sub.aux_weights[name])
            for name, value in sub.metrics.items():
                ctx.add_metric(f"mtp_{d + 1}_{name}", value)


# -- checkpoints ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MTPLayout:
    """Where a checkpoint keeps the MTP modules: ``block`` is the prefix of depth d's block (``{n}``
    stands for ``n_layers + d``, ``{d}`` for d, 0-based), the other fields the names of its own tensors
    (``{block}`` is that prefix); ``copies``: it also stores the embedding and the head per depth."""

    block: str
    enorm: str
    hnorm: str
    eh_proj: str
    norm: str
    copies: bool


#: DeepSeek-V3: depth d is layer n_layers + d, beside copies of the embedding and the head.
DEEPSEEK = MTPLayout("model.layers.{n}.", "{block}enorm.weight", "{block}hnorm.weight", "{block}eh_proj.weight",
                     "{block}shared_head.norm.weight", copies=True)
#: Qwen3-Next (and Qwen3.5): an ``mtp.`` tree beside the model, the same parts under other names.
QWEN3_NEXT = MTPLayout("mtp.layers.{d}.", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                       "mtp.fc.weight", "mtp.norm.weight", copies=False)


def mtp_rules(rules: list, spec, layout: MTPLayout = DEEPSEEK, *, hf_layer: str = "model.layers.{i}.",
              zoo_layer: str = "layers.{i}.") -> list:
    """The weight-name rules of the MTP modules, derived from a format's own per-layer ``rules``:
    depth d's block under the names a main layer uses (``hf_layer`` moved to ``layout.block``),
    beside its enorm, hnorm, eh_proj and head norm (and, in DeepSeek's layout, the copies of the
    embedding, ``embed_tokens``, and of the head, ``shared_head.head``).

    Returns the rules to put *before* the format's own (so that on loading, the main embedding and
    head, read after their copies, are the ones kept). Empty when the spec has no MTP.
    """
    from zoo.checkpoints.maps import Rule, Transform, rule

    # The stored copies of the embedding and head: written as copies of their own (safetensors
    # refuses two names over one storage).
    copy = Transform("copy", lambda ts, h: list(ts), lambda ts, h: [t.clone() for t in ts])
    if spec.mtp is None:
        return []
    out: list[Rule] = []
    for d in range(spec.mtp.depth):
        hf = layout.block.format(n=spec.n_layers + d, d=d)
        z = f"mtp.layers.{d}."
        out += [rule(getattr(layout, name).format(block=hf, d=d), f"{z}{name}.weight")
                for name in ("enorm", "hnorm", "eh_proj", "norm")]
        if layout.copies:
            out += [rule(f"{hf}embed_tokens.weight", "embed.weight", copy),
                    rule(f"{hf}shared_head.head.weight", "embed.weight" if spec.head.tied else "lm_head.weight", copy)]
        for r in rules:
            if not r.per_layer or not all(n.startswith(zoo_layer) for n in r.zoo):
                continue
            out.append(Rule(tuple(n.replace(hf_layer, hf) for n in r.hf),
                            tuple(n.replace(zoo_layer, f"{z}block.") for n in r.zoo), r.transform))
    return out


def read_mtp(f, key: str = "num_nextn_predict_layers") -> Optional[dict[str, Any]]:
    """The spec's ``mtp`` table from an HF config's count of MTP modules (``f`` a
    :class:`~zoo.checkpoints.format.Fields`), or None when it is absent or 0."""
    depth = f.get(key, 0)
    if depth < 0:
        raise f.error(key, f"must be >= 0, got {depth}")
    return {"depth": depth} if depth else None


def without_absent_mtp(spec, fmt, names: set[str]):
    """``spec`` without its MTP modules when the checkpoint (tensor ``names``) holds none of their
    weights, as a checkpoint transformers wrote does (it drops them, keeping the config's count).
    A checkpoint that holds some of them must hold all: load_weights names the missing depth."""
    if spec.mtp is None:
        return spec
    own = {h for r in fmt.rules(spec) if any(z.startswith("mtp.layers.") for z in r.zoo) for h in r.hf}
    if own & names:
        return spec
    import dataclasses

    return dataclasses.replace(spec, mtp=None)


def missing_depth(bound: list, missing: list[str]) -> Optional[int]:
    """The first MTP depth (1-based) whose weights ``missing`` (HF names) holds, or None."""
    gone = set(missing)
    for b in bound:
        for h, z in zip(b.hf, b.zoo):
            if h in gone and z.startswith("mtp.layers."):
                return int(z.split(".")[2]) + 1
    return None


# -- self-speculative decoding ------------------------------------------------------------------

@dataclass
class SpeculationStats:
    """What speculative decoding did: drafts proposed, drafts the main model accepted, main forwards."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def check_speculative(model, state: DecodeState) -> None:
    """Refuse a model whose decode state cannot drop rejected drafts, naming the layer."""
    for i, s in enumerate(state.layers):
        if not callable(getattr(s, "truncate", None)):
            raise ValueError(
                f"speculative decoding: layer {i}'s decode state ({type(s).__name__}) has no truncate(n), so rejected "
                "draft tokens cannot be rolled back; see docs/plugins.md, 'A mixer with its own state'")


@torch.no_grad()
def speculative_generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask=None,
                         stops: list[int] = (), stats: Optional[SpeculationStats] = None, emit=None) -> torch.Tensor:
    """Greedy decoding with module 1 of the MTP drafting one token and the main model checking it.

    Each step feeds the main model the last committed token and the draft (two tokens, one forward):
    its prediction after the committed token is always kept; when it equals the draft, the draft is
    accepted and the prediction after it comes free. A rejected draft's slot is dropped from the
    decode state (``DecodeState.truncate``). The MTP state only ever sees committed tokens. The output
    is the main model's own greedy continuation.
    """
    if model.mtp is None:
        raise ValueError("speculative='mtp' needs a model with multi-token prediction modules (spec field mtp)")
    B, T = input_ids.shape
    if B != 1:
        raise ValueError(f"speculative='mtp' decodes one sequence at a time; got a batch of {B} (call it per row)")
    stats = stats if stats is not None else SpeculationStats()
    device = input_ids.device
    p = next(model.parameters())
    limit = T + max_new_tokens + 2
    state = model.new_state(1, limit)
    check_speculative(model, state)
    mstate = model.mtp.new_state(1, limit, dtype=p.dtype, device=p.device)
    stop_t = torch.tensor(list(stops), device=device) if stops else None

    def main(ids, mask=None, last=0):
        """Hidden states of ``ids`` and the greedy token after each (after the last ``last`` only)."""
        ctx = model.context(ids, mask, state=state)
        h = model.run_layers(ids, ctx)
        return h, model.logits_from_hidden(h[:, -last:]).argmax(-1)

    def draft(h, nxt_ids, mask=None):
        slots, key_mask, positions = mstate.advance(1, h.shape[1], device, mask)
        ctx = ForwardContext(position_ids=positions, slots=slots, key_mask=key_mask, state=mstate)
        out = model.mtp.run(model, 0, h, nxt_ids, ctx)
        return model.mtp.logits(model, 0, out[:, -1]).argmax(-1)

    produced: list[torch.Tensor] = []

    def commit(tokens) -> bool:
        """Append ``tokens`` ((1,) each) until the budget or a stop token; False when decoding ends."""
        for tok in tokens:
            produced.append(tok)
            if emit is not None:
                emit(tok)
            if len(produced) >= max_new_tokens or (stop_t is not None and bool(torch.isin(tok, stop_t))):
                return False
        return True

    if max_new_tokens == 0:
        return input_ids
    h, pred = main(input_ids, attention_mask, last=1)
    going = commit([pred[:, -1]])
    if going:
        d = draft(h, torch.cat([input_ids[:, 1:], pred[:, -1:]], dim=1), attention_mask)
    while going:
        h, pred = main(torch.stack([produced[-1], d], dim=1))
        stats.steps += 1
        stats.drafted += 1
        if bool(pred[0, 0] == d[0]):
            stats.accepted += 1
            going = commit([d, pred[:, 1]])
            if going:
                d = draft(h, pred[:, :2])
        else:
            state.truncate(state.seen - 1)
            going = commit([pred[:, 0]])
            if going:
                d = draft(h[:, :1], pred[:, :1])
    return torch.cat([input_ids, torch.stack(produced, dim=1)], dim=1)
