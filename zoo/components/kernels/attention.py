"""Attention on FlexAttention (``torch.nn.attention.flex_attention``) for what SDPA cannot do
fused: the attention's score hook (:class:`zoo.components.mixers.scores.Scores`): its
``score_mod`` (a soft-cap, a temperature) as FlexAttention's own, the causal sliding window and
chunks as a block-sparse ``mask_mod`` (with any ``mask_mod`` of the hook), a sink through the
log-sum-exp, with GQA (no repeated K/V). Same semantics as the eager reference in
``zoo/components/mixers/attention.py``; on CUDA the kernel is compiled once and reused.

Block masks are built from the slots' per-block bounds, never from a (Tq, Tk) mask: memory is
O(Tq Tk / 128^2), about 1 MiB of indices at 128k tokens where a dense mask is over 100 GiB.

- Without padding and without a cache (training, a plain prefill), the queries' own slots are the
  keys (``k_idx is q_idx``, consecutive by construction), so the mask depends only on
  (Tq, Tk, window, device): it is built once per shape and reused across layers and steps, and its
  ``mask_mod`` works on indices alone.
- With padding or cached keys it depends on the data: it is built once per forward and window
  (:func:`zoo.components.mixers._masks.per_forward`) and dropped with the forward's tensors.
"""

from collections import OrderedDict
from typing import Optional

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from zoo.components.mixers._masks import per_forward
from zoo.components.mixers.scores import chunk_index, chunk_offsets, same_chunk

BLOCK = 128  # FlexAttention's default block size, both ways
_compiled = None
_by_shape: "OrderedDict[tuple, BlockMask]" = OrderedDict()  # (Tq, window, chunk, mask_mod, device) -> mask
builds = 0  # block masks built so far in this process (the tests count rebuilds with it)


def _flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def _kernel(device: torch.device):
    """Compiled FlexAttention on CUDA (fused; no (Tq, Tk) scores); eager elsewhere, where it is
    only chosen when forced and the tests' tiny shapes do not repay compiling. Inside a compiled
    model the outer compile fuses it."""
    if torch.compiler.is_compiling() or device.type != "cuda":
        return flex_attention
    return _flex()


def _bounds(idx: torch.Tensor):
    """Smallest and largest slot in each block of ``BLOCK`` positions (the last one may be short)."""
    pad = -len(idx) % BLOCK
    if pad:
        idx = torch.cat([idx, idx[-1:].expand(pad)])  # a repeated slot changes neither bound
    blocks = idx.view(-1, BLOCK)
    return blocks.amin(-1), blocks.amax(-1)


def _sees(q, k, window: Optional[int]):
    ok = k <= q
    if window is not None:
        ok = ok & (q - k < window)
    return ok


def _nothing_visible(q_idx, k_idx, window, key_mask):
    """(B, Tq): queries that see no real key (padding queries; they then see every key, as in the
    reference). Counted with a prefix sum over keys sorted by slot, without a (Tq, Tk) mask."""
    order = torch.argsort(k_idx)
    slots = k_idx[order].contiguous()
    real = key_mask[:, order].to(torch.int32).cumsum(-1)
    real = torch.cat([real.new_zeros(real.shape[0], 1), real], dim=-1)  # real[:, j]: real keys among the first j
    upto = torch.searchsorted(slots, q_idx.contiguous(), right=True)  # keys with slot <= q
    before = torch.searchsorted(slots, (q_idx - window).contiguous(), right=True) if window is not None \
        else torch.zeros_like(upto)  # keys with slot <= q - window: out of the window
    B = key_mask.shape[0]
    return real.gather(1, upto.expand(B, -1)) == real.gather(1, before.expand(B, -1))


def _ordered(blocks: torch.Tensor):
    """(B, H, nQ, nK) booleans -> per row the count of true blocks and their indices, first."""
    count = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, indices


