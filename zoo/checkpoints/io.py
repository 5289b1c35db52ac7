"""Safetensors I/O: reading single-file and sharded checkpoints tensor by tensor, atomic writing."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.checkpoints.format import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


# safetensors dtype codes -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightFiles:
    """The tensors of a checkpoint directory: name -> shard file.

    Headers are parsed and validated by safetensors when the directory is opened. A tensor that
    is kept as stored (same dtype, on the CPU) is a view of a private, copy-on-write mapping of its
    file (``get(name, mapped=True)``): no copy at all, the pages shared with the page cache. One that
    will be converted is read straight into a buffer of its own, so no mapping holds pages of data
    that is thrown away. Either way a whole load needs about one copy of the weights in memory.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._maps: dict[Path, mmap.mmap] = {}
        self.where: dict[str, Path] = {}
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # dtype, shape, start, end
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (self.directory / shard).is_file():
                    raise CheckpointError(f"{index} lists shard {shard!r}, which is missing from {self.directory}")
            # The index is a promise: check each shard really holds what it lists.
            for shard in shards:
                names = set(self._read_header(self.directory / shard))
                for name, file in weight_map.items():
                    if file == shard and name not in names:
                        raise CheckpointError(f"{index} says tensor {name!r} is in {shard}, but that file lacks it")
            self.where = {name: self.directory / file for name, file in weight_map.items()}
        elif (self.directory / SINGLE).is_file():
            path = self.directory / SINGLE
            self.where = {name: path for name in self._read_header(path)}
        else:
            pickles = [p for p in PICKLES if (self.directory / p).exists()]
            if pickles:
                raise CheckpointError(
                    f"{self.directory} holds only pickle weights ({', '.join(pickles)}). zoo never unpickles "
                    "checkpoints: loading a pickle can run arbitrary code. Convert it to safetensors where you "
                    "trust it (e.g. load it with transformers and save_pretrained(..., safe_serialization=True))."
                )
            raise CheckpointError(f"{self.directory} has no {SINGLE} or {INDEX}: no safetensors weights to load")

    def _read_header(self, path: Path) -> list[str]:
        try:  # safetensors validates the header (offsets, dtypes, overlaps)
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(
                f"{path}: cannot read safetensors header ({type(exc).__name__}: {exc}); the file is "
                "corrupt or truncated: download it again"
            ) from None
        header, start = _header(path)
        for name in names:
            info = header[name]
            if info["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which zoo cannot load")
            begin, end = info["data_offsets"]
            self.entries[name] = (info["dtype"], tuple(info["shape"]), start + begin, start + end)
        return names

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entries[name][0]]

    def get(self, name: str, *, mapped: bool = False) -> torch.Tensor:
        path = self.where[name]
        dtype, shape, begin, end = self.entries[name]
        if mapped and end > begin and begin % DTYPES[dtype].itemsize == 0:
            if path not in self._maps:
                with open(path, "rb") as f:
                    self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if len(self._maps[path]) < end:
                raise CheckpointError(f"{path}: truncated while reading tensor {name!r}; download it again")
            raw = torch.frombuffer(self._maps[path], dtype=torch.uint8, count=end - begin, offset=begin)
            return raw.view(DTYPES[dtype]).reshape(shape)
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(begin)
            got = f.readinto(buf.numpy()) if end > begin else 0
        if got != end - begin:
            raise CheckpointError(f"{path}: truncated while reading tensor {name!r}; download it again")
        return buf.view(DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        self._maps.clear()  # tensors still viewing a mapping keep it alive

    def __enter__(self) -> "WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated (no safetensors header); download it again")
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header; download it again") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def check_sizes(directory: Path) -> None:
    """A truncated shard has a valid header but less data than it promises: catch that up front."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        header, start = _header(path)
        end = start + max((v["data_offsets"][1] for v in header.values()), default=0)
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(f"{path}: truncated: {size} bytes, but its header describes {end}; download it again")


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str) -> list[str]:
    """Write ``tensors`` as safetensors shards (one ``model.safetensors`` when they fit) plus an index."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    files = []
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files + [INDEX]


@contextlib.contextmanager
def atomic_directory(target: Path, keep: Optional[callable] = None) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; on success it replaces ``target``.

    Files of an existing ``target`` for which ``keep(name)`` is true (a tokenizer, say) are carried
    over. If anything fails, ``target`` is left exactly as it was.
    """
    target = Path(target).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        yield tmp
        if target.exists() and not target.is_dir():
            raise CheckpointError(f"{target} exists and is not a directory")
        if target.is_dir() and keep is not None:
            for p in target.iterdir():
                if p.is_file() and keep(p.name) and not (tmp / p.name).exists():
                    shutil.copy2(p, tmp / p.name)
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
