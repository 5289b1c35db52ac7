"""Sequences from prepared corpora (:mod:`zoo.training.shards`): packing, supervised groups, mixtures.

A source's samples are numbered ``0 .. n - 1``; sample ``i`` of the endless training stream is a pure
function of the seed and ``i`` (each epoch a fresh permutation, a keyed Feistel bijection computed
per index, so nothing the size of the corpus is held). The training loop asks for the samples
``position + rank * per_rank ..`` of the global stream, so data-parallel ranks read disjoint samples
that together cover each epoch once, and a run resumed at any sample count, on any number of
processes, reads exactly what an uninterrupted run reads.

How a sample is made (``packing``):

- pre-training text: sample ``i`` is tokens ``i * seq_len .. (i + 1) * seq_len`` of the corpus
  (documents joined, each ended by EOS). With ``packing = "documents"`` (the default) each token
  carries its document's number: the model restarts positions there, keeps attention inside each
  document and resets recurrent state; the first token of a document is not a target of the one
  before. ``packing = "plain"`` packs without masks, as zoo did before prepared data;
- supervised data (``sft``): whole conversations, grouped in corpus order as many as fit in
  ``seq_len``, the rest of the sequence padding (no loss); the loss counts only the assistant's
  tokens (the completion's, for prompt/completion pairs). A conversation longer than ``seq_len`` is an
  error that names its file and line (``zoo data prepare --max-tokens`` leaves such records out).

A weighted mixture gives each source a share of every round of :data:`ROUND` samples (weights
rounded to 1 / ROUND), in an order permuted per round; each source then runs through its own epochs.

Validation: ``val_fraction`` holds out the last samples of each source (never trained on), or a
separate prepared corpus is the validation set; it is read in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from zoo.training.shards import DataError, Prepared

ROUND = 1000
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key(*parts: int) -> int:
    """A 64-bit key from integers (seed, source, epoch ...)."""
    h = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
    for p in parts:
        h = _mix(h ^ np.array([int(p) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return int(h[0])


def permute(i: np.ndarray, n: int, k: int) -> np.ndarray:
    """A bijection of ``0 .. n - 1`` keyed by ``k``, at the indices ``i``: a 4-round Feistel network
    on the next even power of two, cycle-walked back into range. O(1) memory whatever ``n``."""
    if n <= 1:
        return np.zeros_like(np.asarray(i, dtype=np.int64))
    half = max(1, math.ceil(math.log2(n) / 2))
    low = np.uint64((1 << half) - 1)
    keys = [np.uint64(key(k, r)) for r in range(4)]
    x = np.asarray(i, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            y = x[todo]
            left, right = y >> np.uint64(half), y & low
            for kr in keys:
                left, right = right, left ^ (_mix(right ^ kr) & low)
            y = (left << np.uint64(half)) | right
            x[todo] = y
            todo[todo] = y >= np.uint64(n)
    return x.astype(np.int64)


@dataclass
class Batch:
    """Rows of token ids, their targets (-100: no loss) and document numbers (None: one stream)."""

    ids: torch.Tensor
    labels: torch.Tensor
    documents: Optional[torch.Tensor] = None

    def rows(self, a: int, b: int, device=None) -> "Batch":
        pick = lambda t: None if t is None else t[a:b].to(device)  # noqa: E731
        return Batch(pick(self.ids), pick(self.labels), pick(self.documents))


class Source:
    """The samples of one prepared corpus, for one split (``train`` or ``val``)."""

    def __init__(self, corpus: Prepared, seq_len: int, *, packing: str = "documents", sft: bool = False,
                 val_fraction: float = 0.0, split: str = "train", pad_id: int = 0):
        if packing not in ("documents", "plain"):
            raise ValueError(f"packing must be 'documents' or 'plain', got {packing!r}")
        self.corpus, self.seq_len, self.packing, self.sft, self.pad_id = corpus, seq_len, packing, sft, pad_id
        if sft and not corpus.masked:
            raise DataError(f"{corpus.path}: sft needs chat (messages) or prompt/completion records, but this corpus "
                            "holds plain texts (no loss mask); prepare a chat set, or train without sft")
        if sft:
            lengths = corpus.document_lengths()
            long = np.flatnonzero(lengths > seq_len)
            if len(long):
                d = int(long[0])
                raise DataError(f"{corpus.origin(d)}: a record of {int(lengths[d])} tokens, longer than seq_len "
                                f"{seq_len} ({len(long)} such); raise seq_len, or prepare with --max-tokens {seq_len} "
                                "to leave such records out")
            self.groups = _groups(lengths, seq_len)
            total = len(self.groups) - 1
        else:
            total = corpus.n_tokens // seq_len
        n_val = math.ceil(val_fraction * total) if val_fraction > 0 else 0
        if split == "val":
            self.first, self.n = total - n_val, n_val
        else:
            self.first, self.n = 0, total - n_val
        if self.n < 1:
            what = "conversations" if sft else f"sequences of seq_len={seq_len}"
            raise DataError(f"{corpus.path}: {total} {what}, leaving {self.n} for {split}"
                            f"{f' after holding out {n_val} for validation' if n_val else ''}; give more data, a "
                            "shorter seq_len or a smaller validation fraction")

    def sample(self, j: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Sample ``j`` of this split, in corpus order: ids, labels, document numbers (None: plain)."""
        j = self.first + j
        L = self.seq_len
        if self.sft:
            a, b = int(self.groups[j]), int(self.groups[j + 1])
            ids, docs, masks = [], [], []
            for n, d in enumerate(range(a, b)):
                t = self.corpus.document(d)
                ids.append(t), masks.append(self.corpus.document_mask(d)), docs.append(np.full(len(t), n))
            ids, docs, mask = np.concatenate(ids), np.concatenate(docs), np.concatenate(masks)
            pad = L - len(ids)
            ids = np.concatenate([ids.astype(np.int64), np.full(pad, self.pad_id, dtype=np.int64)])
            docs = np.concatenate([docs, np.full(pad, b - a)])
            mask = np.concatenate([mask, np.zeros(pad, dtype=mask.dtype)])
        else:
            ids, docs, mask = self.corpus.span(j * L, (j + 1) * L)
            ids, docs = ids.astype(np.int64), docs - docs[0]
        labels = ids.copy()
        if mask is not None:
            labels[mask == 0] = -100
        if self.packing == "documents":
            labels[1:][docs[1:] != docs[:-1]] = -100  # a document's first token is not the last one's target
            return ids, labels, docs
        return ids, labels, None


