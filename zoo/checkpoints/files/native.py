"""zoo's own checkpoint layout, for a model no Hugging Face format describes (a Llama with
multi-token prediction, GPT-3, PaLM): the spec as ``spec.toml`` beside ``model.safetensors`` under
zoo's own parameter names, with the tokenizer files where known. ``zoo train`` exports such a model
this way to ``out_dir/final``; :func:`zoo.from_pretrained` loads it (or the run directory holding
it); :func:`zoo.checkpoints.sources.open_source` finds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors.torch import load_model

from zoo.checkpoints.files.io import replace_checkpoint, stream_shards
from zoo.core.spec import ModelSpec
from zoo.model.decoder import build_model

SPEC_FILE = "spec.toml"
WEIGHTS_FILE = "model.safetensors"
RUN_EXPORT = "final"  # where zoo train writes a run's weights


def checkpoint_dir(directory: str | Path) -> Path:
    """``directory``, or the export of a training run (``out_dir/final``) when it is a run directory."""
    directory = Path(directory)
    final = directory / RUN_EXPORT
    if not (directory / "config.json").exists() and not (directory / SPEC_FILE).exists() and final.is_dir():
        return final
    return directory


def unfinished_run(directory: Path) -> str:
    """What to say about a training run directory that has checkpoints but no export yet."""
    if (directory / "adapter" / "adapter_config.json").is_file():  # a LoRA run that wrote no merged model
        return (f"{directory} is a LoRA run that wrote its adapter ({directory / 'adapter'}) and no merged "
                f"{RUN_EXPORT}/ export (lora.merge = false): load the base with the adapter, "
                f"zoo.from_pretrained(BASE, adapter={str(directory / 'adapter')!r})")
    return (f"{directory} is a training run without its {RUN_EXPORT}/ export yet (the run has not finished): "
            f"finish it with the same zoo train command (it resumes from {directory / 'checkpoints'}), which "
            f"exports at the end")


def is_native(directory: str | Path) -> bool:
    """Whether ``directory`` holds zoo's own layout (a spec.toml and no HF config.json)."""
    directory = Path(directory)
    return directory.is_dir() and (directory / SPEC_FILE).is_file() and not (directory / "config.json").exists()


def save_native(model, directory: str | Path, *, state: Optional[Mapping[str, torch.Tensor]] = None) -> Path:
    """Write ``model`` in zoo's own layout: ``spec.toml`` and ``model.safetensors`` (replacing only
    those, atomically, as :func:`zoo.save_pretrained` replaces its own files).

    The tensors are written one at a time (:func:`zoo.checkpoints.files.io.stream_shards`), so a save holds
    about one tensor beyond the weights. ``state`` gives the weights by name when they are not
    ``model``'s own (``model`` may then be on the meta device), as for :func:`zoo.save_pretrained`: a
    training checkpoint's :class:`zoo.training.checkpointer.CheckpointWeights` is read tensor by tensor,
    never gathered whole. Tied parameters are stored once, under the name safetensors' ``save_model``
    keeps (the first in sorted order), so that ``load_model`` reads the file either way."""
    groups: dict[int, list[str]] = {}  # one entry per distinct tensor: the names it goes by
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    kept = {min(names): sorted(names)[1:] for names in groups.values()}
    if state is None:
        state = {name: t.detach() for name, t in model.state_dict().items()}
    meta = getattr(state, "meta", lambda name: state[name].to("meta"))  # dtype and shape, not the data
    layout = [(name, meta(name).dtype, tuple(meta(name).shape)) for name in kept]
    tied = {alias: name for name, aliases in kept.items() for alias in aliases}
    with replace_checkpoint(Path(directory)) as tmp:
        stream_shards(layout, ((name, state[name]) for name in kept), tmp, max_shard_size=None, metadata=tied)
        (tmp / SPEC_FILE).write_text(model.spec.to_toml())
    return Path(directory)


def load_native(directory: str | Path, *, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device | str] = None):
    """The model a :func:`save_native` directory holds."""
    directory = Path(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{directory} has {SPEC_FILE} but no {WEIGHTS_FILE}; it holds a spec, not weights "
                                "(zoo.build builds it with fresh weights)")
    spec = ModelSpec.from_file(directory / SPEC_FILE)
    model = build_model(spec, device="meta").to_empty(device="cpu")
    try:
        load_model(model, str(weights), strict=True)
    except RuntimeError as exc:  # missing, unexpected or misshapen tensors
        raise ValueError(f"{weights} does not hold the weights {directory / SPEC_FILE} describes ({exc})") from None
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()
