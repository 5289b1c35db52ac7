"""Released config.json files (tests/data/configs, sources in SOURCES.md) read as released: zoo
builds what transformers builds from the same file, keeps what transformers ignores, and refuses
mistyped fields by name."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import zoo
from zoo.checkpoints import ConfigError, config_to_spec, get_format, ignored_fields
from zoo.checkpoints.hf.format import layout_of

CONFIGS = sorted((Path(__file__).parents[1] / "data" / "configs").glob("*.json"))
transformers = pytest.importorskip("transformers")


def load(path: Path) -> dict:
    config = json.loads(path.read_text())
    # How the weights are stored (DeepSeek-V3's FP8 blocks) is for loading them, not for what is built.
    config.pop("quantization_config", None)
    return config


def model_type_of(config: dict) -> str:
    """The model_type, or for a config in a layout of its own (mamba_ssm's, without one) the format
    that recognises it."""
    return config.get("model_type") or layout_of(config)


def needs_format(config: dict) -> None:
    if model_type_of(config) not in zoo.list_components("checkpoint_format"):
        pytest.skip(f"no {model_type_of(config)} format installed (a plugin provides it)")


# Layouts transformers does not implement (remote code only): model_type -> the test that checks zoo's
# reading of the released config against the release's own equations and count instead.
NO_TRANSFORMERS_MODEL = {"deepseek": "tests/formats/test_deepseek_moe.py"}


def needs_transformers_model(model_type: str) -> None:
    if model_type in NO_TRANSFORMERS_MODEL:
        pytest.skip(f"transformers has no {model_type}: {NO_TRANSFORMERS_MODEL[model_type]} checks it")


def hf_text_config(config: dict):
    if "model_type" not in config:  # mamba_ssm's layout: transformers reads what its conversion script writes
        config = get_format(model_type_of(config)).unwrap(config)[0]
    hc = transformers.AutoConfig.for_model(**config)
    return hc.text_config if config["model_type"] == "gemma3" else hc


# Formats whose released config.json is not in tests/data/configs yet (it could not be fetched where
# the format was written): model_type -> the repository to take it from. Meanwhile the format's own
# tests build its preset on the meta device in transformers from the preset's config.
NOT_STORED_YET = {"minimax": "MiniMaxAI/MiniMax-Text-01-hf", "nemotron_h": "nvidia/Nemotron-H-8B-Base-8K"}
NOT_STORED_YET["minimax_m2"] = "MiniMaxAI/MiniMax-M2"
NOT_STORED_YET["glm_moe_dsa"] = "zai-org/GLM-5"  # no whole copy of its config.json was found (SOURCES.md)
NOT_STORED_YET.update({"smollm3": "HuggingFaceTB/SmolLM3-3B", "olmo3": "allenai/Olmo-3-1025-7B",
                       "cohere": "CohereLabs/c4ai-command-r-v01", "cohere2": "CohereLabs/c4ai-command-r7b-12-2024",
                       "glm4_moe": "zai-org/GLM-4.5"})  # (SOURCES.md)


def test_every_supported_model_type_has_a_released_config():
    have = {model_type_of(load(p)) for p in CONFIGS}
    # zoo's own formats and the example plugins' (a test may have loaded a test-only plugin's too).
    plugins = zoo.manager().plugins
    shipped = {e.name for e in zoo.manager().registry("checkpoint_format").entries()
               if e.provider in zoo.core.registry.BUILTIN_PLUGINS
               or (getattr(plugins.get(e.provider), "distribution", None) or "").startswith("zoo-")}
    assert "llama" in shipped and "phi" in shipped
    assert shipped - set(NOT_STORED_YET) <= have
    assert not set(NOT_STORED_YET) & have  # stored now: drop it from NOT_STORED_YET
    sources = (CONFIGS[0].parent / "SOURCES.md").read_text()
    assert all(f"`{p.name}`" in sources for p in CONFIGS)


# Released configs whose RoPE base transformers 5.23 drops: DBRX's rotary reads only a top-level
# rope_parameters (which its own saves write), not the release's attn_config.rope_theta, so it rotates
# the released model with base 1e4 instead of 5e5. zoo reads the release's field; tests/formats/test_dbrx.py
# pins transformers' reading, so that a fix shows.
ROPE_BASE_DROPPED = {"dbrx"}

ROPE_TYPES = {"default": "default", "linear": "linear", "dynamic": "dynamic_ntk", "yarn": "yarn", "llama3": "llama3"}


# Whose full-attention layers have no position encoding (transformers rotates only where they slide).
NOPE_ON_FULL = {"cohere2"}


def same_as_transformers(config: dict) -> None:
    """zoo builds, on the meta device, what transformers builds from ``config``: the parameter count,
    the context length, which layers slide and how far, each layer's RoPE, the score scale and soft-caps."""
    spec = config_to_spec(config)
    model = zoo.build_model(spec, device="meta")
    hc = hf_text_config(config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hc)
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    if hasattr(hc, "max_position_embeddings"):  # recurrent models (mamba2) have no such limit
        assert spec.max_seq_len == hc.max_position_embeddings
    window = getattr(hc, "sliding_window", None)
    types = getattr(hc, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * hc.num_hidden_layers
    want = [window if t == "sliding_attention" else None for t in types]
    # (a mixer that is not attention has no window: recurrent layers of a hybrid)
    assert [getattr(spec.layer(i).mixer.config, "window", None) for i in range(spec.n_layers)] == want
    if "linear_attention" in types:  # recurrent layers (Qwen3-Next's Gated DeltaNet) where transformers has them
        assert [spec.layer(i).mixer.name != "attention" for i in range(spec.n_layers)] == [
            t == "linear_attention" for t in types]
    params = getattr(hc, "rope_parameters", None)
    if model_type_of(config) in ROPE_BASE_DROPPED and "rope_parameters" not in config:
        params = None
    no_rope = getattr(hc, "no_rope_layers", None)  # SmolLM3: 0 where a layer has no position (NoPE)
    for i, t in enumerate(types if params else []):  # each layer's RoPE as transformers sets it up
        p = params[t] if isinstance(params.get(t), dict) else params
        pos = spec.position_for(i)
        if (no_rope is not None and not no_rope[i]) or (t == "full_attention" and model_type_of(config) in NOPE_ON_FULL):
            assert pos.name == "nope", f"layer {i} is NoPE in transformers"
            continue
        assert pos.theta == p["rope_theta"]
        assert (pos.scaling.name if pos.scaling else "default") == ROPE_TYPES[p.get("rope_type", "default")]
        if pos.scaling is not None and p.get("factor") is not None:
            assert pos.scaling.factor == p["factor"]
        assert pos.rotary_fraction == p.get("partial_rotary_factor", 1.0)
    if getattr(hc, "rotary_dim", None):  # GPT-J: a rotary width in channels
        assert spec.position.rotary_dim == hc.rotary_dim
    if hasattr(hc, "query_pre_attn_scalar"):  # Gemma 2/3 scale scores by this, not by head_dim
        assert {spec.layer(i).mixer.scale_dim for i in range(spec.n_layers)} == {hc.query_pre_attn_scalar}
    if hasattr(hc, "final_logit_softcapping"):
        assert spec.head.softcap == hc.final_logit_softcapping
        assert {spec.layer(i).mixer.softcap for i in range(spec.n_layers)} == {hc.attn_logit_softcapping}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_released_config_builds_what_transformers_builds(path):
    config = load(path)
    needs_format(config)
    needs_transformers_model(model_type_of(config))
    same_as_transformers(config)


SIZES = ("vocab_size", "hidden_size", "n_embd", "intermediate_size", "num_hidden_layers", "n_layer",
         "num_attention_heads", "n_head")


@pytest.mark.parametrize("model_type", sorted({model_type_of(load(p)) for p in CONFIGS} - {"gemma3"}))
def test_absent_fields_take_transformers_defaults(model_type):
    # Only the sizes given: heads, head_dim, windows, context and eps come from the config class.
    needs_format({"model_type": model_type})
    needs_transformers_model(model_type)
    defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
    # DeepseekV2Config defaults num_experts_per_tok to None: transformers builds that model and cannot run it.
    runnable = {"num_experts_per_tok": 6} if defaults.get("num_experts_per_tok", 0) is None else {}
    if model_type in ROPE_BASE_DROPPED:  # DbrxAttention reads attn_config.rope_theta, absent from the default
        runnable = {"attn_config": {"rope_theta": 10000.0}}
    same_as_transformers({"model_type": model_type, **{k: defaults[k] for k in SIZES if k in defaults}, **runnable})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_fields_transformers_declares_are_read_and_the_rest_kept(path):
    config = load(path)
    needs_format(config)
    needs_transformers_model(model_type_of(config))
    model_type = model_type_of(config) if model_type_of(config) != "gemma3" else "gemma3_text"
    declared = {f.name for f in dataclasses.fields(transformers.CONFIG_MAPPING[model_type])}
    ignored = ignored_fields(config)
    assert not set(ignored) & declared  # each one transformers reads, zoo reads (or refuses)
    assert set(ignored) <= set(config)
    if ignored:  # strict=True is the way to hear of them
        with pytest.raises(ConfigError, match=repr(ignored[0])):
            config_to_spec(config, strict=True)


@pytest.mark.parametrize("model_type", sorted(NOT_STORED_YET))
def test_fields_transformers_declares_are_read_where_no_released_config_is_stored(model_type):
    """Without a released file, the whole config transformers' config class writes (every field it
    declares, at its default) is read: none is left unread."""
    declared = {f.name for f in dataclasses.fields(transformers.CONFIG_MAPPING[model_type])}
    # Glm4MoeConfig's defaults alone give 96 heads of 4096 / 96 = 42 channels, half of which is an odd
    # rotary width; its releases state head_dim 128.
    runnable = {"glm4_moe": {"head_dim": 128}}.get(model_type, {})
    config = {**transformers.AutoConfig.for_model(model_type).to_dict(), **runnable}
    assert not set(ignored_fields(config)) & declared


def test_vendor_extras_are_ignored_as_transformers_ignores_them():
    qwen = load(CONFIGS[0].parent / "Qwen--Qwen2.5-0.5B.json")
    smol = load(CONFIGS[0].parent / "HuggingFaceTB--SmolLM2-135M.json")
    assert ignored_fields(qwen) == ["use_mrope"]
    assert ignored_fields(smol) == ["is_llama_config", "rope_interleaved"]
    assert ignored_fields(load(CONFIGS[0].parent / "google--gemma-2-27b.json")) == ["sliding_window_size"]


@pytest.mark.parametrize("use, start, window", [(False, 21, 4096), (True, 21, 4096), (True, 0, 512), (True, None, None)])
def test_qwen_window_rule_is_transformers_rule(use, start, window):
    config = {**load(CONFIGS[0].parent / "Qwen--Qwen2.5-0.5B.json"), "use_sliding_window": use}
    for key, value in (("max_window_layers", start), ("sliding_window", window)):
        if value is None:
            config.pop(key)  # absent: transformers' defaults (28, 4096)
        else:
            config[key] = value
    hc = transformers.AutoConfig.for_model(**config)
    spec = config_to_spec(config)
    want = [hc.sliding_window if t == "sliding_attention" else None for t in hc.layer_types]
    assert [getattr(spec.layer(i).mixer.config, "window", None) for i in range(spec.n_layers)] == want
    assert any(want) == (use and (28 if start is None else start) < spec.n_layers)


@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", "no"), ("tie_word_embeddings", 0), ("hidden_size", "896"), ("num_hidden_layers", True),
    ("rms_norm_eps", "1e-6"), ("rope_theta", "1000000.0"), ("use_sliding_window", "false"),
    ("sliding_window", 4096.5), ("rope_scaling", ["linear"]), ("max_window_layers", "24"),
])
def test_typed_fields_are_typed(field, value):
    config = {**load(CONFIGS[0].parent / "Qwen--Qwen2.5-0.5B.json"), "use_sliding_window": True, field: value}
    with pytest.raises(ConfigError, match=f"'{field}'.*must be"):
        config_to_spec(config)


