"""Training data: a tokenizer and a token stream cut into fixed-length sequences.

The offline default needs no download: the source of a fixed set of Python standard library
modules (text that ships with every Python), read as bytes, so the vocabulary is the 256 byte
values. The user's own text files are read with a checkpoint's ``tokenizer.json`` (through
``tokenizers``) or as bytes.

The order of sequences is a pure function of the seed and of how many sequences were consumed:
a run resumed at sample ``n`` sees exactly what an uninterrupted run saw after ``n`` samples.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from zoo.training.tokens import ByteTokenizer, get_tokenizer  # noqa: F401  (this module's names too)

#: Standard-library modules whose source makes the built-in corpus (about 0.6 MB of text).
STDLIB_MODULES = (
    "argparse", "bisect", "calendar", "contextlib", "dataclasses", "difflib", "enum", "fnmatch",
    "fractions", "functools", "glob", "heapq", "pprint", "random", "shlex", "statistics", "string",
    "textwrap",
)


def builtin_corpus() -> str:
    """The source text of :data:`STDLIB_MODULES`, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / f"{m}.py").read_text(encoding="utf-8") for m in STDLIB_MODULES if (root / f"{m}.py").is_file()]
    if not texts:
        raise FileNotFoundError(
            f"the built-in corpus reads Python's standard library sources under {root}, but none were found "
            "(a stripped Python install?); pass your own text files with data=[...] / --data"
        )
    return "\n\n".join(texts)


def read_texts(files: Sequence[str | Path]) -> list[str]:
    """Read text files, failing clearly on a missing or empty one."""
    texts = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist (or is not a file); check the path given as data")
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise ValueError(f"corpus file {path} is empty; give a file with text in it")
        texts.append(text)
    return texts


def bos_id(tokenizer) -> Optional[int]:
    """The token a sequence starts with by the tokenizer's own rule (``Tokenizer.bos_id``: its
    post-processor, ``add_bos_token``, a GGUF file's ``add_bos``); None for bytes and for tokenizers
    that put nothing before a text."""
    return getattr(tokenizer, "bos_id", None)


@dataclass
class TokenData:
    """A token stream cut into non-overlapping sequences of ``seq_len`` tokens, shuffled per epoch.
    With ``bos``, each sequence is that token followed by ``seq_len - 1`` tokens of the stream, as
    the tokenizer would begin a text (a model trained with BOS at position 0, Gemma's say, expects it)."""

    tokens: torch.Tensor  # 1-D int64
    seq_len: int
    seed: int = 0
    bos: Optional[int] = None

    def __post_init__(self) -> None:
        chunk = self.seq_len - (self.bos is not None)
        if chunk < 1:
            raise ValueError(f"seq_len {self.seq_len} leaves no room for text after BOS; use seq_len >= 2")
        self.n_seqs = int(self.tokens.numel()) // chunk
        if self.n_seqs < 1:
            raise ValueError(
                f"the corpus has {self.tokens.numel()} tokens, fewer than one sequence of seq_len={self.seq_len}"
                f"{' (BOS, then seq_len - 1 tokens)' if self.bos is not None else ''}; give more text or a shorter seq_len"
            )
        self._seqs = self.tokens[: self.n_seqs * chunk].view(self.n_seqs, chunk)
        if self.bos is not None:
            self._seqs = torch.cat([torch.full((self.n_seqs, 1), self.bos, dtype=self._seqs.dtype), self._seqs], 1)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_seqs, generator=gen)}
        return self._perms[epoch]

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Sequences ``start .. start + count`` of the endless shuffled stream, shape (count, seq_len)."""
        rows = []
        for i in range(start, start + count):
            epoch, j = divmod(i, self.n_seqs)
            rows.append(int(self._perm(epoch)[j]))
        return self._seqs[torch.tensor(rows)]


def tokenize(texts: Sequence[str], tokenizer) -> torch.Tensor:
    """One 1-D stream of token ids for the texts, in order."""
    if isinstance(tokenizer, ByteTokenizer):
        blob = "\n\n".join(texts).encode("utf-8")
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)


def load_tokens(data: Optional[Sequence[str | Path]] = None, tokenizer=None) -> torch.Tensor:
    """Tokenise the built-in corpus (``data`` empty) or the given text files into one 1-D stream."""
    tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, (str, Path)) else get_tokenizer(tokenizer)
    return tokenize(read_texts(data) if data else [builtin_corpus()], tokenizer)


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of the best model that ignores context."""
    counts = torch.bincount(tokens.flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class _Stream:
    """A :class:`TokenData` as the loop reads data: batches of ids, targets (the ids) and no documents."""

    def __init__(self, data: TokenData):
        self.data, self.n_samples = data, data.n_seqs

    def batch(self, start: int, count: int):
        from zoo.training.loader import Batch

        ids = self.data.batch(start, count)
        return Batch(ids, ids, None)


def data_entries(data: Sequence) -> list[dict]:
    """``config.data`` as ``[{path, weight}]``."""
    return [dict(e) if isinstance(e, dict) else {"path": str(e)} for e in data]


def open_data(config, tokenizer):
    """The training stream and the validation set (None without ``config.val``) of a run: prepared corpora
    (:mod:`zoo.training.loader`: packing, SFT, mixtures) or, as before, text files / the built-in corpus
    tokenised into one stream (no documents, no validation)."""
    from zoo.training.loader import open_sources
    from zoo.training.shards import DataError, is_prepared

    entries = data_entries(config.data)
    prepared = [is_prepared(e["path"]) for e in entries]
    if entries and all(prepared):
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (getattr(tokenizer, "eos_token_ids", None) or [0])[0]
        common = dict(packing=config.packing, sft=config.sft, seed=config.seed, pad_id=pad)
        fraction = config.val.fraction if config.val is not None and config.val.path is None else 0.0
        train = open_sources(entries, tokenizer, config.seq_len, val_fraction=fraction, **common)
        val = None
        if config.val is not None:
            val_entries = [{"path": config.val.path}] if config.val.path else entries
            val = open_sources(val_entries, tokenizer, config.seq_len, val_fraction=fraction or 0.0,
                               split="val" if fraction else "train", **common)
            if not fraction:  # a separate corpus: all of it, in order
                from zoo.training.loader import Ordered

                val = Ordered(val.sources)
        return train, val
    if any(prepared):
        raise DataError(f"data: {', '.join(e['path'] for e, p in zip(entries, prepared) if not p)} are not prepared "
                        "corpora, but others are; prepare every source (zoo data prepare) or give text files only")
    for what, on in (("sft", config.sft), ("val", config.val is not None), ("a weight", any("weight" in e for e in entries))):
        if on:
            raise DataError(f"data: {what} needs prepared corpora (zoo data prepare SOURCES --out DIR, then data = "
                            "[{path = DIR}]); text files are read as one stream")
    texts = read_texts([e["path"] for e in entries]) if entries else [builtin_corpus()]
    return _Stream(TokenData(tokenize(texts, tokenizer), config.seq_len, seed=config.seed, bos=bos_id(tokenizer))), None
