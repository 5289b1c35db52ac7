"""Decode state: what incremental decoding keeps between steps.

A :class:`DecodeState` holds one state per layer, each made by that layer's mixer
(``mixer.new_state(...)``) and opaque to everything else, plus what every layer shares: the number
of slots seen so far (``seen``, left padding included) and the padding mask of those slots
(``key_mask``, None when there is no padding). ``generate``, the compiled decode and ``verify``
use only this object.

Attention's state is :class:`KVState`: keys and values stored as (batch, kv_heads, capacity,
head_dim), sized by the number of *kv* heads, so GQA and MQA really store fewer bytes. A layer with
a sliding window keeps a ring buffer of ``window`` slots (slot ``s`` lives at ``s % window``): its
memory is bounded however long the sequence grows. A layer without one stores every slot in place,
in a buffer that grows by doubling (or is sized once from ``max_len``), so a decode step copies
nothing. :meth:`KVState.to_static` copies it into a :class:`StaticKVState` of fixed size for the
compiled single-token step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zoo.core.kinds import LayerState, implements


def step_layout(B: int, T: int, device: Any, attention_mask: Optional[torch.Tensor] = None,
                past: int = 0, prev_mask: Optional[torch.Tensor] = None):
    """Slots, key padding mask and position ids of ``T`` new tokens after ``past`` slots.

    ``attention_mask`` covers the new tokens or all slots so far; ``prev_mask`` is the mask of the
    ``past`` slots (None: no padding there). Returns ``(slots, key_mask, position_ids)``, where
    ``key_mask`` is None when nothing is padding (the fast unmasked paths apply) and position ids
    skip padding.
    """
    slots = torch.arange(past, past + T, device=device)
    key_mask = None
    if attention_mask is not None:
        key_mask = attention_mask.to(device=device, dtype=torch.bool)
        if key_mask.shape[-1] == T and past:
            key_mask = torch.cat([prev_mask if prev_mask is not None else key_mask.new_ones(B, past), key_mask], dim=1)
        if key_mask.shape != (B, past + T):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, past + new) = {(B, past + T)}"
            )
    elif prev_mask is not None:
        key_mask = torch.cat([prev_mask, prev_mask.new_ones(B, T)], dim=1)
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    if key_mask is not None:
        position_ids = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    else:
        position_ids = slots.unsqueeze(0).expand(B, T)
    return slots, key_mask, position_ids


class DecodeState:
    """The decode state of a whole model: one opaque state per layer, plus ``seen`` and ``key_mask``.

    Made by ``model.new_state(batch, max_len)``. :meth:`advance` is called once per forward with
    the new tokens; :meth:`to_static` gives the fixed-size copy that compiled decoding updates.
    """

    def __init__(self, layers: list[Any], *, batch: Optional[int] = None, max_len: Optional[int] = None,
                 device: Any = None):
        self.layers = list(layers)
        self.batch = batch
        self.max_len = max_len
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seen = 0  # slots so far (0 .. seen-1), left padding included
        self.key_mask: Optional[torch.Tensor] = None  # (B, seen) real tokens; None: no padding
        self.static = False
        self._position: Optional[torch.Tensor] = None  # (B, 1) next position id, static states only

    def advance(self, B: int, T: int, device: Any, attention_mask: Optional[torch.Tensor] = None):
        """Account for ``T`` new tokens: returns their ``(slots, key_mask, position_ids)`` and
        moves ``seen`` on. A static state takes one token at a time, with no mask."""
        if self.batch is None:
            self.batch = B
        if B != self.batch:
            raise ValueError(f"this decode state holds {self.batch} rows; got input of batch {B}")
        if self.static:
            if T != 1 or attention_mask is not None:
                raise ValueError("a static decode state takes one token per step and no attention_mask")
            if self.seen >= self.max_len:
                raise ValueError(f"the static decode state holds {self.max_len} slots; it is full")
            slots = torch.tensor([self.seen], device=device)
            position_ids = self._position
            self.seen += 1
            self._position = self._position + 1
            return slots, self.key_mask, position_ids
        slots, key_mask, position_ids = step_layout(B, T, device, attention_mask, self.seen, self.key_mask)
        self.key_mask, self.seen = key_mask, self.seen + T
        return slots, key_mask, position_ids

    def to_static(self, max_len: int) -> "DecodeState":
        """A copy whose every layer state has fixed-size buffers for ``max_len`` slots, for compiled
        single-token steps. Needs each layer state to provide ``to_static``."""
        if max_len < self.seen:
            raise ValueError(f"max_len {max_len} is shorter than the {self.seen} slots already seen")
        layers = []
        for i, s in enumerate(self.layers):
            if not implements(s, "to_static"):
                raise TypeError(f"layer {i}'s decode state ({type(s).__name__}) has no to_static(max_len): "
                                "its mixer cannot decode with a compiled step")
            layers.append(s.to_static(max_len))
        static = DecodeState(layers, batch=self.batch, max_len=max_len, device=self.device)
        static.static, static.seen = True, self.seen
        device = self.device
        static.key_mask = torch.ones(self.batch, max_len, dtype=torch.bool, device=device)
        if self.key_mask is not None:
            static.key_mask[:, : self.seen] = self.key_mask
            real = self.key_mask.sum(-1)
        else:
            real = torch.full((self.batch,), self.seen, device=device)
        static._position = real.to(device)[:, None]
        return static

    def truncate(self, n: int) -> None:
        """Forget the slots from ``n`` on (speculative decoding drops rejected draft tokens): every
        layer state must provide the optional ``truncate(n)`` (see :class:`zoo.core.kinds.LayerState`)."""
        if not 0 <= n <= self.seen:
            raise ValueError(f"cannot truncate a decode state of {self.seen} slots to {n}")
        for i, s in enumerate(self.layers):
            if not implements(s, "truncate"):
                raise TypeError(f"layer {i}'s decode state ({type(s).__name__}) has no truncate(n): its mixer cannot "
                                "drop slots it has seen")
            s.truncate(n)
        self.seen = n
        if self.key_mask is not None:
            self.key_mask = self.key_mask[:, :n]

    def nbytes(self) -> int:
        """Bytes held by every layer's state (what the accounting's figures predict)."""
        return sum(s.nbytes() for s in self.layers if s is not None)


class KVState(LayerState):
    """One attention layer's keys and values, with the absolute slot of each entry.

    ``update(k, v, slots) -> (k_all, v_all, slots_all)`` stores (B, Hkv, T, D) keys and values and
    returns every key the layer's new queries may need, with its slot (ring buffers return them out
    of order; masks are computed from slots, so order does not matter). Buffers are allocated by the
    first update, in the keys' own dtype and device.
    """

    def __init__(self, window: Optional[int] = None, max_len: Optional[int] = None):
        self.window = window
        self.max_len = max_len
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.idx: Optional[torch.Tensor] = None
        self.filled = 0  # entries in use (a ring, once full, stays full)
        self._undo = None  # a ring's entries the last multi-token write replaced (for truncate)

    def _allocate(self, k: torch.Tensor, v: torch.Tensor, capacity: int) -> None:
        B, H, _, D = k.shape
        old = (self.k, self.v, self.idx)
        self.k = k.new_empty(B, H, capacity, D)
        self.v = v.new_empty(B, H, capacity, v.shape[-1])
        self.idx = torch.full((capacity,), -1, dtype=torch.long, device=k.device)
        if old[0] is not None:
            n = self.filled
            self.k[:, :, :n] = old[0][:, :, :n]
            self.v[:, :, :n] = old[1][:, :, :n]
            self.idx[:n] = old[2][:n]

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        window = self.window
        if window is None:
            end = int(slots[-1]) + 1
            if self.k is None:
                self._allocate(k, v, max(end, self.max_len or 0))
            elif end > self.k.shape[2]:
                self._allocate(k, v, max(end, 2 * self.k.shape[2]))
            start = int(slots[0])
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            self.idx[start:end] = slots
            self.filled = end
            return self.k[:, :, :end], self.v[:, :, :end], self.idx[:end]
        if self.k is None:
            self._allocate(k, v, window)
        if k.shape[2] == 1:
            self._undo = None
            # Write, then read: the slot overwritten (s - window) is exactly the one that left the window.
            self._write(k, v, slots)
            n = self.filled
            return self.k[:, :, :n], self.v[:, :, :n], self.idx[:n]
        # Several new queries (prefill, possibly longer than the window): the earliest of them still
        # needs keys the write would overwrite, so read first.
        n = self.filled
        k_all = torch.cat([self.k[:, :, :n], k], dim=2)
        v_all = torch.cat([self.v[:, :, :n], v], dim=2)
        idx_all = torch.cat([self.idx[:n], slots])
        ring = slots[-min(k.shape[2], window):] % window
        self._undo = (ring, self.k[:, :, ring], self.v[:, :, ring], self.idx[ring], n)
        self._write(k, v, slots)
        return k_all, v_all, idx_all

    def truncate(self, n: int) -> None:
        """Forget slots ``n`` and later. A ring puts back the entries they replaced, so it can drop
        only slots its last update wrote, and only when that update took several tokens."""
        if self.k is None or self.window is None:
            self.filled = min(self.filled, n)
            return
        gone = self.idx >= n
        if not bool(gone.any()):
            return
        ring, k, v, idx, filled = self._undo if self._undo is not None else (gone.new_zeros(0, dtype=torch.long),) * 5
        if int(gone.sum()) != int((self.idx[ring] >= n).sum()):
            raise ValueError(f"this ring buffer cannot drop slot {n} and later: only slots that its last update "
                             "wrote with several tokens at once can be dropped")
        back = self.idx[ring] >= n
        self.k[:, :, ring[back]] = k[:, :, back]
        self.v[:, :, ring[back]] = v[:, :, back]
        self.idx[ring[back]] = idx[back]
        self.filled = min(self.filled, max(n, filled))
        self._undo = None

    def _write(self, k, v, slots) -> None:
        window = self.window
        keep = min(k.shape[2], window)
        ring = slots[-keep:] % window
        self.k[:, :, ring] = k[:, :, -keep:]
        self.v[:, :, ring] = v[:, :, -keep:]
        self.idx[ring] = slots[-keep:]
        self.filled = min(window, max(self.filled, int(slots[-1]) + 1))

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to_static(self, max_len: int) -> "StaticKVState":
        if self.k is None:
            raise ValueError("to_static needs a state that has been filled (prefill the prompt first)")
        B, H, _, D = self.k.shape
        static = StaticKVState(B, H, D, self.v.shape[-1], self.window, max_len, dtype=self.k.dtype, device=self.k.device)
        n = self.filled
        static.k[:, :, :n] = self.k[:, :, :n]
        static.v[:, :, :n] = self.v[:, :, :n]
        static.idx[:n] = self.idx[:n]
        return static


class StaticKVState(LayerState):
    """Fixed-size keys and values (B, kv_heads, capacity, D) for compiled one-token steps.

    A full-attention layer holds every slot up to ``max_len``, a sliding-window layer a ring of
    ``window`` slots. Unfilled slots are masked by the causal rule: a full buffer's slot ``s`` is
    labelled ``s`` (after the query), an empty ring slot ``-window`` (out of the window). An update
    has the same shapes every step and no data-dependent Python branch.
    """

    def __init__(self, batch: int, heads: int, k_dim: int, v_dim: int, window: Optional[int], max_len: int,
                 *, dtype: torch.dtype, device: Any):
        cap = min(window or max_len, max_len)
        self.k = torch.zeros(batch, heads, cap, k_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, heads, cap, v_dim, dtype=dtype, device=device)
        if cap == max_len:
            self.idx = torch.arange(cap, device=device)
        else:
            self.idx = torch.full((cap,), -window, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """Store one token's keys and values at slot ``slots % capacity``; return the whole buffers."""
        ring = slots % self.idx.shape[0]
        self.k.index_copy_(2, ring, k)
        self.v.index_copy_(2, ring, v)
        self.idx.index_copy_(0, ring, slots)
        return self.k, self.v, self.idx

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to_static(self, max_len: int) -> "StaticKVState":
        return self


