"""zoo: a plugin-based model zoo for decoder-only language models.

    >>> import zoo
    >>> model = zoo.build("gemma2-2b", device="meta")
    >>> zoo.list_models("llama3*")
"""

from __future__ import annotations

from zoo.hookspecs import hookimpl
from zoo.model import Decoder, LossOutput, build_model, lm_loss
from zoo.recipes import Family, build, get_spec, list_models, published_params
from zoo.registry import (
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
from zoo.spec import ModelSpec, Part, SpecError
# zoo.train, zoo.generate, zoo.verify and zoo.chat are functions; their modules are zoo.training,
# zoo.generation, zoo.verification and zoo.conversation (so `zoo.training.TrainConfig` and `zoo.train(...)` both work).
from zoo.training import TrainConfig, TrainResult, train
from zoo.verification import verify
from zoo.generation import generate
from zoo.upcycling import upcycle

__version__ = "0.1.0"


def from_pretrained(path_or_repo_id, **kw):
    """Load a Hugging Face checkpoint (directory or hub repo id); see :func:`zoo.checkpoints.from_pretrained`."""
    from zoo.checkpoints import from_pretrained as _load

    return _load(path_or_repo_id, **kw)


def save_pretrained(model, directory, **kw):
    """Write ``model`` in the Hugging Face layout; see :func:`zoo.checkpoints.save_pretrained`."""
    from zoo.checkpoints import save_pretrained as _save

    return _save(model, directory, **kw)


def chat(model, messages, tokenizer, **kw):
    """The model's reply to a conversation, through the tokenizer's chat template; see :func:`zoo.conversation.chat`."""
    from zoo.conversation import chat as _chat

    return _chat(model, messages, tokenizer, **kw)


def save_gguf(model, path, **kw):
    """Write ``model`` as a GGUF file for llama.cpp; see :func:`zoo.checkpoints.gguf_out.save_gguf`."""
    from zoo.checkpoints.gguf_out import save_gguf as _save

    return _save(model, path, **kw)


__all__ = [
    "Decoder", "DuplicateNameError", "Family", "LossOutput", "ModelSpec", "Part", "PluginError",
    "RegistryError", "SpecError", "UnknownNameError", "build", "build_model", "chat", "from_pretrained", "generate", "get", "get_spec",
    "hookimpl", "list_components", "list_models", "load_plugin", "lm_loss", "manager", "published_params", "register",
    "save_gguf", "save_pretrained", "TrainConfig", "TrainResult", "train", "upcycle", "verify",
]
