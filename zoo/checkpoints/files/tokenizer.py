"""A checkpoint's tokenizer: its ``tokenizer.json`` through the ``tokenizers`` library.

``Tokenizer(directory)`` reads ``tokenizer.json`` and, when present, the special tokens of
``tokenizer_config.json`` (whether to prepend BOS) and the end-of-sequence ids of
``generation_config.json`` / ``config.json``, and the chat template (``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``). A GGUF file holds all of these in its metadata:
``Tokenizer("model.gguf")`` reads them there (:func:`zoo.checkpoints.files.gguf.tokenizer_parts`).
Found through :func:`zoo.checkpoints.sources.find`, as every checkpoint file is; decoding for
display is :mod:`zoo.inference.tokenizer`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as _HFTokenizer

from zoo.checkpoints.files.gguf import tokenizer_parts
from zoo.checkpoints.hf.format import CheckpointError
from zoo.checkpoints.sources import Source, find


def read_tokenizer_file(path: Path) -> _HFTokenizer:
    """A ``tokenizer.json`` read by ``tokenizers``; a file it cannot read is a ValueError naming it."""
    try:
        return _HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer.json that the tokenizers library can read ({exc})") from None


def _read_json(path: Path) -> dict:
    """A JSON object from ``path`` ({} when there is no such file); one that is not is a ValueError naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def chat_template(value, where: str) -> Optional[str]:
    """A chat template as a file states it: a string, or transformers' list of named templates
    (``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``), of which the ``default``
    one is used, as transformers does; anything else is a ValueError naming ``where``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named:
            raise ValueError(f"{where} names templates {sorted(named)} but none 'default', the one a chat uses")
        return named["default"]
    raise ValueError(f"{where} must be a string or a list of {{'name': ..., 'template': ...}} entries, "
                     f"got {type(value).__name__}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc})") from None


class Tokenizer:
    """A ``tokenizer.json`` (a file, or a checkpoint directory holding one), read by ``tokenizers``:
    the one tokenizer wrapper, for generation and for training data alike."""

    def __init__(self, directory: str | Path | Source):
        if isinstance(directory, Source):
            source = directory
        else:
            try:
                source = find(directory)
            except CheckpointError:  # a run without its export: no tokenizer.json, said below
                source = None
        directory = Path(source.tokenizer if source is not None else directory)
        if source is not None and source.kind == "gguf":  # the tokenizer is in the file's metadata
            parts = tokenizer_parts(source.tokenizer)
            self.path, self.tok = parts["path"], parts["tokenizer"]
            self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
            self.bos_token, self.add_bos = parts["bos_token"], parts["add_bos"]
            self.eos_token_ids, self.pad_token_id = parts["eos_token_ids"], parts["pad_token_id"]
            self.chat_template = chat_template(parts["chat_template"], f"{self.path}: tokenizer.chat_template")
            self.config, self.generation = {}, {}
            return
        path = directory / "tokenizer.json" if directory.is_dir() else directory
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {path} does not exist; pass a tokenizer.json or a checkpoint directory holding one "
                f"(or give token ids directly to zoo.generate)"
            )
        self.path = path
        self.tok = read_tokenizer_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        folder = path.parent
        config = _read_json(folder / "tokenizer_config.json")
        self.config, self.generation = config, _read_json(folder / "generation_config.json")
        gen = {**_read_json(folder / "config.json"), **self.generation}
        self.bos_token = self._token(config.get("bos_token"))
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token is not None
        eos = gen.get("eos_token_id")
        if eos is None and self._token(config.get("eos_token")) is not None:
            eos = self.tok.token_to_id(self._token(config.get("eos_token")))
        self.eos_token_ids: list[int] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.pad_token_id: Optional[int] = gen.get("pad_token_id")
        template = folder / "chat_template.jinja"
        self.chat_template: Optional[str] = (_read_text(template) if template.is_file() else
                                             chat_template(config.get("chat_template"),
                                                           f"{folder / 'tokenizer_config.json'}: chat_template"))

    @property
    def eos_token_id(self) -> Optional[int]:
        """The first end-of-sequence id (transformers' spelling); :attr:`eos_token_ids` holds them all."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @staticmethod
    def _token(entry) -> Optional[str]:
        if isinstance(entry, dict):
            return entry.get("content")
        return entry

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` adds no BOS or other special token
        (training text, concatenated into one stream)."""
        if not add_special_tokens:
            return self.tok.encode(text, add_special_tokens=False).ids
        ids = self.tok.encode(text).ids
        if self.add_bos:
            bos = self.tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    @property
    def bos_id(self) -> Optional[int]:
        """The token this tokenizer's own rule puts before a text: what ``encode`` adds in front
        (tokenizer.json's post-processor, ``add_bos_token`` of tokenizer_config.json, a GGUF file's
        ``add_bos``); None when it adds nothing there."""
        plain, full = self.encode("a", add_special_tokens=False), self.encode("a")
        if len(full) > len(plain) and full[1:1 + len(plain)] == plain:
            return full[0]
        return None

    def save(self, directory: str | Path) -> Path:
        """Write this tokenizer beside a checkpoint, as transformers lays it out: ``tokenizer.json``,
        ``tokenizer_config.json`` (the original's fields, with the BOS/EOS tokens and
        ``add_bos_token`` when BOS is added), ``chat_template.jinja`` when there is a template, and ``generation_config.json`` (the
        original's, with the BOS, end-of-sequence and padding ids)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(directory / "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if k != "chat_template"}
        if self.bos_token is not None:
            config["bos_token"] = self.bos_token
        if self.add_bos:  # never written False: transformers would then drop a post-processor's BOS
            config["add_bos_token"] = True
        if self.eos_token_ids and "eos_token" not in config:
            config["eos_token"] = self.tok.id_to_token(self.eos_token_ids[0])
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.chat_template:
            (directory / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        gen = dict(self.generation)
        bos = self.tok.token_to_id(self.bos_token) if self.bos_token is not None else None
        for key, value in (("bos_token_id", bos), ("pad_token_id", self.pad_token_id),
                           ("eos_token_id", self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                            else self.eos_token_ids or None)):
            if value is not None:
                gen.setdefault(key, value)
        if gen:
            (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        return directory

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
