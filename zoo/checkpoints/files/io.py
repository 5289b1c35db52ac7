"""Safetensors I/O: reading single-file and sharded checkpoints tensor by tensor, and replacing a
checkpoint in its directory so that a crash or a concurrent save never loses or mixes one."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import re
import secrets
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from zoo.checkpoints.hf.format import CheckpointError

try:
    import fcntl
except ImportError:  # no flock (Windows): saves and loads go unlocked
    fcntl = None

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


# safetensors dtype codes -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def regular_file(path: Path, what: str = "file") -> Path:
    """``path`` if it is a regular file (a symlink to one counts: the hub cache links its blobs), else
    a CheckpointError. A FIFO or device named like a checkpoint file would hang or mislead a reader."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the {what} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the {what} ({exc})") from None
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CheckpointError(f"{path}: the {what} is {kind}, not a regular file; zoo will not read it")
    return path


def shard_path(directory: Path, name: Any, index: Path) -> Path:
    """The file an index names, which must be a plain ``.safetensors`` name inside ``directory``
    (a symlink there, as in the hub cache, is fine; ``..``, absolute paths and pickles are not)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: weight_map values must be file names, got {name!r}")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or "\\" in name or ".." in parts:
        raise CheckpointError(f"{index} names shard {name!r}, a path that leaves {directory}; refused")
    if not name.endswith(".safetensors"):
        raise CheckpointError(
            f"{index} names shard {name!r}, which is not a safetensors file. zoo never unpickles checkpoints "
            "(loading a pickle can run arbitrary code): convert it to safetensors where you trust it."
        )
    return directory / name


class WeightFiles:
    """The tensors of a checkpoint directory: name -> shard file.

    Headers are parsed and validated by safetensors when the directory is opened; every file must be
    a regular file, every shard the index names must lie inside the directory, and each tensor must
    be in exactly the shard the index says. A tensor that is kept as stored (same dtype, on the CPU)
    is a view of a private, copy-on-write mapping of its file (``get(name, mapped=True)``): no copy
    at all, the pages shared with the page cache. One that will be converted is read straight into a
    buffer of its own, so no mapping holds pages of data that is thrown away. Either way a whole load
    needs about one copy of the weights in memory.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._maps: dict[Path, mmap.mmap] = {}
        self.where: dict[str, Path] = {}
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # dtype, shape, start, end
        index = self.directory / INDEX
        if os.path.lexists(index):
            weight_map = self._weight_map(regular_file(index, "safetensors index"))
            shards = {file: shard_path(self.directory, file, index) for file in sorted(set(weight_map.values()))}
            for file, path in shards.items():
                if not path.exists():
                    raise CheckpointError(f"{index} lists shard {file!r}, which is missing from {self.directory}")
                regular_file(path, f"shard listed in {INDEX}")
            # The index is a promise: each shard holds exactly what it lists, and no tensor twice.
            for file, path in shards.items():
                listed = {name for name, f in weight_map.items() if f == file}
                header = self._read_header(path)
                for name in sorted(listed - set(header)):
                    raise CheckpointError(f"{index} says tensor {name!r} is in {file}, but that file lacks it")
                for name in sorted(set(header) - listed):
                    other = weight_map.get(name)
                    raise CheckpointError(
                        f"{path}: holds tensor {name!r}, which {INDEX} "
                        + (f"says is in {other}" if other else "does not list")
                        + "; the shards disagree with the index, so zoo cannot tell which copy is meant"
                    )
                for name in listed:
                    self.entries[name] = header[name]
            self.where = {name: shards[file] for name, file in weight_map.items()}
        elif os.path.lexists(self.directory / SINGLE):
            path = regular_file(self.directory / SINGLE, "weights file")
            self.entries = self._read_header(path)
            self.where = {name: path for name in self.entries}
        else:
            pickles = [p for p in PICKLES if os.path.lexists(self.directory / p)]
            if pickles:
                raise CheckpointError(
                    f"{self.directory} holds only pickle weights ({', '.join(pickles)}). zoo never unpickles "
                    "checkpoints: loading a pickle can run arbitrary code. Convert it to safetensors where you "
                    "trust it (e.g. load it with transformers and save_pretrained(..., safe_serialization=True))."
                )
            raise CheckpointError(f"{self.directory} has no {SINGLE} or {INDEX}: no safetensors weights to load")

    @staticmethod
    def _weight_map(index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise CheckpointError(
                f"{index}: not a valid safetensors index: 'weight_map' must be an object of tensor name -> "
                f"shard file, got {type(weight_map).__name__}"
            )
        return weight_map

    @staticmethod
    def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        """name -> (dtype, shape, start, end) of each tensor; safetensors validates the header first
        (its size, JSON, dtypes, offsets that tile the data, a file long enough for them)."""
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            what = "truncated" if "not fully covered" in str(exc) else "corrupt safetensors header"
            raise CheckpointError(
                f"{path}: {what} ({type(exc).__name__}: {exc}); the file is damaged: download it again"
            ) from None
        with open(path, "rb") as f:  # validated above: the length is sane and the JSON has offsets
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        entries = {}
        for name in names:
            info = header[name]
            if info["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which zoo cannot load")
            begin, end = info["data_offsets"]
            entries[name] = (info["dtype"], tuple(info["shape"]), 8 + n + begin, 8 + n + end)
        return entries

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
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return stream_shards(layout, iter(tensors.items()), directory, max_shard_size)


# The order in which safetensors' writer lays out a file's tensors: wider dtypes first, then by name.
_WRITE_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_CODES = {dtype: code for code, dtype in DTYPES.items()}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
            metadata: Optional[dict[str, str]] = None) -> tuple[bytes, dict[str, int], int]:
    """A safetensors header for ``entries`` (and ``metadata`` beside ``format``) as safetensors writes
    it, each tensor's offset in the file, and the file's size."""
    header: dict[str, Any] = {"__metadata__": {**(metadata or {}), "format": "pt"}}
    start = 0
    for name, dtype, shape in sorted(entries, key=lambda e: (_WRITE_ORDER.index(_CODES[e[1]]), e[0])):
        end = start + _nbytes(dtype, shape)
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    offsets = {name: 8 + len(text) + info["data_offsets"][0] for name, info in header.items() if name != "__metadata__"}
    return len(text).to_bytes(8, "little") + text, offsets, 8 + len(text) + start


