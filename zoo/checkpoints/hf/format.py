"""Checkpoint formats: one per HF ``model_type``, registered under registry kind ``checkpoint_format``.

A format turns an HF ``config.json`` into a :class:`~zoo.core.spec.ModelSpec` and back, and owns the
one two-way weight-name map of its ``model_type`` (:mod:`zoo.checkpoints.hf.maps`).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Optional

from zoo.core import registry as _registry
from zoo.checkpoints.hf.maps import Rule
from zoo.core.spec import MAX_SIZES, ModelSpec


class CheckpointError(ValueError):
    """A checkpoint (directory, config or weights) that zoo cannot load as asked."""


class ConfigError(CheckpointError):
    """An HF config field that the spec cannot express, or a missing or invalid one."""

    def __init__(self, field: str, message: str, model_type: str = ""):
        self.field = field
        where = f" ({model_type})" if model_type else ""
        super().__init__(f"config.json field {field!r}{where}: {message}")


# Fields every transformers config carries that say nothing about the architecture (token ids,
# generation defaults, bookkeeping, dropout that is off at inference; auto_map names remote code that
# zoo never runs, and transformers builds its own class for these model_types).
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
_attn_implementation auto_map
""".split())


# Fields transformers' loading code acts on for every model_type, and which zoo cannot express.
REFUSED = {
    "quantization_config": "the weights are quantized: read the config with zoo.checkpoints.config_to_spec "
                           "or load it with from_pretrained, which take the field off and dequantize fp8 weights",
}


def _is_dropout(key: str) -> bool:
    return "dropout" in key or key.endswith("_pdrop")


# The sizes a format reads and builds per-layer lists or tables from, bounded as they are read (the
# spec's own bounds apply only to the finished spec): HF key -> zoo's limit.
BOUNDED = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), MAX_SIZES["n_layers"]),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), MAX_SIZES["d_model"]),
    "vocab_size": MAX_SIZES["vocab_size"],
}

# Counts that divide or size something, so must be at least 1 when stated.
COUNTS = frozenset(("num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "hidden_size", "n_embd",
                    "vocab_size"))

# What a JSON value must be, by the Python type a field's default has.
KINDS = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string",
         list: "a list", dict: "an object"}

# The fields of the configs read in this context that neither transformers nor zoo reads.
_IGNORED: ContextVar[Optional[list[str]]] = ContextVar("zoo_ignored_config_fields", default=None)


@contextlib.contextmanager
def collect_ignored() -> Iterator[list[str]]:
    """Collect the names of config fields that the readers run inside the block leave unread."""
    token = _IGNORED.set([])
    try:
        yield _IGNORED.get()
    finally:
        _IGNORED.reset(token)


