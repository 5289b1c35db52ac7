"""The one door for checkpoint files: :func:`open_source` looks once at what a path or hub id names
and returns a :class:`Source` saying what it found, which every reader and command takes.

The containers are a table (:data:`CONTAINERS`): an HF checkpoint directory (``config.json`` and
safetensors, local or from the hub), zoo's own layout (``spec.toml`` and ``model.safetensors``,
:mod:`zoo.checkpoints.files.native`), and a GGUF file (:mod:`zoo.checkpoints.files.gguf`); a training
run's directory opens as its export (``final/``). A new container is a row of the table and a branch
of :func:`find`; no reader changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from zoo.checkpoints.files import gguf, native
from zoo.checkpoints.files.hub import resolve
from zoo.checkpoints.hf.config import config_to_spec, read_config
from zoo.checkpoints.hf.format import CheckpointError
from zoo.core.spec import ModelSpec
from zoo.model import recipes


@dataclass(frozen=True)
class Container:
    """A kind of checkpoint file: how its config (None: it has none) and its spec are read, and
    whether it holds a tokenizer."""

    name: str
    config: Callable[[Path], Optional[dict[str, Any]]]
    spec: Callable[[Path], ModelSpec]
    holds_tokenizer: Callable[[Path], bool] = lambda path: (path / "tokenizer.json").is_file()


CONTAINERS = {
    "hf": Container("hf", read_config, lambda path: config_to_spec(read_config(path))),
    "native": Container("native", lambda path: None, lambda path: ModelSpec.from_file(path / native.SPEC_FILE)),
    "gguf": Container("gguf", lambda path: gguf.GGUFFile(path).config(),
                      lambda path: config_to_spec(gguf.GGUFFile(path).config()),
                      lambda path: True),  # in its metadata (a file without one is refused when it is read)
}


@dataclass(frozen=True)
class Source:
    """What :func:`open_source` found: ``kind`` (a key of :data:`CONTAINERS`: ``"hf"``, ``"native"``,
    ``"gguf"``), ``path`` (the GGUF file, or the directory holding the files), ``given`` (what was
    asked for) and ``run`` (the training run directory, when ``path`` is its export)."""

    kind: str
    path: Path
    given: Any = None
    run: Optional[Path] = None

    def config(self) -> Optional[dict[str, Any]]:
        """The HF-style config (from ``config.json`` or the GGUF metadata); None for zoo's own layout."""
        return CONTAINERS[self.kind].config(self.path)

    def spec(self) -> ModelSpec:
        """The spec of the model the files hold, without reading its weights."""
        return CONTAINERS[self.kind].spec(self.path)

    @property
    def weights(self) -> Path:
        """Where the tensors are: the GGUF file, or the directory of safetensors files."""
        return self.path

    def holds_tokenizer(self) -> bool:
        """Whether the files include a tokenizer (:attr:`tokenizer`)."""
        return CONTAINERS[self.kind].holds_tokenizer(self.path)

    @property
    def tokenizer(self) -> Path:
        """Where the tokenizer is (``zoo.inference.tokenizer.Tokenizer`` reads it): the GGUF file's
        metadata, or the directory's ``tokenizer.json``."""
        return self.path


def find(path: str | Path) -> Optional[Source]:
    """The checkpoint at the local ``path``, without downloading: a GGUF file (or a directory holding
    one), zoo's own layout, an HF directory, or a training run's export; None when ``path`` is none
    of these. A training run without its export is a CheckpointError that says how to finish it."""
    if gguf.is_gguf(path):
        return Source("gguf", gguf.gguf_file(path), path)
    given = Path(path)
    if not given.is_dir():
        return None
    found = native.checkpoint_dir(given)
    run = given if found != given else None
    if native.is_native(found):
        return Source("native", found, path, run)
    if (found / "config.json").exists():
        return Source("hf", found, path, run)
    if (found / "checkpoints").is_dir():
        raise CheckpointError(native.unfinished_run(found))
    return None


def open_source(path_or_id: str | Path | Source, *, revision: Optional[str] = None, token: Any = None,
                cache_dir: Optional[str] = None) -> Source:
    """The checkpoint ``path_or_id`` names: a local one (:func:`find`), or else an HF checkpoint
    directory on the hub (downloaded, or found in the cache). A :class:`Source` is returned as it is."""
    if isinstance(path_or_id, Source):
        return path_or_id
    found = find(path_or_id)
    if found is not None:
        return found
    return Source("hf", resolve(path_or_id, revision=revision, token=token, cache_dir=cache_dir), path_or_id)


def _is_hf_config(path: Path) -> bool:
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # not a config: the recipe reader names why
        return False
    return isinstance(data, dict) and "model_type" in data


def spec_of(source: Any) -> Optional[ModelSpec]:
    """The spec of a checkpoint named by path, without its weights: a GGUF file, an HF checkpoint
    directory or its ``config.json`` (read as transformers reads it), zoo's own layout, or a training
    run directory (its export). None when ``source`` is none of these (a preset name, a recipe file)."""
    if isinstance(source, Source):
        return source.spec()
    if not isinstance(source, (str, Path)):
        return None
    try:
        found = find(source)
    except CheckpointError as exc:  # a run without its export
        raise FileNotFoundError(str(exc)) from None
    if found is not None:
        return found.spec()
    path = Path(source)
    if _is_hf_config(path):
        return config_to_spec(read_config(path.parent) if path.name == "config.json" else json.loads(path.read_text()))
    return None


# get_spec and build (zoo.model.recipes, a wing below this one) read a checkpoint's spec through this
recipes.add_spec_reader(spec_of)
