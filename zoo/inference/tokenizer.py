"""Text out as it comes: :class:`TextStream` turns ids into text pieces that are safe to print as
they come (no half-decoded UTF-8 sequences). The tokenizer is a checkpoint's
(:class:`zoo.checkpoints.files.tokenizer.Tokenizer`, named here too).
"""

from __future__ import annotations

from zoo.checkpoints.files.tokenizer import Tokenizer, chat_template, read_tokenizer_file

__all__ = ["TextStream", "Tokenizer", "chat_template", "read_tokenizer_file"]


class TextStream:
    """Incremental detokenisation: feed ids one at a time, get back the new text (possibly empty,
    when a character is still incomplete)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.text = text[len(self.text):], text
        return new