def is_kind(value: Any, kind: type) -> bool:
    """JSON typing: an integer is a number, a boolean is neither."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


class Fields:
    """Reading of an HF config as transformers reads it: every field is either interpreted, refused
    by name, or one transformers ignores too (kept, and listed in :attr:`ignored`).

    Values are typed: a field read with a default must have the default's JSON type (an integer
    where a number belongs is fine), or the ``kind`` given. ``"no"`` is not a boolean and ``"2048"``
    not an integer.
    """

    def __init__(self, config: dict[str, Any], model_type: str, defaults: Optional[dict[str, Any]] = None):
        if not isinstance(config, dict):
            raise ConfigError("config", f"must be a JSON object, got {type(config).__name__}", model_type)
        self.config = dict(config)
        self.model_type = model_type
        self.defaults = dict(defaults or {})  # transformers' defaults for absent fields (not for null ones)
        self.used: set[str] = set()
        self.ignored: list[str] = []
        self.values: dict[str, Any] = {}  # what read_fields read, by HF key (for defaults that depend on it)

    def _value(self, key: str) -> Any:
        return self.config[key] if key in self.config else self.defaults.get(key)

    def __contains__(self, key: str) -> bool:
        """Whether the config sets ``key`` (to anything but null); does not mark it read."""
        return self._value(key) is not None

    def get(self, key: str, default: Any = None, kind: Optional[type] = None) -> Any:
        """Mark ``key`` read and return its value (``default`` when absent or null)."""
        self.used.add(key)
        value = self._value(key)
        if value is None:
            return default
        kind = kind or (type(default) if default is not None else None)
        if kind is not None and not is_kind(value, kind):
            raise self.error(key, f"must be {KINDS.get(kind, kind.__name__)}, got {value!r} (zoo does not coerce it)")
        if key in COUNTS and is_kind(value, int) and value < 1:  # a divisor: 0 heads is no ZeroDivisionError
            raise self.error(key, f"must be a positive integer, got {value}")
        limit = BOUNDED.get(key)
        if limit is not None and is_kind(value, int) and value > limit:  # before any per-layer list is made
            raise self.error(key, f"{value} is beyond zoo's limit of {limit:,} (larger than any model it describes); "
                                  "check the value")
        return value

    def require(self, key: str, kind: type = int) -> Any:
        """Mark ``key`` read and return its value (an integer unless ``kind`` says otherwise); absent
        or null is a :class:`ConfigError` naming it."""
        self.used.add(key)
        if self._value(key) is None:
            raise self.error(key, "is required and missing")
        return self.get(key, kind=kind)

    def positive(self, key: str, default: Any = None) -> int:
        """An integer that must be at least 1 (a count, a period, a divisor): ``require`` it when
        ``default`` is None, else ``get`` it; 0 or less is an error naming ``key``."""
        value = self.require(key) if default is None else self.get(key, default, kind=int)
        if value < 1:
            raise self.error(key, f"must be a positive integer, got {value}")
        return value

    def expect(self, key: str, allowed: Any, why: str = "") -> Any:
        """Read ``key`` (absent counts as its default ``allowed[0]``) and fail unless it is allowed."""
        allowed = allowed if isinstance(allowed, (tuple, list)) else (allowed,)
        value = self.get(key, allowed[0])
        if not any(value == a and (a is None or is_kind(value, type(a))) for a in allowed):
            raise self.error(key, f"value {value!r} is not supported{': ' + why if why else ''}")
        return value

    def error(self, key: str, message: str) -> ConfigError:
        """A :class:`ConfigError` naming ``key`` and this model_type, for the format to raise."""
        return ConfigError(key, message, self.model_type)

    def finish(self, strict: bool = False) -> None:
        """Refuse what zoo cannot express; keep the other unread fields as ignored.

        transformers' modelling code does not read a field its config class does not declare, so a
        field no reader asked for changes nothing in the model (each format reads every field of its
        transformers config class: tests/formats/test_released_configs.py checks it). ``strict=True``
        refuses such fields too, for whoever wants to hear of a misspelt or unfamiliar field. A
        dropout rate (any field named ``*dropout*`` or ``*_pdrop``) is off at inference and never
        changes the function, so it is accepted either way.
        """
        for key, why in REFUSED.items():
            if key in self.config and key not in self.used:
                raise self.error(key, why)
        self.ignored = sorted(k for k in self.config if k not in self.used and k not in GENERIC_FIELDS
                              and not _is_dropout(k))
        if self.ignored and strict:
            raise self.error(
                self.ignored[0],
                f"zoo's {self.model_type} format does not read this field, and neither does transformers' "
                f"(unread: {', '.join(self.ignored)}). Load without strict=True to accept and keep it.",
            )
        collected = _IGNORED.get()
        if collected is not None:
            collected.extend(self.ignored)


class CheckpointFormat:
    """Base class: subclasses set ``model_type`` and ``architecture`` and implement the three methods."""

    model_type: str = ""
    architecture: str = ""
    # fnmatch patterns of HF tensors that carry nothing zoo needs (RoPE caches, causal-mask buffers).
    ignore: tuple[str, ...] = ()
    # Checkpoints of the bare base model (GPT-2's own files, say) store names without this prefix.
    base_prefix: str = "model."
    # transformers' defaults for fields a config may leave out, where they differ from the reader's
    # own fallbacks (a text_config inside a multimodal config gives only what differs).
    defaults: dict[str, Any] = {}
    #: Spec paths this model_type's config has no field for (``max_seq_len``, ``layers.*.mixer.width``):
    #: the spec read back from a saved config takes the format's default there, and save_pretrained's
    #: check that the config describes the model compares everything else.
    not_stored: tuple[str, ...] = ()

    def config_to_spec(self, config: dict[str, Any], *, strict: bool = False) -> ModelSpec:
        """The spec ``config`` (an HF config.json as a dict) describes. Read every field through
        :class:`Fields` and end with ``fields.finish(strict)``, which refuses what zoo cannot express
        (and, when ``strict``, every field nobody read)."""
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
    #: Buffers (by the end of their name) ``make_tiny`` draws at random: those holding free values
    #: (DeepSeek-V3's selection bias), not tables derived from other tensors (MiniMax's decay tables).
    random_buffers: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<checkpoint format {self.model_type}>"


@_registry.interface("checkpoint_format")
def _format_check(obj: Any) -> list[str]:
    missing = []
    for name in ("config_to_spec", "spec_to_config", "rules"):
        if not callable(getattr(obj, name, None)):
            missing.append(f"a `{name}` method")
    return missing


def layout_of(config: dict[str, Any]) -> Optional[str]:
    """The format of a config.json that has no ``model_type`` but a layout some format recognises
    (its ``recognises(config)``: ``mamba_ssm``'s own configs, say), or None."""
    for name in _registry.registry("checkpoint_format").names():
        recognises = getattr(_registry.get("checkpoint_format", name), "recognises", None)
        if callable(recognises) and recognises(config):
            return name
    return None


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
