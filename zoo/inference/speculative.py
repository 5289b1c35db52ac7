"""Self-speculative decoding with a model's own MTP modules as the draft."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
import torch
from zoo.core import kinds
from zoo.core.state import DecodeState
from zoo.model.context import for_tokens


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
        if not kinds.implements(s, "truncate"):
            raise ValueError(
                f"speculative decoding: layer {i}'s decode state ({type(s).__name__}) has no truncate(n), so rejected "
                "draft tokens cannot be rolled back; see docs/guides/plugins.md, 'A mixer with its own state'")


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
        ctx = for_tokens(1, h.shape[1], device, mask, state=mstate)
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
