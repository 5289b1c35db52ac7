"""Prepared training data: documents tokenised once into memory-mapped token shards.

``prepare(sources, out_dir, tokenizer)`` (``zoo data prepare``) reads text files, JSONL (a text
field, chat ``messages``, or ``prompt``/``completion`` pairs), Parquet, Arrow files and Hugging Face
dataset directories (``Dataset.save_to_disk``), tokenises the documents in parallel processes, and
writes, in ``out_dir``:

- ``shard-NNNNN.bin``: the tokens, uint16 when the vocabulary fits, else uint32 (Megatron's and
  nanoGPT's flat token files), read back with ``numpy.memmap``;
- ``shard-NNNNN.idx.npy``: per document its start in the shard (one more entry: the end), its source
  and its record (line or row), so a fault found later names the file and line;
- ``shard-NNNNN.mask.bin`` (chat and pair data): 1 where the loss counts (the assistant's turns, the
  completion), 0 elsewhere;
- ``manifest.json``, written last: the tokenizer (its fingerprint, vocabulary, BOS and EOS), the
  sources (size and BLAKE2 hash), counts, and the shards. A directory without it is not finished.

Each document is encoded as the tokenizer encodes a text on its own (its BOS rule applied), then EOS
(when the tokenizer has one) closes it, so documents packed into one sequence are separated by EOS.
A chat is rendered with the tokenizer's own chat template (the one ``zoo chat`` renders with) and
encoded without further special tokens (the template writes them).

Shards end at document boundaries after ``shard_tokens`` tokens, so where they end depends only on
the documents; each is written under a temporary name and renamed into place, and ``progress.json``
records the records consumed so far. An interrupted ``prepare`` resumes after its last whole shard
and produces exactly the shards an uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

FORMAT = 1
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")  # others are plain text, one document per file


class DataError(ValueError):
    """A source that cannot be prepared or read: the message names the file (and line)."""


# -- the tokenizer, as prepare and a run see it ----------------------------------------------------

def tokenizer_facts(tokenizer) -> dict[str, Any]:
    """What a prepared corpus records of its tokenizer: a fingerprint of its vocabulary and rules, its
    size, and the BOS and EOS it adds. Two tokenizers with the same facts encode every text alike."""
    from zoo.training.tokens import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "bytes", "fingerprint": "bytes", "vocab_size": 256, "bos": None, "eos": None}
    text = tokenizer.tok.to_str()
    digest = hashlib.blake2b(text.encode(), digest_size=16)
    digest.update(json.dumps([tokenizer.bos_id, tokenizer.eos_token_ids[:1]]).encode())
    return {"kind": "tokenizer.json", "fingerprint": digest.hexdigest(), "vocab_size": tokenizer.vocab_size,
            "bos": tokenizer.bos_id, "eos": (tokenizer.eos_token_ids or [None])[0],
            "path": str(getattr(tokenizer, "path", ""))}


def check_tokenizer(manifest: dict, tokenizer, where: Path) -> None:
    """Refuse a prepared corpus tokenised by another tokenizer than the run's, naming both."""
    mine = tokenizer_facts(tokenizer)
    theirs = manifest["tokenizer"]
    if mine["fingerprint"] != theirs["fingerprint"]:
        raise DataError(
            f"{where}/manifest.json: prepared with another tokenizer ({theirs.get('kind')} "
            f"{theirs.get('path') or ''}, {theirs['vocab_size']} tokens, fingerprint {theirs['fingerprint'][:12]}) "
            f"than this run's ({mine['kind']} {mine.get('path') or ''}, {mine['vocab_size']} tokens, fingerprint "
            f"{mine['fingerprint'][:12]}); prepare it again with this run's tokenizer (zoo data prepare --tokenizer ...)")


# -- reading the sources ---------------------------------------------------------------------------

@dataclass
class Record:
    """One document of a source: a text, a chat (``messages``) or a prompt/completion pair."""

    source: int
    line: int  # 1-based line (JSONL) or row (tables); 1 for a text file
    text: Optional[str] = None
    messages: Optional[list] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None


