"""The Llama-style decoders: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text (and the text
model inside a gemma3 checkpoint), olmo2, olmo3, smollm3. They share tensor names and differ in fields of the spec:
norm placement and flavour, QK-norm, biases, sliding windows, soft-caps, embedding scale.

Each format is its parent plus a difference, in three declarations:

- ``fields``: the one-to-one config fields (:mod:`zoo.checkpoints.hf.fields`), read and written from one table;
- ``template``: the spec values the format always builds (a norm's flavour, the block's norm placement,
  which also picks the norms' HF names in the weight map, :func:`llama_rules`);
- ``windows`` and ``ropes``: the named readers of what is not one-to-one (which layers slide, the RoPE
  of each layer type).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from zoo.checkpoints.hf.common import (activation_name, hf_activation, layer_types_of, pattern, rope_parameters, rope_part,
                                       rope_to_hf, split_kinds)
from zoo.checkpoints.hf.fields import Field, FieldTable, TableFormat, expect, known, merged, read_fields
from zoo.checkpoints.hf.format import ConfigError, Fields
from zoo.checkpoints.hf.maps import embed_and_head, gated_mlp, layer_norms, llama_attention
from zoo.checkpoints.hf.sizes import ffn_size
from zoo.core.spec import ModelSpec

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER = "model.layers.{i}."

TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 64,
}


# -- the field tables ---------------------------------------------------------------------------

def _head_dim(spec: ModelSpec) -> int:
    att = spec.layer(0).mixer
    return att.cls.head_dim_for(att.config, spec.d_model)


def _number(x: float):
    return int(x) if float(x).is_integer() else x


def activation_field(hf: str, default: str) -> Field:
    """An HF activation name <-> the zoo activation part of the layer's FFN."""
    return Field(hf, "layer.ffn.activation", default, str, to_spec=hf_activation, to_hf=activation_name)


