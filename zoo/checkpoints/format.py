"""Checkpoint formats: one per HF ``model_type``, registered under registry kind ``checkpoint_format``.

A format turns an HF ``config.json`` into a :class:`~zoo.spec.ModelSpec` and back, and owns the
one two-way weight-name map of its ``model_type`` (:mod:`zoo.checkpoints.maps`).
"""

from __future__ import annotations

from typing import Any, Optional

from zoo import registry as _registry
from zoo.checkpoints.maps import Rule
from zoo.spec import ModelSpec


class CheckpointError(ValueError):
    """A checkpoint (directory, config or weights) that zoo cannot load as asked."""


class ConfigError(CheckpointError):
    """An HF config field that the spec cannot express, or a missing or invalid one."""

    def __init__(self, field: str, message: str, model_type: str = ""):
        self.field = field
        where = f" ({model_type})" if model_type else ""
        super().__init__(f"config.json field {field!r}{where}: {message}")


# Fields every transformers config carries that say nothing about the architecture (token ids,
# generation defaults, bookkeeping, dropout that is off at inference).
GENERIC_FIELDS = frozenset("""
transformers_version architectures output_hidden_states return_dict dtype torch_dtype
chunk_size_feed_forward is_encoder_decoder id2label label2id problem_type _name_or_path model_type
output_attentions use_cache pad_token_id bos_token_id eos_token_id sep_token_id
decoder_start_token_id initializer_range tokenizer_class prefix task_specific_params
finetuning_task torchscript pruned_heads tie_encoder_decoder use_return_dict
max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores
return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
exponential_decay_length_penalty suppress_tokens begin_suppress_tokens tf_legacy_loss
is_decoder use_bfloat16 xla_device gradient_checkpointing attention_dropout hidden_dropout resid_pdrop
embd_pdrop attn_pdrop classifier_dropout summary_type summary_use_proj summary_activation
summary_proj_to_labels summary_first_dropout initializer_factor pretraining_tp cache_implementation
_attn_implementation
""".split())


def _is_dropout(key: str) -> bool:
    return "dropout" in key or key.endswith("_pdrop")


class Fields:
    """Strict reading of an HF config: every field is either used, generic, or an error."""

    def __init__(self, config: dict[str, Any], model_type: str):
        self.config = dict(config)
        self.model_type = model_type
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        """Whether the config sets ``key`` (to anything but null); does not mark it read."""
        return self.config.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """Mark ``key`` read and return its value (``default`` when absent or null)."""
        self.used.add(key)
        value = self.config.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        """Mark ``key`` read and return its value; absent or null is a :class:`ConfigError` naming it."""
        self.used.add(key)
        if self.config.get(key) is None:
            raise self.error(key, "is required and missing")
        return self.config[key]

    def expect(self, key: str, allowed: Any, why: str = "") -> Any:
        """Read ``key`` (absent counts as its default ``allowed[0]``) and fail unless it is allowed."""
        allowed = allowed if isinstance(allowed, (tuple, list)) else (allowed,)
        value = self.get(key, allowed[0])
        if value not in allowed:
            raise self.error(key, f"value {value!r} is not supported{': ' + why if why else ''}")
        return value

    def error(self, key: str, message: str) -> ConfigError:
        """A :class:`ConfigError` naming ``key`` and this model_type, for the format to raise."""
        return ConfigError(key, message, self.model_type)

    def finish(self, strict: bool = True) -> None:
        """Refuse (when ``strict``) every field nobody read with :meth:`get` / :meth:`require` /
        :meth:`expect` and that is neither generic nor a dropout rate (off at inference, so it never
        changes the function: any field named ``*dropout*`` or ``*_pdrop`` is accepted)."""
        unknown = sorted(k for k in self.config if k not in self.used and k not in GENERIC_FIELDS
                         and not _is_dropout(k))
        if unknown and strict:
            raise self.error(
                unknown[0],
                f"zoo's {self.model_type} format does not know this field, so it cannot tell whether "
                f"the model it describes is the one zoo would build (unknown: {', '.join(unknown)}). "
                "If the field is harmless, load with strict=False.",
            )


class CheckpointFormat:
    """Base class: subclasses set ``model_type`` and ``architecture`` and implement the three methods."""

    model_type: str = ""
    architecture: str = ""
    # fnmatch patterns of HF tensors that carry nothing zoo needs (RoPE caches, causal-mask buffers).
    ignore: tuple[str, ...] = ()
    # Checkpoints of the bare base model (GPT-2's own files, say) store names without this prefix.
    base_prefix: str = "model."

    def config_to_spec(self, config: dict[str, Any], *, strict: bool = True) -> ModelSpec:
        """The spec ``config`` (an HF config.json as a dict) describes. Read every field through
        :class:`Fields` and end with ``fields.finish(strict)``, which refuses the fields nobody read."""
        raise NotImplementedError

    def spec_to_config(self, spec: ModelSpec) -> dict[str, Any]:
        """The HF config fields of ``spec`` (zoo adds ``model_type`` and ``architectures``). Raise
        ValueError for a spec the format cannot express; save_pretrained also reads the result
        back with :meth:`config_to_spec` and refuses any difference."""
        raise NotImplementedError

    def rules(self, spec: ModelSpec) -> list[Rule]:
        """The weight-name map (may depend on the spec: Falcon's norm names, say)."""
        raise NotImplementedError

    def unwrap(self, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The language-model config inside ``config`` and prefix renames for its tensors
        (a multimodal checkpoint keeps its text model under another prefix)."""
        return config, {}

    #: A small HF config of this model_type that reaches its tricky paths (``zoo verify --tiny``).
    tiny: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<checkpoint format {self.model_type}>"


@_registry.interface("checkpoint_format")
def _format_check(obj: Any) -> list[str]:
    missing = []
    for name in ("config_to_spec", "spec_to_config", "rules"):
        if not callable(getattr(obj, name, None)):
            missing.append(f"a `{name}` method")
    return missing


def get_format(model_type: Optional[str]) -> CheckpointFormat:
    if not model_type:
        raise CheckpointError("config.json has no 'model_type': zoo cannot tell which format it is")
    try:
        return _registry.get("checkpoint_format", model_type)
    except _registry.UnknownNameError:
        known = ", ".join(_registry.registry("checkpoint_format").names())
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: zoo has no checkpoint format for it. Supported: {known}. "
            "A plugin can add one (registry kind 'checkpoint_format')."
        ) from None