def _where(path: Path, line: int, kind: str) -> str:
    return f"{path}:{line}" if kind == "jsonl" else (f"{path} row {line}" if kind == "table" else str(path))


def _record(row: Any, source: int, line: int, path: Path, kind: str, fields: dict) -> Record:
    where = _where(path, line, kind)
    if not isinstance(row, dict):
        raise DataError(f"{where}: a record must be an object with a {fields['text']!r}, {fields['messages']!r} "
                        f"or {fields['prompt']!r}/{fields['completion']!r} field, got {type(row).__name__}")
    if row.get(fields["messages"]) is not None:
        messages = row[fields["messages"]]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DataError(f"{where}: {fields['messages']!r} must be a non-empty list of "
                            "{'role': str, 'content': str} objects")
        return Record(source, line, messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    if row.get(fields["prompt"]) is not None or row.get(fields["completion"]) is not None:
        p, c = row.get(fields["prompt"]), row.get(fields["completion"])
        if not isinstance(p, str) or not isinstance(c, str):
            raise DataError(f"{where}: a pair needs string fields {fields['prompt']!r} and {fields['completion']!r}")
        return Record(source, line, prompt=p, completion=c)
    text = row.get(fields["text"])
    if text is None:
        raise DataError(f"{where}: no {fields['text']!r} field (the record has {sorted(row)[:8]}); name the text "
                        f"field with --text-field, or give {fields['messages']!r} or "
                        f"{fields['prompt']!r}/{fields['completion']!r}")
    if not isinstance(text, str):
        raise DataError(f"{where}: {fields['text']!r} must be a string, got {type(text).__name__}")
    return Record(source, line, text=text)


def _read_text_file(path: Path) -> str:
    data = path.read_bytes()
    if not data.strip():
        raise DataError(f"{path}: the file is empty; give a file with text in it, or leave it out")
    if b"\0" in data[:1 << 20]:
        raise DataError(f"{path}: a binary file (it holds NUL bytes), not text; leave it out of the sources")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {exc.start}: {exc.reason}); convert it or leave it out") from None


def read_records(path: Path, source: int, fields: dict) -> Iterator[Record]:
    """The documents of one source, in order, each a :class:`Record`."""
    path = Path(path)
    if path.is_dir():
        import datasets

        if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
            raise DataError(f"{path}: a directory that is not a saved Hugging Face dataset (no state.json); "
                            "give its files, or a directory written by Dataset.save_to_disk")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: a DatasetDict without a 'train' split (it has {sorted(ds)}); give one split's directory")
            ds = ds["train"]
        for i, row in enumerate(ds):
            yield _record(row, source, i + 1, path, "table", fields)
        return
    if not path.is_file():
        raise DataError(f"{path}: no such file or directory; check the source paths")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty; give a file with records in it, or leave it out")
        with path.open("rb") as f:
            n = 0
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DataError(f"{path}:{line_no}: not a JSON object ({exc}); fix or remove the line") from None
                n += 1
                yield _record(row, source, line_no, path, "jsonl", fields)
        if n == 0:
            raise DataError(f"{path}: holds no records (only blank lines)")
        return
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            reader = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises its own error types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
        row_no = 0
        for batch in reader.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                row_no += 1
                yield _record(row, source, row_no, path, "table", fields)
        return
    if suffix == ".arrow":
        import datasets

        try:
            ds = datasets.Dataset.from_file(str(path))
        except Exception as exc:
            raise DataError(f"{path}: not a readable Arrow file ({exc})") from None
        for i, row in enumerate(ds):
            yield _record(row, source, i + 1, path, "table", fields)
        return
    yield Record(source, 1, text=_read_text_file(path))


def file_hash(path: Path) -> str:
    """BLAKE2b of a file's bytes (of each file under a directory, in name order)."""
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
    for p in files:
        digest.update(str(p.relative_to(path) if Path(path).is_dir() else p.name).encode())
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