def _groups(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Starts of the groups of consecutive documents that fit in ``seq_len`` (greedy, in order), and the end."""
    starts, used = [0], 0
    for d, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            starts.append(d)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def _stack(samples) -> Batch:
    ids = torch.from_numpy(np.stack([s[0] for s in samples]))
    labels = torch.from_numpy(np.stack([s[1] for s in samples]))
    docs = None if samples[0][2] is None else torch.from_numpy(np.stack([s[2] for s in samples]).astype(np.int32))
    return Batch(ids, labels, docs)


class Mixture:
    """Sources mixed by weight into one endless, shuffled stream (see the module's text)."""

    def __init__(self, sources: Sequence[Source], weights: Sequence[float], seed: int = 0):
        if len(sources) != len(weights) or not sources:
            raise ValueError("a mixture needs one weight per source")
        for w in weights:
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
                raise ValueError(f"data weights must be positive numbers, got {list(weights)}")
        self.sources, self.seed = list(sources), seed
        total = float(sum(weights))
        raw = [w / total * ROUND for w in weights]
        counts = [max(1, int(r)) for r in raw]
        for k in sorted(range(len(raw)), key=lambda k: raw[k] - int(raw[k]), reverse=True):  # largest remainder
            if sum(counts) >= ROUND:
                break
            counts[k] += 1
        while sum(counts) > ROUND:
            counts[counts.index(max(counts))] -= 1
        self.counts = np.asarray(counts, dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(self.counts)])
        self.n_samples = sum(s.n for s in self.sources)  # one epoch of every source, for reports

    def locate(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (source, index within that source's endless stream) of global samples ``i``."""
        if len(self.sources) == 1:
            return np.zeros_like(i), i
        rounds, offset = np.divmod(i, ROUND)
        slot = np.empty_like(i)
        for r in np.unique(rounds):
            at = rounds == r
            slot[at] = permute(offset[at], ROUND, key(self.seed, -1, int(r)))
        src = np.searchsorted(self.cum, slot, side="right") - 1
        return src, rounds * self.counts[src] + slot - self.cum[src]

    def batch(self, start: int, count: int) -> Batch:
        """Samples ``start .. start + count`` of the stream."""
        i = np.arange(start, start + count, dtype=np.int64)
        src, j = self.locate(i)
        samples = []
        for s, jj in zip(src.tolist(), j.tolist()):
            source = self.sources[s]
            epoch, within = divmod(jj, source.n)
            samples.append(source.sample(int(permute(np.array([within]), source.n, key(self.seed, s, epoch))[0])))
        return _stack(samples)


class Ordered:
    """The samples of sources one after another, in order (a validation set)."""

    def __init__(self, sources: Sequence[Source]):
        self.sources = list(sources)
        self.n_samples = sum(s.n for s in self.sources)

    def batch(self, start: int, count: int) -> Batch:
        out = []
        for i in range(start, min(start + count, self.n_samples)):
            for s in self.sources:
                if i < s.n:
                    out.append(s.sample(i))
                    break
                i -= s.n
        return _stack(out)


def open_sources(entries: Sequence[dict], tokenizer, seq_len: int, *, packing: str, sft: bool, seed: int,
                 val_fraction: float = 0.0, split: str = "train", pad_id: int = 0):
    """The train stream (a :class:`Mixture`) or validation set (:class:`Ordered`) of prepared corpora
    given as ``[{path, weight}]``, each checked against the run's tokenizer."""
    sources, weights = [], []
    for e in entries:
        corpus = Prepared(Path(e["path"]), tokenizer)
        sources.append(Source(corpus, seq_len, packing=packing, sft=sft, val_fraction=val_fraction, split=split,
                              pad_id=pad_id))
        weights.append(e.get("weight", 1.0))
    return Mixture(sources, weights, seed) if split == "train" else Ordered(sources)
