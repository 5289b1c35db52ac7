"""zoo: a plugin-based model zoo for decoder-only language models.

    >>> import zoo
    >>> model = zoo.build("gemma2-2b", device="meta")
    >>> zoo.list_models("llama3*")
"""

from __future__ import annotations

from zoo.core import deprecations as _deprecations

_deprecations.install()  # zoo.training, zoo.spec, ...: the old module paths, which warn

from zoo.core.hooks import hookimpl
from zoo.model.decoder import Decoder, build_model
from zoo.model.loss import LossOutput, lm_loss
from zoo.core.spec import Family
from zoo.model.recipes import build, get_spec, list_models, published_params
from zoo.core.registry import (
    DuplicateNameError,
    PluginError,
    RegistryError,
    UnknownNameError,
    get,
    list_components,
    load_plugin,
    manager,
    register,
)
from zoo.core.spec import ModelSpec, Part, SpecError
# zoo.train, zoo.generate and zoo.verify are functions; their modules are zoo.training.loop,
# zoo.inference.generate and zoo.tools.verification (import those by their full path).
from zoo.training.config import TrainConfig, TrainResult
from zoo.training.loop import train

_deprecations.install_train_package()  # zoo 0.2's zoo.train.loop, zoo.train.config, ...: shims that warn
from zoo.tools.verification import verify
from zoo.inference.generate import generate
from zoo.tools.upcycling import upcycle

__version__ = "0.2.0"


def __getattr__(name):
    # zoo.registry, zoo.training, ...: modules that moved into the wings; their old paths are shims
    # that warn and name the new one (zoo.core.deprecations.MOVED_MODULES).
    import importlib

    from zoo.core.deprecations import MOVED_MODULES

    if f"zoo.{name}" in MOVED_MODULES:
        return importlib.import_module(f"zoo.{name}")
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")


def from_pretrained(path_or_repo_id, **kw):
    """Load a Hugging Face checkpoint (directory or hub repo id); see :func:`zoo.checkpoints.from_pretrained`."""
    from zoo.checkpoints import from_pretrained as _load

    return _load(path_or_repo_id, **kw)


def merge_adapter(model):
    """Fold a model's LoRA adapter into its weights; see :func:`zoo.checkpoints.adapter.merge_adapter`."""
    from zoo.checkpoints.adapter import merge_adapter as _merge

    return _merge(model)


def save_adapter(model, directory, **kw):
    """Write a model's LoRA adapter as a PEFT adapter directory; see :func:`zoo.checkpoints.adapter.save_adapter`."""
    from zoo.checkpoints.adapter import save_adapter as _save

    return _save(model, directory, **kw)


def save_pretrained(model, directory, **kw):
    """Write ``model`` in the Hugging Face layout; see :func:`zoo.checkpoints.save_pretrained`."""
    from zoo.checkpoints import save_pretrained as _save

    return _save(model, directory, **kw)


def chat(model, messages, tokenizer, **kw):
    """The model's reply to a conversation, through the tokenizer's chat template; see :func:`zoo.inference.conversation.chat`."""
    from zoo.inference.conversation import chat as _chat

    return _chat(model, messages, tokenizer, **kw)


def save_gguf(model, path, **kw):
    """Write ``model`` as a GGUF file for llama.cpp; see :func:`zoo.checkpoints.files.gguf_out.save_gguf`."""
    from zoo.checkpoints.files.gguf_out import save_gguf as _save

    return _save(model, path, **kw)


__all__ = [
    "Decoder", "DuplicateNameError", "Family", "LossOutput", "ModelSpec", "Part", "PluginError",
    "RegistryError", "SpecError", "UnknownNameError", "build", "build_model", "chat", "from_pretrained", "generate", "get", "get_spec",
    "hookimpl", "list_components", "list_models", "load_plugin", "lm_loss", "manager", "published_params", "register",
    "merge_adapter", "save_adapter", "save_gguf", "save_pretrained", "TrainConfig", "TrainResult", "train", "upcycle", "verify",
]
