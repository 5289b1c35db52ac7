"""An opt-in compiled decode path: a static decode state and one ``torch.compile``d single-token step.

The prompt is prefilled eagerly into the model's ordinary decode state (``model.new_state``), then
``DecodeState.to_static`` copies it into fixed-size buffers (each layer state's own ``to_static``:
attention's preallocated keys and values, a recurrent mixer's fixed state) with the key padding
mask preallocated too. Each decode step has the same shapes and no data-dependent Python branch
(the slot and the positions are tensors; the mask is always built from fixed-size tensors), so the
one compiled step is reused for every token. This module knows nothing of what a layer's state
holds.
"""

from __future__ import annotations

import torch

from zoo.core.context import ForwardContext

_STEP = None  # the compiled step, made on first use (importing the compiler costs seconds)
ROUND = 64  # max_len is rounded up to a multiple of this, so nearby lengths share one compilation


def _step(model, state, ids, slots, position_ids):
    ctx = ForwardContext(position_ids=position_ids, slots=slots, key_mask=state.key_mask, state=state)
    return model.logits_from_hidden(model.run_layers(ids, ctx)[:, -1])


def compiled_step():
    """The single-token decode step, compiled once per process (recompiled for a new model or shape)."""
    global _STEP
    if _STEP is None:
        _STEP = torch.compile(_step, dynamic=False)
    return _STEP


class CompiledDecoder:
    """``decoder(step_ids, attention_mask) -> (B, vocab)`` logits of the last position: the first
    call prefills eagerly, every later (one-token) call runs the compiled step."""

    def __init__(self, model, prompt_len: int, max_new_tokens: int):
        self.model = model
        self.max_len = -(-(prompt_len + max_new_tokens) // ROUND) * ROUND
        self.state = None

    def __call__(self, ids, attention_mask=None):
        if self.state is None:
            prefill = self.model.new_state(ids.shape[0], ids.shape[1])
            hidden = self.model.hidden_states(ids, attention_mask=attention_mask, state=prefill)
            self.state = prefill.to_static(self.max_len)
            return self.model.logits_from_hidden(hidden[:, -1])
        slots, _, position_ids = self.state.advance(ids.shape[0], 1, ids.device)
        return compiled_step()(self.model, self.state, ids, slots, position_ids)