# -- tokenising --------------------------------------------------------------------------------------

_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = tokenizer


def _offsets_encode(tokenizer, text: str):
    """Token ids of ``text`` (no special tokens added) and each token's (start, end) characters."""
    from zoo.training.tokens import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        ids, spans, pos = [], [], 0
        for ch in text:
            b = ch.encode("utf-8")
            ids += list(b)
            spans += [(pos, pos + 1)] * len(b)
            pos += 1
        return ids, spans
    enc = tokenizer.tok.encode(text, add_special_tokens=False)
    return enc.ids, enc.offsets


def chat_tokens(tokenizer, messages: list[dict], where: str = "") -> tuple[list[int], list[int]]:
    """A conversation rendered with the tokenizer's chat template and encoded as the template writes
    it, and a mask: 1 on the tokens each assistant turn adds after the generation prompt (its content
    and the end of its turn), 0 elsewhere. The spans come from rendering each prefix of the
    conversation, as TRL's assistant-only loss does without generation markers."""
    from zoo.inference.conversation import render

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError(f"{where}: a chat record, but the tokenizer ({getattr(tokenizer, 'path', tokenizer)}) has no "
                        "chat template; prepare chats with the model's own tokenizer (a checkpoint directory or GGUF)")
    bos = getattr(tokenizer, "bos_token", None) or ""
    try:
        full = render(template, messages, add_generation_prompt=False, bos_token=bos)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(render(template, messages[:i], add_generation_prompt=True, bos_token=bos)) if i else 0
            end = len(render(template, messages[:i + 1], add_generation_prompt=False, bos_token=bos))
            spans.append((start, end))
    except ValueError as exc:
        raise DataError(f"{where}: {exc}") from None
    prefix = render(template, messages[: max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1],
                    add_generation_prompt=False, bos_token=bos) if spans else ""
    if spans and not full.startswith(prefix):
        raise DataError(f"{where}: the chat template does not render a conversation as an extension of its "
                        "beginning, so the assistant's tokens cannot be found; it cannot be used for SFT")
    ids, offsets = _offsets_encode(tokenizer, full)
    mask = [0] * len(ids)
    for s, e in spans:
        for t, (a, b) in enumerate(offsets):
            if a >= s and b <= e and b > a:
                mask[t] = 1
    return ids, mask


def encode_record(tokenizer, r: Record, eos: Optional[int], where: str = "") -> tuple[list[int], Optional[list[int]]]:
    """One record's tokens and loss mask (None: every token counts). A text or a prompt is encoded as
    the tokenizer encodes a text on its own (its BOS rule), and EOS (when the tokenizer has one) ends
    a text or a completion; a chat is what its template writes (which ends each turn itself)."""
    if r.messages is not None:
        return chat_tokens(tokenizer, r.messages, where)
    end = [eos] if eos is not None else []
    if r.prompt is not None:
        p, c = tokenizer.encode(r.prompt), tokenizer.encode(r.completion, add_special_tokens=False) + end
        return p + c, [0] * len(p) + [1] * len(c)
    ids = tokenizer.encode(r.text)
    return (ids + end if ids else ids), None


def _encode_batch(batch: list[tuple[Record, str]]):
    tok = _worker_tokenizer
    eos = tokenizer_facts(tok)["eos"]
    return [(r.source, r.line, where, *encode_record(tok, r, eos, where)) for r, where in batch]


# -- writing -----------------------------------------------------------------------------------------

def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _atomic_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