def test_rope_values_are_typed_and_a_config_is_an_object():
    config = load(CONFIGS[0].parent / "meta-llama--Llama-3.1-8B.json")
    config["rope_scaling"] = {**config["rope_scaling"], "factor": "8"}
    with pytest.raises(ConfigError, match=r"'rope_parameters\.factor'.*must be a number"):
        config_to_spec(config)
    for bad in ([config], "llama", 3):
        with pytest.raises(ConfigError, match="'config'.*JSON object"):
            config_to_spec(bad)
    gemma3 = load(CONFIGS[0].parent / "google--gemma-3-4b-pt.json")
    with pytest.raises(ConfigError, match="'text_config'.*JSON object"):
        config_to_spec({**gemma3, "text_config": [1]})


def test_mamba2_configs_read_as_released():
    """mamba_ssm's own layout (state-spaces/mamba2-2.7b): every field read, the vocabulary padded to
    the multiple, the mixer's settings mamba_ssm's defaults; Mamba-Codestral's transformers config:
    its Infinity time-step limit and the fields transformers 5.23 no longer declares, kept."""
    layout = load(CONFIGS[0].parent / "state-spaces--mamba2-2.7b.json")
    spec = config_to_spec(layout)
    assert ignored_fields(layout) == []
    mixer = spec.layer(0).mixer
    assert (spec.vocab_size, mixer.n_heads, mixer.head_dim, mixer.state_size, mixer.n_groups) == (50288, 80, 64, 128, 1)
    assert spec.head.tied and mixer.dt_limit_max is None and spec.position.name == "nope"
    codestral = load(CONFIGS[0].parent / "mistralai--Mamba-Codestral-7B-v0.1.json")
    assert codestral["time_step_limit"][1] == float("inf")
    assert config_to_spec(codestral).layer(0).mixer.dt_limit_max is None
    assert ignored_fields(codestral) == ["intermediate_size", "norm_before_gate", "rms_norm",
                                         "time_step_init_scheme", "time_step_scale"]
    for preset, config in (("mamba2-2.7b", layout), ("mamba-codestral-7b", codestral)):
        assert zoo.model.recipes.get_spec(preset).with_overrides({"label": None}) == config_to_spec(config)
