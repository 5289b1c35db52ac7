"""The training wing's tokenizers: a checkpoint's (:class:`zoo.inference.tokenizer.Tokenizer`), or
bytes (:class:`ByteTokenizer`, the default corpus's), chosen by :func:`get_tokenizer`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from zoo.inference.tokenizer import Tokenizer


class ByteTokenizer:
    """Text as UTF-8 bytes: 256 tokens, nothing to download, nothing unknown."""

    vocab_size = 256

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        """Write this tokenizer as a ``tokenizer.json`` (byte-level, no merges: token id = byte value),
        so that a byte-level run's export reads and writes text like any checkpoint."""
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        tok = _HFTokenizer(models.BPE(vocab={ch: b for b, ch in _byte_chars().items()}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        Path(directory).mkdir(parents=True, exist_ok=True)
        tok.save(str(Path(directory) / "tokenizer.json"))
        return Path(directory)


def _byte_chars() -> dict[int, str]:
    """The printable character byte-level tokenizers stand for each byte (printable Latin-1 bytes
    stand for themselves, the others for 256, 257, ... in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def get_tokenizer(tokenizer: Optional[str | Path] = None):
    """``None`` or ``"bytes"``: :class:`ByteTokenizer`; otherwise a tokenizer.json or a directory holding one."""
    if tokenizer is None or str(tokenizer) == "bytes":
        return ByteTokenizer()
    return Tokenizer(tokenizer)