class _ShardWriter:
    def __init__(self, out: Path, number: int, dtype, masked: bool):
        self.out, self.number, self.dtype, self.masked = out, number, dtype, masked
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.starts, self.origin, self.count = [0], [], 0

    def add(self, ids, mask, source: int, line: int) -> None:
        self.tokens.append(np.asarray(ids, dtype=self.dtype))
        if self.masked:
            self.masks.append(np.asarray(mask if mask is not None else [1] * len(ids), dtype=np.uint8))
        self.count += len(ids)
        self.starts.append(self.count)
        self.origin.append((source, line))

    def write(self) -> dict:
        name = f"shard-{self.number:05d}"
        files = {"bin": f"{name}.bin", "idx": f"{name}.idx.npy"}
        tmp = {k: self.out / f".tmp-{v}" for k, v in files.items()}
        np.concatenate(self.tokens).tofile(tmp["bin"])
        index = np.zeros((len(self.starts), 3), dtype=np.int64)
        index[:, 0] = self.starts
        index[:-1, 1:] = np.asarray(self.origin, dtype=np.int64).reshape(-1, 2)
        with open(tmp["idx"], "wb") as f:
            np.save(f, index)
        if self.masked:
            files["mask"] = f"{name}.mask.bin"
            tmp["mask"] = self.out / f".tmp-{files['mask']}"
            np.concatenate(self.masks).tofile(tmp["mask"])
        for k in files:
            os.replace(tmp[k], self.out / files[k])
        return {**files, "tokens": self.count, "documents": len(self.origin)}