def create_shard(path: Path, header: bytes, size: int) -> None:
    """A safetensors file of ``size`` bytes holding ``header``, its data still to be written in place."""
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)


def stream_shards(layout: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Iterator[tuple[str, torch.Tensor]],
                  directory: Path, max_shard_size: Optional[int | str], *,
                  metadata: Optional[dict[str, str]] = None) -> list[str]:
    """Write safetensors shards (one ``model.safetensors`` when they fit, or always with
    ``max_shard_size=None``; else numbered shards and an index) one tensor at a time: ``layout`` names
    each tensor's dtype and shape, in order; ``tensors`` then yields them in that order, and each is
    written at its place in its file and let go, so a save holds about one tensor in memory. The files
    are those safetensors' own writer makes, byte for byte; ``metadata`` goes into each file's header."""
    limit = float("inf") if max_shard_size is None else parse_size(max_shard_size)
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in layout:
        n = _nbytes(entry[1], entry[2])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    files = [SINGLE] if len(shards) == 1 else [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                               for k in range(1, len(shards) + 1)]
    place: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
    for fname, shard in zip(files, shards):
        header, offsets, total = _header(shard, metadata)
        create_shard(directory / fname, header, total)
        place.update({name: (directory / fname, offsets[name], dtype, shape) for name, dtype, shape in shard})
    for name, t in tensors:
        path, at, dtype, shape = place.pop(name)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"tensor {name}: {t.dtype} {tuple(t.shape)}, but the layout says {dtype} {shape}")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(memoryview(data))
    if place:
        raise ValueError(f"no data was given for the tensors {sorted(place)[:5]}")
    if len(shards) == 1:
        return files
    weight_map = {name: fname for fname, shard in zip(files, shards) for name, _, _ in shard}
    total = sum(_nbytes(dtype, shape) for _, dtype, shape in layout)
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files + [INDEX]


# A save writes its files into a staging directory inside the target, then commits by writing a
# journal (the new files, the old ones they replace) and applies it: moves the new files in, removes
# the old checkpoint's stale files, deletes the journal. Killed before the journal, the target holds
# the old checkpoint; killed after it, the next load or save finishes the move. Saves and loads hold
# a lock on the directory (flock: released by the kernel when a process dies).
STAGING = ".zoo-saving-"
JOURNAL = ".zoo-save-journal.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_checkpoint_file(name: str) -> bool:
    """A file of the checkpoint itself (config, weights, index), which a save may replace."""
    return name in ("config.json", SINGLE, INDEX) or SHARD.fullmatch(name) is not None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(directory: Path, *, exclusive: bool, saving: bool = False) -> Iterator[None]:
    """Hold ``directory``'s lock. A save finding it held waits for loads, but is refused when another
    save is writing there (its staging directory is present)."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        try:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                if saving and any(n.startswith(STAGING) for n in os.listdir(directory)):
                    raise CheckpointError(
                        f"{directory}: another process is saving a checkpoint there; wait for it to finish and "
                        "try again (this save wrote nothing)"
                    ) from None
                fcntl.flock(fd, mode)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise  # else: a file system without locks; go on unlocked
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_staging(path: Path) -> None:
    """Remove a staging directory of zoo's: its plain files, then the directory if that empties it."""
    for p in path.iterdir():
        if p.is_file() and not p.is_symlink():
            p.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