#: What every Llama-style config states one-to-one.
LLAMA_FIELDS = FieldTable([
    Field("hidden_size", "d_model"),
    Field("num_attention_heads", "layer.mixer.n_heads"),
    Field("num_hidden_layers", "n_layers"),
    Field("num_key_value_heads", "layer.mixer.n_kv_heads", lambda v: v["num_attention_heads"],
          source=lambda s: s.layer(0).mixer.n_kv_heads or s.layer(0).mixer.n_heads),
    Field("head_dim", "layer.mixer.head_dim", lambda v: v["hidden_size"] // v["num_attention_heads"], source=_head_dim),
    Field("max_position_embeddings", "max_seq_len", 2048),
    Field("rms_norm_eps", ("layer.norm.eps", "final_norm.eps"), 1e-6, to_spec=float),
    Field("attention_bias", ("layer.mixer.bias", "layer.mixer.out_bias"), False),
    Field("mlp_bias", "layer.ffn.bias", False),
    Field("intermediate_size", "layer.ffn.d_ff", source=ffn_size),
    activation_field("hidden_act", "silu"),
    Field("tie_word_embeddings", "head.tied", False),
    Field("vocab_size", "vocab_size"),
])

#: Gemma 2's soft-caps and query scale (Gemma 3 keeps the scale; its soft-caps are null by default).
SOFTCAPS = [
    Field("attn_logit_softcapping", "layer.mixer.softcap", None, float, to_spec=lambda v: v if v is None else float(v)),
    Field("final_logit_softcapping", "head.softcap", None, float, to_spec=lambda v: v if v is None else float(v)),
]
QUERY_SCALAR = Field("query_pre_attn_scalar", "layer.mixer.scale_dim", lambda v: v["head_dim"], float, to_spec=float,
                     source=lambda s: s.layer(0).mixer.scale_dim if s.layer(0).mixer.scale_dim is not None else _head_dim(s),
                     to_hf=_number)

#: The spec a Llama-style config always describes; a format lays its difference over it.
LLAMA_TEMPLATE: dict[str, Any] = {
    "layer": {"mixer": {"name": "attention", "qk_norm": "none"}, "ffn": {"name": "glu"},
              "norm": {"name": "rmsnorm"}, "block": {"name": "serial", "norm_position": "pre"}},
    "final_norm": {"name": "rmsnorm"},
    "embedding": {"scale": "none"},
}
GEMMA_NORM = {"unit_offset": True, "scale_in_fp32": True}
GEMMA_TEMPLATE = {"layer": {"norm": GEMMA_NORM}, "final_norm": GEMMA_NORM, "embedding": {"scale": "sqrt_d_model"}}


# -- the named readers: which layers slide, and each layer type's RoPE ------------------------------

class NoWindows:
    """Every layer attends fully (``sliding_window`` is not read)."""

    def types(self, f: Fields, n_layers: int) -> list[str]:
        return [FULL] * n_layers

    def window(self, f: Fields) -> Optional[int]:
        return f.get("sliding_window", kind=int)

    def write(self, model_type: str, cfg: dict[str, Any], types: list[str], window: Optional[int]) -> None:
        if window is not None:
            raise ValueError(f"{model_type} has no sliding-window attention")


class EveryLayer(NoWindows):
    """Mistral: ``sliding_window`` on every layer, or (null) on none."""

    def types(self, f, n_layers):
        return [SLIDING if f.get("sliding_window", kind=int) is not None else FULL] * n_layers

    def write(self, model_type, cfg, types, window):
        if window is not None and FULL in types:
            raise ValueError(f"{model_type}'s sliding window applies to every layer or to none")
        cfg["sliding_window"] = window


class LayerTypes(NoWindows):
    """``layer_types`` (sliding_attention / full_attention per layer), else ``default(f, n_layers)``."""

    def __init__(self, default: Optional[Callable[[Fields, int], list[str]]] = None):
        self.default = default or (lambda f, n: [FULL] * n)

    def types(self, f, n_layers):
        types = f.get("layer_types", kind=list)
        if types is None:
            types = self.default(f, n_layers)
        if len(types) != n_layers:
            raise f.error("layer_types", f"has {len(types)} entries for {n_layers} layers")
        for t in types:
            if t not in (SLIDING, FULL):
                raise f.error("layer_types", f"layer type {t!r} is not supported")
        return list(types)

    def write(self, model_type, cfg, types, window):
        cfg.update(sliding_window=window, layer_types=types)


class QwenWindows(LayerTypes):
    """transformers (Qwen2Config): sliding_window = sliding_window if use_sliding_window else None, and
    without layer_types, layer i slides when there is a window and i >= max_window_layers. Layers
    marked sliding get the window; with none, every layer attends fully."""

    def __init__(self):
        super().__init__(lambda f, n: [SLIDING if self.window(f) is not None and i >= f.get("max_window_layers", kind=int)
                                       else FULL for i in range(n)])

    def window(self, f):
        window = f.get("sliding_window", kind=int)
        return window if f.get("use_sliding_window", False) else None

    def types(self, f, n_layers):
        f.get("max_window_layers", kind=int)  # typed even where it decides nothing
        types = super().types(f, n_layers)
        return types if self.window(f) is not None else [FULL] * n_layers

    def write(self, model_type, cfg, types, window):
        cfg.update(use_sliding_window=window is not None, sliding_window=window, layer_types=types)
        if window is not None:
            cfg["max_window_layers"] = types.index(SLIDING)


def every(n: int, key: Optional[str] = None) -> Callable[[Fields, int], list[str]]:
    """Layer i is global when (i + 1) % n == 0 (``key``: the config field giving n, n its default)."""
    return lambda f, layers: [SLIDING if (i + 1) % (f.get(key, n) if key else n) else FULL for i in range(layers)]


class Ropes:
    """One RoPE for every layer (``rope_parameters``, or the older ``rope_theta`` / ``rope_scaling``);
    ``defaults`` fill parameters the config class defaults (``partial_rotary_factor``)."""

    def __init__(self, **defaults: Any):
        self.defaults = defaults

    def read(self, f: Fields, layer_type: str, max_pos: int) -> dict[str, Any]:
        params = rope_parameters(f, layer_type)
        for k, v in self.defaults.items():
            params.setdefault(k, v)
        return rope_part(f, params, max_pos=max_pos)

    def write(self, model_type: str, ropes: dict[str, dict[str, Any]]) -> dict[str, Any]:
        if len({repr(r) for r in ropes.values()}) > 1:
            raise ValueError(f"{model_type} uses one RoPE for every layer")
        return next(iter(ropes.values()))


class RopePerLayerType(Ropes):
    """Gemma 3: ``rope_parameters`` per layer type (older configs: ``rope_local_base_freq`` for the
    local layers, ``rope_theta`` / ``rope_scaling`` for the global ones)."""

    def read(self, f, layer_type, max_pos):
        if "rope_parameters" not in f and layer_type == SLIDING:
            return rope_part(f, {"rope_theta": f.get("rope_local_base_freq", 10000.0)}, max_pos=max_pos)
        return super().read(f, layer_type, max_pos)

    def write(self, model_type, ropes):
        full = ropes.get(FULL, ropes.get(SLIDING))
        return {SLIDING: ropes.get(SLIDING, full), FULL: full}


# -- the weight map -------------------------------------------------------------------------------

#: HF norm names -> zoo's, by the block's norm placement.
NORMS = {
    "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
    "sandwich": {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_out_norm"},
    "output": {"post_attention_layernorm": "attn_out_norm", "post_feedforward_layernorm": "ffn_out_norm"},
}


def llama_rules(norms: dict[str, str], layer: str = LAYER) -> list:
    """The Llama layout: embeddings, ``self_attn``, ``mlp``, the block's ``norms``, final norm, head."""
    return [*embed_and_head(), *llama_attention(f"{layer}self_attn."), *gated_mlp(f"{layer}mlp."),
            *layer_norms(layer, norms)]


# -- the format -----------------------------------------------------------------------------------

# zoo 0.2's class flags of LlamaStyle, each now a field, a template value or a reader.
_FLAGS = ("norm_extra", "norm_position", "qk_norm", "act_key", "act_default", "tied_default", "embed_scale",
          "qkv_bias", "mlp_bias_key", "softcaps", "query_scalar", "window_rule")


class LlamaStyle(TableFormat):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    ignore = ("model.layers.*.self_attn.rotary_emb.inv_freq", "model.rotary_emb.*", "lm_head.weight")
    fields: FieldTable = LLAMA_FIELDS
    template: dict[str, Any] = LLAMA_TEMPLATE
    windows = NoWindows()
    ropes = Ropes()
    #: fields read and left to a subclass's own reader (or to nothing); zoo 0.2's spelling of ``known(...)``.
    extra_fields: tuple[str, ...] = ()
    tiny = {**TINY, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8}}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        flags = [k for k in _FLAGS if k in vars(cls)]
        if flags:  # a format written against zoo 0.2: its flags become its table, template and readers
            from zoo.core.deprecations import warn

            warn("LlamaStyle class flags", stacklevel=3)
            _apply_flags(cls, {k: vars(cls)[k] for k in flags})

    @property
    def act_field(self) -> Field:
        """The table's field of the FFN's activation (an HF name <-> a zoo activation part)."""
        return next(x for x in self.fields if "layer.ffn.activation" in x.paths)

    def read_activation(self, f: Fields) -> dict[str, Any]:
        """The activation part the config names in :attr:`act_field` (for a second FFN or mixer that uses it)."""
        return read_fields(f, [self.act_field])["layer"]["ffn"]["activation"]

    @property
    def norm_position(self) -> str:
        return self.template["layer"]["block"].get("norm_position", "pre")

    # -- the weight-name map ------------------------------------------------------------------
    def rules(self, spec):
        return llama_rules(NORMS[self.norm_position])

    # -- config -> spec -------------------------------------------------------------------------
    def read_table(self) -> FieldTable:
        return self.fields + known(*self.extra_fields)  # extra_fields: zoo 0.2's spelling of known(...)

    def complete(self, f, data):
        """The layer kinds: which layers slide (:attr:`windows`) and the RoPE of each (:attr:`ropes`)."""
        layer, L = data.pop("layer"), data["n_layers"]
        types = self.windows.types(f, L)
        window = self.windows.window(f) if SLIDING in types else None
        if SLIDING in types and window is None:
            raise f.error("sliding_window", "layers are marked sliding_attention but no window is given")
        kinds = {SLIDING: "local", FULL: "global"} if len(set(types)) > 1 else {SLIDING: "default", FULL: "default"}
        max_pos = data.get("max_seq_len", ModelSpec.__dataclass_fields__["max_seq_len"].default)
        ropes = {t: self.ropes.read(f, t, max_pos) for t in set(types)}
        data["position"] = ropes[types[0]]
        data["layers"] = {}
        for t in dict.fromkeys(types):
            kind = {**layer, "mixer": {**layer["mixer"], **({"window": window} if t == SLIDING else {})}}
            if ropes[t] != data["position"]:
                kind["position"] = ropes[t]
            data["layers"][kinds[t]] = kind
        data["layer_pattern"] = list(pattern([kinds[t] for t in types]))

    # -- spec -> config -------------------------------------------------------------------------
    def spec_to_config(self, spec):
        cfg = super().spec_to_config(spec)
        types = layer_types_of(spec, {"sliding": SLIDING, "full": FULL})
        windows = {spec.layer(i).mixer.window for i in range(spec.n_layers)} - {None}
        self.windows.write(self.model_type, cfg, types, windows.pop() if windows else None)
        head_dim = _head_dim(spec)
        ropes = {t: rope_to_hf(spec.position_for(i), head_dim) for i, t in enumerate(types)}
        cfg["rope_parameters"] = self.ropes.write(self.model_type, ropes)
        return cfg


def _apply_flags(cls, flags: dict[str, Any]) -> None:
    """zoo 0.2's LlamaStyle flags as the table, template and readers they stand for."""
    fields, template = FieldTable(cls.fields), dict(cls.template)
    act_key = flags.get("act_key", next(x.hf for x in fields if "layer.ffn.activation" in x.paths))
    act_default = flags.get("act_default", fields[act_key].default if act_key in {x.hf for x in fields} else "silu")
    fields = FieldTable(x for x in fields if "layer.ffn.activation" not in x.paths) + [activation_field(act_key, act_default)]
    if "norm_extra" in flags:
        template = merged(template, {"layer": {"norm": flags["norm_extra"]}, "final_norm": flags["norm_extra"]})
    if "norm_position" in flags:
        template = merged(template, {"layer": {"block": {"norm_position": flags["norm_position"]}}})
    if "qk_norm" in flags:
        template = merged(template, {"layer": {"mixer": {"qk_norm": flags["qk_norm"]}}})
    if "tied_default" in flags:
        fields += [Field("tie_word_embeddings", "head.tied", flags["tied_default"])]
    if flags.get("embed_scale"):
        template = merged(template, {"embedding": {"scale": "sqrt_d_model"}})
        fields += [expect("use_bidirectional_attention", (None, False), "zoo's decoders are causal")]
    if flags.get("qkv_bias") is True and "attention_bias" in {x.hf for x in fields}:
        fields -= "attention_bias"
        template = merged(template, {"layer": {"mixer": {"bias": True, "out_bias": False}}})
    if "mlp_bias_key" in flags:
        fields = FieldTable(x for x in fields if x.hf != "mlp_bias")
        if flags["mlp_bias_key"]:
            fields += [Field(flags["mlp_bias_key"], "layer.ffn.bias", False)]
    if flags.get("softcaps"):
        fields += SOFTCAPS
    if flags.get("query_scalar"):
        fields += [QUERY_SCALAR]
    if "window_rule" in flags:
        cls.windows = {"none": NoWindows(), "all": EveryLayer(), "layer_types": LayerTypes()}[flags["window_rule"]]
    cls.fields, cls.template = fields, template


class Mistral(LlamaStyle):
    model_type, architecture = "mistral", "MistralForCausalLM"
    fields = LlamaStyle.fields - "mlp_bias"
    windows = EveryLayer()
    # MistralConfig's: a config without sliding_window slides 4096 (null: no window).
    defaults = {"sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 131072}
    tiny = {**TINY, "sliding_window": 8}


class Qwen2(LlamaStyle):
    model_type, architecture = "qwen2", "Qwen2ForCausalLM"
    fields = LlamaStyle.fields - ("mlp_bias", "attention_bias")  # q, k and v always have biases, o never
    template = merged(LlamaStyle.template, {"layer": {"mixer": {"bias": True, "out_bias": False}}})
    windows = QwenWindows()
    # Qwen2Config's: the window and where it starts apply only when use_sliding_window is true.
    defaults = {"sliding_window": 4096, "max_window_layers": 28, "num_key_value_heads": 32,
                "max_position_embeddings": 32768}
    tiny = {**TINY, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 16}}


class Qwen3(Qwen2):
    model_type, architecture = "qwen3", "Qwen3ForCausalLM"
    defaults = {**Qwen2.defaults, "head_dim": 128}
    fields = Qwen2.fields + [LLAMA_FIELDS["attention_bias"]]
    template = merged(Qwen2.template, {"layer": {"mixer": {"qk_norm": "head"}}})
    tiny = {**TINY, "attention_bias": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}


class Gemma(LlamaStyle):
    model_type, architecture = "gemma", "GemmaForCausalLM"
    defaults = {"num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192}
    fields = LlamaStyle.fields - "mlp_bias" + [
        activation_field("hidden_act", "gelu_pytorch_tanh"), Field("tie_word_embeddings", "head.tied", True),
        Field("hidden_activation", None, None),  # folded into hidden_act below
        expect("use_bidirectional_attention", (None, False), "zoo's decoders are causal")]
    template = merged(LlamaStyle.template, GEMMA_TEMPLATE)
    tiny = {**TINY, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            "max_position_embeddings": 16}

    def config_to_spec(self, config, *, strict=False):
        # Old Gemma configs name the activation twice; hidden_activation wins where given. The
        # official releases say "gelu" and mean the tanh approximation (transformers reads it so).
        act = config.get("hidden_activation") or config.get("hidden_act")
        config = {**config, "hidden_act": "gelu_pytorch_tanh" if act in (None, "gelu") else act}
        return super().config_to_spec(config, strict=strict)


class Gemma2(LlamaStyle):
    model_type, architecture = "gemma2", "Gemma2ForCausalLM"
    defaults = {"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
                "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0}
    fields = (LlamaStyle.fields - ("mlp_bias", "hidden_act")
              + [activation_field("hidden_activation", "gelu_pytorch_tanh"), Field("hidden_act", None, None),
                 Field("tie_word_embeddings", "head.tied", True), QUERY_SCALAR, *SOFTCAPS,
                 expect("use_bidirectional_attention", (None, False), "zoo's decoders are causal")])
    template = merged(LlamaStyle.template, merged(GEMMA_TEMPLATE, {"layer": {"block": {"norm_position": "sandwich"}}}))
    windows = LayerTypes(every(2))
    tiny = {**TINY, "sliding_window": 8, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0}


class Gemma3Text(Gemma2):
    model_type, architecture = "gemma3_text", "Gemma3ForCausalLM"
    template = merged(Gemma2.template, {"layer": {"mixer": {"qk_norm": "head"}}})
    fields = Gemma2.fields + known("sliding_window_pattern", "rope_local_base_freq")
    windows = LayerTypes(every(6, "sliding_window_pattern"))
    ropes = RopePerLayerType()
    # Gemma3TextConfig's: the text_config of a released gemma3 checkpoint gives only what differs.
    defaults = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}
    ignore = LlamaStyle.ignore + ("vision_tower.*", "multi_modal_projector.*", "model.vision_tower.*",
                                  "model.multi_modal_projector.*")
    tiny = {**TINY, "sliding_window": 8, "query_pre_attn_scalar": 24,
            "layer_types": [SLIDING, FULL],
            "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                FULL: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}}


class Gemma3(Gemma3Text):
    """A gemma3 (multimodal) checkpoint: its text model, under ``text_config`` and ``language_model``."""

    model_type, architecture = "gemma3", "Gemma3ForConditionalGeneration"
    tiny = {}

    def unwrap(self, config):
        text = config.get("text_config") or {}
        if not isinstance(text, dict):
            raise ConfigError("text_config", f"must be a JSON object, got {type(text).__name__}", self.model_type)
        text = dict(text)
        text.setdefault("model_type", "gemma3_text")
        renames = {"language_model.model.": "model.", "model.language_model.": "model.",
                   "language_model.lm_head.": "lm_head."}
        return text, renames

    def config_to_spec(self, config, *, strict=False):
        text, _ = self.unwrap(config) if "text_config" in config else (config, None)
        return Gemma3Text.config_to_spec(self, text, strict=strict)


class Olmo2(LlamaStyle):
    model_type, architecture = "olmo2", "Olmo2ForCausalLM"
    defaults = {"rms_norm_eps": 1e-5}
    fields = LlamaStyle.fields - "mlp_bias"
    template = merged(LlamaStyle.template, {"layer": {"norm": {"scale_in_fp32": True},
                                                      "block": {"norm_position": "output"},
                                                      "mixer": {"qk_norm": "proj"}},
                                            "final_norm": {"scale_in_fp32": True}})
    tiny = {**TINY, "attention_bias": True}


class Olmo3Ropes(RopePerLayerType):
    """OLMo 3 (Olmo3Config): ``rope_parameters`` per layer type; in the older spelling ``rope_scaling``
    applies to the full-attention layers only and ``rope_theta`` to both."""

    def read(self, f, layer_type, max_pos):
        if "rope_parameters" in f:
            params = f.get("rope_parameters", kind=dict)
            if SLIDING in params or FULL in params:  # nested: a missing type is default RoPE at the default base
                own = params.get(layer_type) or {"rope_type": "default"}
                return rope_part(f, {"rope_theta": f.get("rope_theta", 500000.0), **rope_parameters(f, layer_type),
                                     **own}, max_pos=max_pos, where=f"rope_parameters.{layer_type}")
            return rope_part(f, dict(params), max_pos=max_pos)
        if layer_type == SLIDING:
            return rope_part(f, {"rope_theta": f.get("rope_theta", 500000.0)}, max_pos=max_pos)
        return Ropes.read(self, f, layer_type, max_pos)


class Olmo3(Olmo2):
    """OLMo 3: OLMo 2's layers, sliding windows on three layers of four (the fourth full), a RoPE per
    layer type."""

    model_type, architecture = "olmo3", "Olmo3ForCausalLM"
    windows = LayerTypes(every(4))
    ropes = Olmo3Ropes()
    defaults = {"rms_norm_eps": 1e-5, "sliding_window": 4096, "rope_theta": 500000.0}
    tiny = {**TINY, "num_hidden_layers": 4, "attention_bias": True, "sliding_window": 8,
            "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                FULL: {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 16}}}


class SmolLM3Windows(QwenWindows):
    """SmolLM3 (SmolLM3Config): ``sliding_window`` applies only with ``use_sliding_window``; without
    ``layer_types`` the NoPE layers slide (:func:`rope_layers`)."""

    def __init__(self):
        LayerTypes.__init__(self, lambda f, n: [SLIDING if self.window(f) is not None and not rope else FULL
                                                for rope in rope_layers(f, n)])

    def types(self, f, n_layers):
        types = LayerTypes.types(self, f, n_layers)
        return types if self.window(f) is not None else [FULL] * n_layers

    def write(self, model_type, cfg, types, window):
        cfg.update(use_sliding_window=window is not None, sliding_window=window, layer_types=types)


def rope_layers(f: Fields, n_layers: int) -> list[int]:
    """SmolLM3's ``no_rope_layers``: 1 where a layer rotates, 0 where it has no position (NoPE); by
    default every ``no_rope_layer_interval``-th layer (4) is NoPE."""
    flags = f.get("no_rope_layers", kind=list)
    interval = f.positive("no_rope_layer_interval", 4)
    if flags is None:
        return [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(flags) != n_layers or any(x not in (0, 1) or isinstance(x, bool) for x in flags):
        raise f.error("no_rope_layers", f"must list 0 (NoPE) or 1 (RoPE) for each of the {n_layers} layers, got {flags!r}")
    return list(flags)


NOPE = {"position": {"name": "nope"}}


class SmolLM3(LlamaStyle):
    """SmolLM3: Llama's layers with no position encoding (NoPE) on every fourth (``no_rope_layers``)."""

    model_type, architecture = "smollm3", "SmolLM3ForCausalLM"
    fields = LlamaStyle.fields + [Field("tie_word_embeddings", "head.tied", True)] + known("no_rope_layer_interval")
    windows = SmolLM3Windows()
    defaults = {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 2000000.0}
    tiny = {**TINY, "num_hidden_layers": 4, "no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 8,
            "attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

    def complete(self, f, data):
        super().complete(f, data)
        flags = rope_layers(f, data["n_layers"])
        split_kinds(data, ["rope" if r else "nope" for r in flags], {"nope": NOPE})

    def spec_to_config(self, spec):
        flags = [int(spec.position_for(i).name != "nope") for i in range(spec.n_layers)]
        data = spec.to_dict()
        for layer in data["layers"].values():
            if isinstance(layer.get("position"), dict) and layer["position"].get("name") == "nope":
                del layer["position"]  # the rotation the other layers have; no_rope_layers says where it is off
        cfg = super().spec_to_config(ModelSpec.from_dict(data))
        cfg.update(no_rope_layers=flags, no_rope_layer_interval=4)
        return cfg


FORMATS = [LlamaStyle(), Mistral(), Qwen2(), Qwen3(), Gemma(), Gemma2(), Gemma3Text(), Gemma3(), Olmo2(), Olmo3(), SmolLM3()]