def prepare(sources: Sequence[str | Path], out_dir: str | Path, tokenizer=None, *, workers: int = 2,
            shard_tokens: int = 1 << 26, max_tokens: Optional[int] = None, text_field: str = "text",
            messages_field: str = "messages", prompt_field: str = "prompt", completion_field: str = "completion",
            progress: bool = True, batch_docs: int = 64, stop_after_shards: Optional[int] = None) -> dict:
    """Tokenise ``sources`` into shards under ``out_dir`` (see the module's text); returns the manifest.

    ``tokenizer``: a :class:`~zoo.inference.tokenizer.Tokenizer`, a tokenizer.json / checkpoint
    directory / GGUF path, or None / "bytes". ``max_tokens``: documents longer are left out (and
    counted in the manifest as ``dropped``); None keeps every one. ``stop_after_shards`` stops after
    writing that many shards in this call (as an interruption would; the tests resume from it)."""
    from tqdm.auto import tqdm

    from zoo.training.tokens import get_tokenizer

    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    tokenizer = get_tokenizer(tokenizer) if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    sources = [Path(s) for s in sources]
    if not sources:
        raise ValueError("prepare needs at least one source file or dataset directory")
    for s in sources:
        if not s.exists():
            raise DataError(f"{s}: no such file or directory; check the source paths")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    facts = tokenizer_facts(tokenizer)
    fields = {"text": text_field, "messages": messages_field, "prompt": prompt_field, "completion": completion_field}
    settings = {"format": FORMAT, "tokenizer": facts, "fields": fields, "shard_tokens": shard_tokens,
                "max_tokens": max_tokens,
                "sources": [{"path": str(s), "bytes": _size(s), "hash": file_hash(s)} for s in sources]}
    manifest_path, progress_path = out / "manifest.json", out / "progress.json"
    if manifest_path.is_file():
        done = json.loads(manifest_path.read_text())
        if {k: done.get(k) for k in settings} == settings:
            return done  # already prepared, from the same sources with the same tokenizer
        if done.get("tokenizer", {}).get("fingerprint") != facts["fingerprint"]:
            raise DataError(f"{manifest_path}: {out} holds a corpus prepared with another tokenizer; prepare into "
                            "another directory, or remove this one")
        raise DataError(f"{manifest_path}: {out} holds a corpus prepared from other sources or settings; prepare "
                        "into another directory, or remove this one")
    state = {"shards": [], "consumed": 0, "dropped": 0, "documents": 0, "tokens": 0, "masked": None}
    if progress_path.is_file():
        saved = json.loads(progress_path.read_text())
        if saved.get("settings") == settings:
            state = saved["state"]
        else:
            raise DataError(f"{progress_path}: an interrupted prepare from other sources or another tokenizer is in "
                            f"{out}; prepare into another directory, or remove this one")
    for stale in out.glob(".tmp-*"):
        stale.unlink()
    for s in out.glob("shard-*"):  # a shard written after the last progress record: redone
        if s.name.split(".")[0] not in {x["bin"].split(".")[0] for x in state["shards"]}:
            s.unlink()
    dtype = token_dtype(facts["vocab_size"])
    total_bytes = sum(x["bytes"] for x in settings["sources"])
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress, dynamic_ncols=True)

    def records() -> Iterator[tuple[Record, str]]:
        for i, s in enumerate(sources):
            kind = "jsonl" if s.suffix.lower() in (".jsonl", ".json") else (
                "table" if s.is_dir() or s.suffix.lower() in (".parquet", ".arrow") else "text")
            for r in read_records(s, i, fields):
                yield r, _where(s, r.line, kind)
            bar.update(settings["sources"][i]["bytes"])

    def batches(skip: int) -> Iterator[list]:
        batch, n = [], 0
        for item in records():
            n += 1
            if n <= skip:
                continue
            batch.append(item)
            if len(batch) == batch_docs:
                yield batch
                batch = []
        if batch:
            yield batch

    import multiprocessing as mp

    pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer,)) if workers > 1 else None
    if pool is None:
        _init_worker(tokenizer)
    written_now = 0
    try:
        encoded = pool.imap(_encode_batch, batches(state["consumed"])) if pool else map(_encode_batch, batches(state["consumed"]))
        writer, pending = None, 0
        for source, line, where, ids, mask in (item for results in encoded for item in results):
            pending += 1
            if len(ids) == 0:
                raise DataError(f"{where}: encodes to no tokens; remove the record")
            if max_tokens is not None and len(ids) > max_tokens:
                state["dropped"] += 1
                continue
            if state["masked"] is None:
                state["masked"] = mask is not None
            if writer is None:
                writer = _ShardWriter(out, len(state["shards"]), dtype, bool(state["masked"]))
            if mask is not None and not writer.masked:
                raise DataError(f"{where}: a chat or prompt/completion record in a source of plain texts; prepare "
                                "texts and supervised records separately (each its own directory) and mix them")
            writer.add(ids, mask, source, line)
            if writer.count >= shard_tokens:
                state["shards"].append(writer.write())
                state["consumed"] += pending
                state["documents"] += len(writer.origin)
                state["tokens"] += writer.count
                pending, writer = 0, None
                _atomic_json(progress_path, {"settings": settings, "state": state})
                written_now += 1
                if stop_after_shards is not None and written_now >= stop_after_shards:
                    return {"interrupted": True, **state}
        if writer is not None:
            state["shards"].append(writer.write())
            state["documents"] += len(writer.origin)
            state["tokens"] += writer.count
        state["consumed"] += pending
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    if not state["shards"]:
        raise DataError(f"{', '.join(map(str, sources))}: no document left to prepare"
                        + (f" ({state['dropped']} longer than max_tokens {max_tokens})" if state["dropped"] else ""))
    manifest = {**settings, "dtype": np.dtype(dtype).name, "masked": bool(state["masked"]),
                "documents": state["documents"], "tokens": state["tokens"], "dropped": state["dropped"],
                "shards": state["shards"]}
    _atomic_json(manifest_path, manifest)
    progress_path.unlink(missing_ok=True)
    return manifest


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


# -- reading a prepared corpus -----------------------------------------------------------------------