def build_block_mask(q_idx, k_idx, window: Optional[int], key_mask=None, mask_mod=None, documents=None, *,
                     chunk: Optional[int] = None, extra=None) -> BlockMask:
    """The block mask of ``causal_mask(q_idx, k_idx, window, key_mask, documents, chunk=, mask_mod=extra)``
    with ``mask_mod`` (by default one reading the slot tensors), from per-block slot bounds: a block is
    skipped when no query of it can see a key of it, and full (no mask_mod applied) when every query
    sees every key (never, with an ``extra`` mask_mod of the score hook: it is applied everywhere).
    With packed ``documents`` (B, T), per-block bounds of the document numbers do the same: a block
    whose queries' and keys' documents cannot meet is skipped, one of a single document may be full."""
    global builds
    builds += 1
    Tq, Tk = len(q_idx), len(k_idx)
    q_lo, q_hi = _bounds(q_idx)
    k_lo, k_hi = _bounds(k_idx)
    some = _sees(q_hi[:, None], k_lo[None, :], None)  # the latest query sees the earliest key
    some = some & ((q_lo[:, None] - k_hi[None, :] < window) if window is not None else True)
    every = _sees(q_lo[:, None], k_hi[None, :], None)
    every = every & ((q_hi[:, None] - k_lo[None, :] < window) if window is not None else True)
    # A block cut short by the end of the sequence is never full (as create_block_mask has it).
    whole = lambda n, length: (torch.arange(1, n + 1, device=q_idx.device) * BLOCK <= length)  # noqa: E731
    every = every & whole(len(q_lo), Tq)[:, None] & whole(len(k_lo), Tk)[None, :]
    some, every = some[None, None], every[None, None]  # (1, 1, nQ, nK)
    offsets = chunk_offsets(k_idx, key_mask) if chunk is not None else None
    if chunk is not None:  # per row when padding moves the chunks' start
        off = offsets.view(-1, 1, 1, 1) if offsets is not None else None
        cq_lo, cq_hi = (chunk_index(b.view(1, 1, -1, 1), chunk, off) for b in (q_lo, q_hi))
        ck_lo, ck_hi = (chunk_index(b.view(1, 1, 1, -1), chunk, off) for b in (k_lo, k_hi))
        some = some & (ck_hi >= cq_lo) & (ck_lo <= cq_hi)
        every = every & (cq_lo == cq_hi) & (ck_lo == ck_hi) & (cq_lo == ck_lo)
    if extra is not None:
        every = torch.zeros_like(every)
    blind = None
    if key_mask is not None:
        key_mask = key_mask.bool()
        blind = _nothing_visible(q_idx, k_idx, window, key_mask)  # (B, Tq)
        pad = -Tk % BLOCK
        real = torch.nn.functional.pad(key_mask, (0, pad), value=False).view(key_mask.shape[0], -1, BLOCK)
        any_real, all_real = real.any(-1), torch.nn.functional.pad(key_mask, (0, pad), value=True).view(
            key_mask.shape[0], -1, BLOCK).all(-1)
        any_blind = torch.nn.functional.pad(blind, (0, -Tq % BLOCK), value=False).view(blind.shape[0], -1, BLOCK).any(-1)
        some = (some & any_real[:, None, None, :]) | any_blind[:, None, :, None]
        every = every & all_real[:, None, None, :]
    if documents is not None:
        lo, hi = _row_bounds(documents)  # (B, n blocks)
        some = some & ((lo[:, None, :, None] <= hi[:, None, None, :]) & (lo[:, None, None, :] <= hi[:, None, :, None]))
        single = lo == hi
        every = every & (single[:, None, :, None] & single[:, None, None, :] & (lo[:, None, :, None] == lo[:, None, None, :]))
    if mask_mod is None:
        mask_mod = _slots_mask_mod(q_idx, k_idx, window, key_mask, blind, chunk, offsets, extra)
    if documents is not None:
        inner = mask_mod

        def mask_mod(b, h, qi, ki):
            return inner(b, h, qi, ki) & (documents[b, qi] == documents[b, ki])
    partial = some & ~every
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(every), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(Tq, Tk))


def _row_bounds(documents: torch.Tensor):
    """Smallest and largest document number in each block of ``BLOCK`` tokens of each row."""
    pad = -documents.shape[-1] % BLOCK
    if pad:
        documents = torch.cat([documents, documents[:, -1:].expand(-1, pad)], -1)
    blocks = documents.view(documents.shape[0], -1, BLOCK)
    return blocks.amin(-1), blocks.amax(-1)


def _rules(window, chunk, extra, offsets=None):
    """``sees(b, h, q, k)`` on slots: causal, the window, one chunk, the hook's own mask_mod."""
    def sees(b, h, q, k):
        ok = _sees(q, k, window)
        if chunk is not None:
            ok = ok & same_chunk(q, k, chunk, offsets[b] if offsets is not None else None)
        if extra is not None:
            ok = ok & extra(b, h, q, k)
        return ok
    return sees