class FixedState(LayerState):
    """A recurrent layer's decode state: named tensors of fixed shape whatever the length, made on
    the first forward when the batch is not known up front and updated in place (so the static state
    of compiled decoding is this object itself). ``FixedState(batch, device, S=((H, Dk, Dv),
    torch.float32))`` holds ``.S``; ``get(batch)`` returns the tensors in the order given."""

    def __init__(self, batch: Optional[int], device, **tensors: tuple[tuple[int, ...], torch.dtype]):
        self.specs, self.device = tensors, device
        for name in tensors:
            setattr(self, name, None)
        if batch is not None:
            self.get(batch)

    def get(self, batch: int) -> tuple[torch.Tensor, ...]:
        if getattr(self, next(iter(self.specs))) is None:
            for name, (shape, dtype) in self.specs.items():
                setattr(self, name, torch.zeros(batch, *shape, dtype=dtype, device=self.device))
        return tuple(getattr(self, name) for name in self.specs)

    def nbytes(self) -> int:
        tensors = [getattr(self, name) for name in self.specs]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to_static(self, max_len: int) -> "FixedState":
        return self  # already of fixed size, updated in place


class NoState(LayerState):
    """The decode state of a layer that mixes no tokens: it holds nothing and serves every decoding
    path (compiled steps, truncation)."""

    def nbytes(self) -> int:
        return 0

    def to_static(self, max_len: int) -> "NoState":
        return self

    def truncate(self, n: int) -> None:
        pass