def is_prepared(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


class Prepared:
    """A prepared corpus, memory-mapped: every shard's tokens, document index and loss mask are read from
    disk as they are asked for, so what a process holds does not grow with the corpus. Checks on
    opening that each shard file has the size the manifest states (a truncated shard is refused, named)."""

    def __init__(self, path: str | Path, tokenizer=None):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            hint = " (an interrupted prepare: run it again to finish)" if (self.path / "progress.json").is_file() else ""
            raise DataError(f"{self.path}: not a prepared corpus (no manifest.json){hint}; make one with "
                            "zoo data prepare SOURCES --out DIR")
        try:
            self.manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{mpath}: not valid JSON ({exc})") from None
        if self.manifest.get("format") != FORMAT:
            raise DataError(f"{mpath}: format {self.manifest.get('format')!r}; this zoo reads format {FORMAT}")
        if tokenizer is not None:
            check_tokenizer(self.manifest, tokenizer, self.path)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.masked = bool(self.manifest["masked"])
        self.sources = [s["path"] for s in self.manifest["sources"]]
        self.tokens, self.index, self.masks = [], [], []
        for sh in self.manifest["shards"]:
            f = self.path / sh["bin"]
            want = sh["tokens"] * self.dtype.itemsize
            if not f.is_file() or f.stat().st_size != want:
                got = f.stat().st_size if f.is_file() else "no file"
                raise DataError(f"{f}: {got} bytes, but the manifest states {sh['tokens']} tokens ({want} bytes); the "
                                "shard is truncated or damaged: prepare the corpus again")
            self.tokens.append(np.memmap(f, dtype=self.dtype, mode="r", shape=(sh["tokens"],)))
            idx = np.load(self.path / sh["idx"], mmap_mode="r")
            if idx.shape != (sh["documents"] + 1, 3) or int(idx[-1, 0]) != sh["tokens"]:
                raise DataError(f"{self.path / sh['idx']}: does not index {sh['documents']} documents of "
                                f"{sh['tokens']} tokens; prepare the corpus again")
            self.index.append(idx)
            if self.masked:
                m = self.path / sh["mask"]
                if not m.is_file() or m.stat().st_size != sh["tokens"]:
                    raise DataError(f"{m}: truncated or missing (the manifest states {sh['tokens']} mask bytes); "
                                    "prepare the corpus again")
                self.masks.append(np.memmap(m, dtype=np.uint8, mode="r", shape=(sh["tokens"],)))
        self.shard_tokens = np.array([sh["tokens"] for sh in self.manifest["shards"]], dtype=np.int64)
        self.shard_docs = np.array([sh["documents"] for sh in self.manifest["shards"]], dtype=np.int64)
        self.token_starts = np.concatenate([[0], np.cumsum(self.shard_tokens)])
        self.doc_starts = np.concatenate([[0], np.cumsum(self.shard_docs)])
        self.n_tokens, self.n_docs = int(self.token_starts[-1]), int(self.doc_starts[-1])

    def document(self, d: int) -> np.ndarray:
        """The tokens of document ``d`` (0-based over the corpus)."""
        s = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        i = d - int(self.doc_starts[s])
        a, b = int(self.index[s][i, 0]), int(self.index[s][i + 1, 0])
        return np.asarray(self.tokens[s][a:b])

    def document_mask(self, d: int) -> Optional[np.ndarray]:
        if not self.masked:
            return None
        s = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        i = d - int(self.doc_starts[s])
        a, b = int(self.index[s][i, 0]), int(self.index[s][i + 1, 0])
        return np.asarray(self.masks[s][a:b])

    def origin(self, d: int) -> str:
        """Where document ``d`` came from: ``file:line``."""
        s = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        src, line = (int(v) for v in self.index[s][d - int(self.doc_starts[s]), 1:])
        return f"{self.sources[src]}:{line}"

    def document_lengths(self) -> np.ndarray:
        """Every document's length (int64, one per document: for planning supervised sequences)."""
        return np.concatenate([np.diff(np.asarray(ix[:, 0])) for ix in self.index])

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Tokens ``start .. stop`` of the corpus (shards joined), each token's document number (over
        the corpus), and the loss mask (None: unmasked)."""
        ids, docs, masks = [], [], []
        s = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self.token_starts[s])
            a, b = pos - base, min(stop, int(self.token_starts[s + 1])) - base
            ids.append(np.asarray(self.tokens[s][a:b]))
            starts = np.asarray(self.index[s][:, 0])
            docs.append(np.searchsorted(starts, np.arange(a, b), side="right") - 1 + int(self.doc_starts[s]))
            if self.masked:
                masks.append(np.asarray(self.masks[s][a:b]))
            pos = base + b
            s += 1
        return np.concatenate(ids), np.concatenate(docs), (np.concatenate(masks) if self.masked else None)