def _slots_mask_mod(q_idx, k_idx, window, key_mask, blind, chunk=None, offsets=None, extra=None):
    """The mask read from the slot tensors (and the key mask, with its rule for blind queries)."""
    sees = _rules(window, chunk, extra, offsets)
    if key_mask is None:
        def mask_mod(b, h, qi, ki):
            return sees(b, h, q_idx[qi], k_idx[ki])
    else:
        def mask_mod(b, h, qi, ki):
            return (sees(b, h, q_idx[qi], k_idx[ki]) & key_mask[b, ki]) | blind[b, qi]
    return mask_mod


def _own_slots_mask_mod(window: Optional[int], chunk: Optional[int] = None, extra=None):
    """The mask on a sequence's own consecutive slots (0, 1, ...): it reads nothing but the indices."""
    sees = _rules(window, chunk, extra)

    def mask_mod(b, h, qi, ki):
        return sees(b, h, qi, ki)
    return mask_mod


def block_mask(q_idx, k_idx, window: Optional[int], key_mask=None, documents=None, *, chunk: Optional[int] = None,
               mask_mod=None) -> BlockMask:
    """The block mask for queries at slots ``q_idx`` and keys at ``k_idx`` (``key_mask`` (B, Tk)
    marks real keys, ``None`` without padding; ``documents`` (B, T): packed documents), with a score
    hook's ``chunk`` and ``mask_mod``, from a cache when it has been built before (keyed on the
    ``mask_mod`` object)."""
    hook = {"chunk": chunk, "extra": mask_mod}
    if torch.compiler.is_compiling():  # traced: the compiler fuses the build; no Python caches
        return build_block_mask(q_idx, k_idx, window, key_mask, documents=documents, **hook)
    if documents is not None:  # data: once per forward, shared by the layers
        return per_forward((q_idx, k_idx, key_mask, documents), ("flex-documents", window, chunk, mask_mod),
                           lambda: build_block_mask(q_idx.clone(), k_idx.clone(), window,
                                                    key_mask.clone() if key_mask is not None else None,
                                                    documents=documents.clone(), **hook))
    if key_mask is None and k_idx is q_idx:
        key = (len(q_idx), window, chunk, mask_mod, q_idx.device)
        hit = _by_shape.get(key)
        if hit is None:
            own = torch.arange(len(q_idx), device=q_idx.device)
            hit = _by_shape[key] = build_block_mask(own, own, window, mask_mod=_own_slots_mask_mod(window, chunk, mask_mod),
                                                    **hook)
            while len(_by_shape) > 16:
                _by_shape.popitem(last=False)
        _by_shape.move_to_end(key)
        return hit
    # The mask's mask_mod reads copies: holding the forward's own tensors would keep them, and the
    # entry keyed on them, alive for good.
    def build():
        return build_block_mask(q_idx.clone(), k_idx.clone(), window, key_mask.clone() if key_mask is not None else None,
                                **hook)

    return per_forward((q_idx, k_idx, key_mask), ("flex", window, chunk, mask_mod), build)


def flex_attend(module, q, k, v, q_idx, k_idx, key_mask=None, bias=None, documents=None):
    """``Attention.attend`` on FlexAttention: (B, H, Tq, D) x (B, Hkv, Tk, D) -> (B, H, Tq, D), with
    the module's score hook (``module.scores()``; its query scale was applied by the forward)."""
    if bias is not None or (module.training and module.dropout):
        # Score biases and attention dropout stay on the reference path.
        return module._eager(q, k, v, q_idx, k_idx, key_mask, bias, documents)
    s = module.scores()
    mask = block_mask(q_idx, k_idx, s.window, key_mask, documents, chunk=s.chunk, mask_mod=s.mask_mod)
    score_mod = None
    if s.score_mod is not None:
        user = s.score_mod

        def score_mod(score, b, h, qi, ki):  # the hook's score_mod reads slots, FlexAttention gives indices
            return user(score, b, h, q_idx[qi], k_idx[ki])
    run = _kernel(q.device)
    gqa = module.n_kv_heads != module.n_heads
    if s.sink is None:
        return run(q, k, v, score_mod=score_mod, block_mask=mask, scale=module.scale, enable_gqa=gqa)
    # softmax with exp(sink) in the denominator: out * Z / (Z + exp(sink)) = out * sigmoid(lse - sink)
    out, aux = run(q, k, v, score_mod=score_mod, block_mask=mask, scale=module.scale, enable_gqa=gqa,
                   return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - s.sink.float().view(1, -1, 1))
    return (out * keep.unsqueeze(-1)).to(out.dtype)