def _read_journal(path: Path) -> dict[str, Any]:
    try:
        plan = json.loads(regular_file(path, "save journal").read_bytes())
        names = plan["add"] + plan["remove"]
        ok = (isinstance(plan["staging"], str) and plan["staging"].startswith(STAGING) and "/" not in plan["staging"]
              and all(isinstance(n, str) and is_checkpoint_file(n) for n in names))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: not a save journal zoo wrote; remove it if you know what wrote it")
    return plan


def _apply(directory: Path, plan: dict[str, Any]) -> None:
    staging = directory / plan["staging"]
    for name in plan["add"]:
        if os.path.lexists(staging / name):
            os.replace(staging / name, directory / name)
    for name in plan["remove"]:
        if name not in plan["add"]:
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
    fsync_dir(directory)
    (directory / JOURNAL).unlink()
    fsync_dir(directory)
    if staging.is_dir():
        _remove_staging(staging)


def interrupted(directory: Path) -> bool:
    """Whether ``directory`` holds what a killed save left (a journal, a staging directory)."""
    names = os.listdir(directory)
    return any(n.startswith((STAGING, JOURNAL)) for n in names)


def recover(directory: Path) -> None:
    """Finish a save killed after it committed; remove what one killed before that left. The caller
    holds the directory's exclusive lock, so no live save owns what is found."""
    if os.path.lexists(directory / JOURNAL):
        _apply(directory, _read_journal(directory / JOURNAL))
    with contextlib.suppress(FileNotFoundError):
        (directory / (JOURNAL + ".tmp")).unlink()
    for p in directory.iterdir():
        if p.name.startswith(STAGING) and p.is_dir() and not p.is_symlink():
            _remove_staging(p)


@contextlib.contextmanager
def reading(directory: Path) -> Iterator[None]:
    """Hold ``directory`` against saves while a checkpoint is read from it, finishing an interrupted
    save first."""
    directory = Path(directory)
    if interrupted(directory):
        try:
            with _locked(directory, exclusive=True):
                recover(directory)
        except PermissionError as exc:
            raise CheckpointError(
                f"{directory}: a save into it was interrupted, and finishing it needs write access ({exc})"
            ) from None
    with _locked(directory, exclusive=False):
        yield


@contextlib.contextmanager
def replace_checkpoint(target: Path) -> Iterator[Path]:
    """Yield a staging directory; the files written there replace the checkpoint in ``target``.

    Only the checkpoint's own files (config.json, model.safetensors, model-NNNNN-of-NNNNN.safetensors,
    the index) are replaced or removed; everything else in ``target`` and its mode stay as they were.
    If anything fails before the commit, ``target`` is left exactly as it was, and a ``target`` this
    save created is removed again. A second save into the same directory at the same time is refused.
    """
    target = Path(target)
    if os.path.lexists(target) and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory")
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(target, exclusive=True, saving=True):
            recover(target)
            staging = target / f"{STAGING}{os.getpid()}-{secrets.token_hex(4)}"
            staging.mkdir()
            committed = False
            try:
                yield staging
                added = sorted(p.name for p in staging.iterdir())
                for name in added:
                    if os.path.lexists(target / name) and not (target / name).is_file():
                        raise CheckpointError(f"{target / name} is in the way of the checkpoint file {name}: "
                                              "it is not a file, so the save will not replace it")
                for name in added:
                    with open(staging / name, "rb") as f:
                        os.fsync(f.fileno())
                fsync_dir(staging)
                old = sorted(n for n in os.listdir(target) if is_checkpoint_file(n) and (target / n).is_file())
                plan = {"staging": staging.name, "add": added, "remove": old}
                tmp = target / (JOURNAL + ".tmp")
                with open(tmp, "w") as f:
                    json.dump(plan, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target / JOURNAL)  # the commit: from here on, only finishing it
                committed = True
                fsync_dir(target)
            except BaseException:
                if not committed:  # (a committed save is finished by the next load or save)
                    with contextlib.suppress(FileNotFoundError):
                        (target / (JOURNAL + ".tmp")).unlink()
                    _remove_staging(staging)
                raise
            _apply(target, plan)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                target.rmdir()  # only if it is still empty
        raise
