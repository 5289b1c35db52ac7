"""The Llama-style decoders: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text (and the text
model inside a gemma3 checkpoint), olmo2. They share tensor names and differ in fields of the spec:
norm placement and flavour, QK-norm, biases, sliding windows, soft-caps, embedding scale."""

from __future__ import annotations

from typing import Any

from zoo.checkpoints.common import activation, activation_name, layer_types_of, pattern, rope_parameters, rope_part, rope_to_hf
from zoo.checkpoints.format import CheckpointFormat, ConfigError, Fields
from zoo.checkpoints.sizes import ffn_size
from zoo.checkpoints.maps import ZOO_LAYER, ZOO_MIXER, rule
from zoo.core.spec import ModelSpec

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER = "model.layers.{i}."

TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 64,
}


class LlamaStyle(CheckpointFormat):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    ignore = ("model.layers.*.self_attn.rotary_emb.inv_freq", "model.rotary_emb.*", "lm_head.weight")
    norm_extra: dict[str, Any] = {}
    norm_position = "pre"  # or "sandwich" (Gemma 2/3), "output" (OLMo 2)
    qk_norm = "none"  # "head" (Qwen 3, Gemma 3) or "proj" (OLMo 2)
    act_key, act_default = "hidden_act", "silu"
    tied_default = False
    embed_scale = False
    qkv_bias = None  # None: config attention_bias (also on o_proj); True: q, k, v always (Qwen 2)
    mlp_bias_key = "mlp_bias"  # None where the config has no such field
    softcaps = False  # Gemma 2's attn_logit_softcapping / final_logit_softcapping
    query_scalar = False  # Gemma 2/3's query_pre_attn_scalar
    window_rule = "none"  # "all" (Mistral), "layer_types" (Qwen 2/3, Gemma 2/3)
    extra_fields: tuple[str, ...] = ()
    tiny = {**TINY, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8}}

    # -- the weight-name map ------------------------------------------------------------------
    NORMS = {
        "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
        "sandwich": {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_out_norm"},
        "output": {"post_attention_layernorm": "attn_out_norm", "post_feedforward_layernorm": "ffn_out_norm"},
    }

    def rules(self, spec):
        rules = [rule("model.embed_tokens.weight", "embed.weight")]
        for p in ("q", "k", "v", "o"):
            for w in ("weight", "bias"):
                rules.append(rule(f"{LAYER}self_attn.{p}_proj.{w}", f"{ZOO_MIXER}{p}_proj.{w}"))
        for p in ("q", "k"):
            rules.append(rule(f"{LAYER}self_attn.{p}_norm.weight", f"{ZOO_MIXER}{p}_norm.weight"))
        for hf, zoo in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            for w in ("weight", "bias"):
                rules.append(rule(f"{LAYER}mlp.{hf}.{w}", f"{ZOO_LAYER}ffn.{zoo}.{w}"))
        for hf, zoo in self.NORMS[self.norm_position].items():
            rules.append(rule(f"{LAYER}{hf}.weight", f"{ZOO_LAYER}{zoo}.weight"))
        rules += [rule("model.norm.weight", "final_norm.weight"), rule("lm_head.weight", "lm_head.weight")]
        return rules

    # -- config -> spec -------------------------------------------------------------------------
    def layer_types(self, f: Fields, n_layers: int) -> list[str]:
        if self.window_rule == "all":
            return [SLIDING if f.get("sliding_window", kind=int) is not None else FULL] * n_layers
        if self.window_rule == "layer_types":
            types = f.get("layer_types", kind=list)
            if types is None:
                types = self.default_layer_types(f, n_layers)
            if len(types) != n_layers:
                raise f.error("layer_types", f"has {len(types)} entries for {n_layers} layers")
            for t in types:
                if t not in (SLIDING, FULL):
                    raise f.error("layer_types", f"layer type {t!r} is not supported")
            return list(types)
        return [FULL] * n_layers

    def default_layer_types(self, f: Fields, n_layers: int) -> list[str]:
        return [FULL] * n_layers

    def window(self, f: Fields):
        return f.get("sliding_window", kind=int)

    def rope_for(self, f: Fields, layer_type: str, max_pos: int) -> dict[str, Any]:
        return rope_part(f, rope_parameters(f, layer_type), max_pos=max_pos)

    def config_to_spec(self, config, *, strict=False):
        f = Fields(config, self.model_type, self.defaults)
        d, n_heads, L = f.require("hidden_size"), f.require("num_attention_heads"), f.require("num_hidden_layers")
        n_kv = f.get("num_key_value_heads", n_heads)
        head_dim = f.get("head_dim", d // n_heads)
        max_pos = f.get("max_position_embeddings", 2048)
        norm = {"name": "rmsnorm", "eps": float(f.get("rms_norm_eps", 1e-6)), **self.norm_extra}
        for key in self.extra_fields:
            f.get(key)
        if self.qkv_bias is None:
            bias = out_bias = f.get("attention_bias", False)
        else:
            bias, out_bias = self.qkv_bias, False
        mlp_bias = f.get(self.mlp_bias_key, False) if self.mlp_bias_key else False
        attention: dict[str, Any] = {
            "name": "attention", "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim,
            "bias": bias, "out_bias": out_bias, "qk_norm": self.qk_norm,
        }
        if self.query_scalar:
            attention["scale_dim"] = float(f.get("query_pre_attn_scalar", head_dim, float))
        if self.softcaps and f.get("attn_logit_softcapping", kind=float) is not None:
            attention["softcap"] = float(f.get("attn_logit_softcapping"))
        ffn = {"name": "glu", "d_ff": f.require("intermediate_size"), "bias": mlp_bias,
               "activation": activation(f, self.act_key, self.act_default)}
        block = {"name": "serial", "norm_position": self.norm_position}
        types = self.layer_types(f, L)
        window = self.window(f) if SLIDING in types else None
        if SLIDING in types and window is None:
            raise f.error("sliding_window", "layers are marked sliding_attention but no window is given")
        kinds = {SLIDING: "local", FULL: "global"} if len(set(types)) > 1 else {SLIDING: "default", FULL: "default"}
        ropes = {t: self.rope_for(f, t, max_pos) for t in set(types)}
        position = ropes[types[0]]
        layers = {}
        for t in dict.fromkeys(types):
            layer = {"mixer": {**attention, **({"window": window} if t == SLIDING else {})},
                     "ffn": ffn, "norm": norm, "block": block}
            if ropes[t] != position:
                layer["position"] = ropes[t]
            layers[kinds[t]] = layer
        head: dict[str, Any] = {"tied": f.get("tie_word_embeddings", self.tied_default)}
        if self.softcaps and f.get("final_logit_softcapping", kind=float) is not None:
            head["softcap"] = float(f.get("final_logit_softcapping"))
        if self.embed_scale:
            f.expect("use_bidirectional_attention", (None, False), "zoo's decoders are causal")
        spec = {
            "vocab_size": f.require("vocab_size"), "d_model": d, "n_layers": L, "max_seq_len": max_pos,
            "layers": layers, "layer_pattern": list(pattern([kinds[t] for t in types])),
            "position": position, "final_norm": norm, "head": head,
            "embedding": {"scale": "sqrt_d_model" if self.embed_scale else "none"},
        }
        f.finish(strict)
        return ModelSpec.from_dict(spec)

    # -- spec -> config -------------------------------------------------------------------------
    def spec_to_config(self, spec):
        layer = spec.layer(0)
        att, ffn, norm = layer.mixer, layer.ffn, layer.norm
        head_dim = att.cls.head_dim_for(att.config, spec.d_model)
        cfg: dict[str, Any] = {
            "vocab_size": spec.vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
            "num_attention_heads": att.n_heads, "num_key_value_heads": att.n_kv_heads or att.n_heads,
            "head_dim": head_dim, "intermediate_size": ffn_size(spec), "max_position_embeddings": spec.max_seq_len,
            "rms_norm_eps": norm.eps, "tie_word_embeddings": spec.head.tied,
            self.act_key: activation_name(ffn.activation),
        }
        if self.qkv_bias is None:
            cfg["attention_bias"] = att.bias
        if self.mlp_bias_key:
            cfg[self.mlp_bias_key] = ffn.bias
        if self.query_scalar:
            scalar = att.scale_dim if att.scale_dim is not None else head_dim
            cfg["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
        if self.softcaps:
            cfg["attn_logit_softcapping"] = att.softcap
            cfg["final_logit_softcapping"] = spec.head.softcap
        types = layer_types_of(spec, {"sliding": SLIDING, "full": FULL})
        windows = {spec.layer(i).mixer.window for i in range(spec.n_layers)} - {None}
        self.windows_to_config(cfg, types, windows.pop() if windows else None)
        ropes = {t: rope_to_hf(spec.position_for(i), head_dim) for i, t in enumerate(types)}
        cfg["rope_parameters"] = self.ropes_to_config(ropes)
        return cfg

    def windows_to_config(self, cfg, types, window):
        if window is not None:
            raise ValueError(f"{self.model_type} has no sliding-window attention")

    def ropes_to_config(self, ropes):
        if len({repr(r) for r in ropes.values()}) > 1:
            raise ValueError(f"{self.model_type} uses one RoPE for every layer")
        return next(iter(ropes.values()))


class Mistral(LlamaStyle):
    model_type, architecture = "mistral", "MistralForCausalLM"
    mlp_bias_key = None
    window_rule = "all"
    # MistralConfig's: a config without sliding_window slides 4096 (null: no window).
    defaults = {"sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 131072}
    tiny = {**TINY, "sliding_window": 8}

    def windows_to_config(self, cfg, types, window):
        if window is not None and FULL in types:
            raise ValueError("mistral's sliding window applies to every layer or to none")
        cfg["sliding_window"] = window


class Qwen2(LlamaStyle):
    model_type, architecture = "qwen2", "Qwen2ForCausalLM"
    mlp_bias_key = None
    qkv_bias = True
    window_rule = "layer_types"
    # Qwen2Config's: the window and where it starts apply only when use_sliding_window is true.
    defaults = {"sliding_window": 4096, "max_window_layers": 28, "num_key_value_heads": 32,
                "max_position_embeddings": 32768}
    tiny = {**TINY, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 16}}

    # transformers (Qwen2Config): sliding_window = sliding_window if use_sliding_window else None, and
    # without layer_types, layer i slides when there is a window and i >= max_window_layers. Layers
    # marked sliding get the window; with none, every layer attends fully.
    def window(self, f):
        window = f.get("sliding_window", kind=int)
        return window if f.get("use_sliding_window", False) else None

    def layer_types(self, f, n_layers):
        f.get("max_window_layers", kind=int)  # typed even where it decides nothing
        types = super().layer_types(f, n_layers)
        return types if self.window(f) is not None else [FULL] * n_layers

    def default_layer_types(self, f, n_layers):
        start = f.get("max_window_layers", kind=int)
        return [SLIDING if self.window(f) is not None and i >= start else FULL for i in range(n_layers)]

    def windows_to_config(self, cfg, types, window):
        cfg.update(use_sliding_window=window is not None, sliding_window=window, layer_types=types)
        if window is not None:
            cfg["max_window_layers"] = types.index(SLIDING)


class Qwen3(Qwen2):
    model_type, architecture = "qwen3", "Qwen3ForCausalLM"
    defaults = {**Qwen2.defaults, "head_dim": 128}
    qkv_bias = None
    qk_norm = "head"
    tiny = {**TINY, "attention_bias": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}


GEMMA_NORM = {"unit_offset": True, "scale_in_fp32": True}


class Gemma(LlamaStyle):
    model_type, architecture = "gemma", "GemmaForCausalLM"
    defaults = {"num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192}
    mlp_bias_key = None
    norm_extra = GEMMA_NORM
    act_default = "gelu_pytorch_tanh"
    tied_default = True
    embed_scale = True
    extra_fields = ("hidden_activation",)
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
    mlp_bias_key = None
    norm_extra = GEMMA_NORM
    norm_position = "sandwich"
    act_key, act_default = "hidden_activation", "gelu_pytorch_tanh"
    extra_fields = ("hidden_act",)
    tied_default = True
    embed_scale = True
    softcaps = True
    query_scalar = True
    window_rule = "layer_types"
    tiny = {**TINY, "sliding_window": 8, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0}

    def default_layer_types(self, f, n_layers):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]

    def windows_to_config(self, cfg, types, window):
        cfg.update(sliding_window=window, layer_types=types)


class Gemma3Text(Gemma2):
    model_type, architecture = "gemma3_text", "Gemma3ForCausalLM"
    qk_norm = "head"
    # Gemma3TextConfig's: the text_config of a released gemma3 checkpoint gives only what differs.
    defaults = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}
    extra_fields = ("hidden_act", "sliding_window_pattern", "rope_local_base_freq")
    ignore = LlamaStyle.ignore + ("vision_tower.*", "multi_modal_projector.*", "model.vision_tower.*",
                                  "model.multi_modal_projector.*")
    tiny = {**TINY, "sliding_window": 8, "query_pre_attn_scalar": 24,
            "layer_types": [SLIDING, FULL],
            "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                FULL: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}}

    def default_layer_types(self, f, n_layers):
        every = f.get("sliding_window_pattern", 6)
        return [SLIDING if (i + 1) % every else FULL for i in range(n_layers)]

    def rope_for(self, f, layer_type, max_pos):
        if "rope_parameters" not in f and layer_type == SLIDING:
            # Older configs: rope_local_base_freq for local layers, rope_theta/rope_scaling for global ones.
            return rope_part(f, {"rope_theta": f.get("rope_local_base_freq", 10000.0)}, max_pos=max_pos)
        return super().rope_for(f, layer_type, max_pos)

    def ropes_to_config(self, ropes):
        full = ropes.get(FULL, ropes.get(SLIDING))
        return {SLIDING: ropes.get(SLIDING, full), FULL: full}


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
    mlp_bias_key = None
    norm_extra = {"scale_in_fp32": True}
    norm_position = "output"
    qk_norm = "proj"
    tiny = {**TINY, "attention_bias": True}


FORMATS = [LlamaStyle(), Mistral(), Qwen2(), Qwen3(), Gemma(), Gemma2(), Gemma3Text(), Gemma3(), Olmo2()]
