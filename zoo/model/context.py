"""What a forward runs in: the forward context of a batch of tokens, and the model's decode state.

:func:`for_tokens` is the one place a :class:`~zoo.core.context.ForwardContext` is laid out for new
tokens (after what a decode state has seen, or from the start): the model's forward, the MTP modules'
loss and speculative drafting all take it from here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from zoo.core import kinds as _kinds
from zoo.core.context import ForwardContext, document_positions
from zoo.core.state import DecodeState, step_layout


def for_tokens(batch: int, length: int, device, attention_mask: Optional[torch.Tensor] = None, *,
               state: Optional[DecodeState] = None, position_ids: Optional[torch.Tensor] = None) -> ForwardContext:
    """The forward context of ``length`` new tokens in each of ``batch`` rows: slots, padding mask and
    position ids, after what ``state`` has seen (moving ``state`` on), or from the start without one."""
    if state is not None:
        slots, key_mask, positions = state.advance(batch, length, device, attention_mask)
    else:
        slots, key_mask, positions = step_layout(batch, length, device, attention_mask)
    return ForwardContext(position_ids=positions if position_ids is None else position_ids, slots=slots,
                          key_mask=key_mask, state=state)


def context(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
            position_ids: Optional[torch.Tensor] = None, state: Optional[DecodeState] = None,
            document_ids: Optional[torch.Tensor] = None) -> ForwardContext:
    """The forward context of ``input_ids`` (B, T) in ``model``: slots, padding mask and position ids,
    after what ``state`` has seen (and moving ``state`` on). ``document_ids`` (B, T) numbers the packed
    documents of each row (non-decreasing along it): positions restart at each document
    (:func:`~zoo.core.context.document_positions`), and every mixer keeps each document to itself."""
    B, T = input_ids.shape
    tp = getattr(model, "_tp", 1)
    if T % tp:
        raise ValueError(f"input_ids: {T} tokens do not split over tp = {tp} processes (sequence parallelism "
                         f"gives each an equal slice); use a length divisible by {tp}")
    if document_ids is not None:
        _check_documents(model, document_ids, B, T, state, attention_mask)
        position_ids = document_positions(document_ids) if position_ids is None else position_ids
    ctx = for_tokens(B, T, input_ids.device, attention_mask, state=state, position_ids=position_ids)
    ctx.documents = document_ids
    ctx.n_layers = len(model.layers)
    return ctx


def _check_documents(model: nn.Module, documents: torch.Tensor, B: int, T: int, state, attention_mask) -> None:
    if tuple(documents.shape) != (B, T):
        raise ValueError(f"document_ids has shape {tuple(documents.shape)}; expected (batch, seq) = {(B, T)}")
    if state is not None or attention_mask is not None:
        raise ValueError("document_ids: packed documents are a training forward over whole sequences; pass no "
                         "decode state or attention_mask with them (padding is a document of its own)")
    if model.mtp is not None:
        raise ValueError("document_ids: the multi-token prediction modules do not keep packed documents apart; "
                         "train this model with packing = 'plain'")
    for i, layer in enumerate(model.layers):
        if not _kinds.mixer_of(layer).documents:
            raise ValueError(f"document_ids: layer {i}'s mixer {model.spec.layer(i).mixer.name!r} does not keep "
                             "packed documents apart (it states no documents = True); train it with packing = "
                             "'plain'")


def new_state(model: nn.Module, batch: Optional[int], max_len: Optional[int] = None, *, dtype=None,
              device=None) -> DecodeState:
    """A decode state for ``batch`` rows of up to ``max_len`` tokens (None: unknown): each
    layer's mixer makes its own state. A model with a mixer that cannot decode is refused."""
    p = next(model.parameters())
    dtype, device = dtype or p.dtype, device or p.device
    layers = []
    for i, layer in enumerate(model.layers):
        mixer = _kinds.mixer_of(layer)
        state = _kinds.adapt_state(mixer.new_state(batch, max_len, dtype=dtype, device=device))
        if state is None:
            raise ValueError(
                f"layer {i}'s mixer {type(mixer).__name__} ({model.spec.layer(i).mixer.name!r}) keeps no decode state "
                "(it has no new_state, or it returned None), so this model cannot decode incrementally; "
                "see docs/guides/plugins.md, 'A mixer with its own state'")
        layers.append(state)
    return DecodeState(layers, batch=batch, max_len=max_len, device=device)
