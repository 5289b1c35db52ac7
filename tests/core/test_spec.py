"""The spec is strict, lossless and overridable."""

import json

import pytest

import zoo
from zoo.core.spec import ModelSpec, SpecError, apply_overrides


def tiny(**kw):
    data = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "layers": {"default": {"mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2}}},
    }
    return apply_overrides(data, kw)


def error_of(overrides) -> SpecError:
    with pytest.raises(SpecError) as info:
        zoo.get_spec(tiny(), overrides)
    return info.value


def test_defaults_fill_a_minimal_spec():
    spec = ModelSpec.from_dict(tiny())
    layer = spec.layers["default"]
    assert (layer.norm.name, layer.ffn.name, layer.block.name, spec.position.name) == ("rmsnorm", "swiglu", "serial", "rope")
    assert layer.ffn.activation.name == "silu"


@pytest.mark.parametrize(
    "override, path, words",
    [
        ({"layers.default.mixer.windw": 8}, "layers.default.mixer.windw", "did you mean 'window'"),
        ({"layers.default.mixer.window": 0}, "layers.default.mixer.window", "must be positive"),
        ({"layers.default.mixer.window": -4}, "layers.default.mixer.window", "-4"),
        ({"layers.default.mixer.n_kv_heads": 3}, "layers.default.mixer.n_kv_heads", "not divisible"),
        ({"layers.default.mixer.n_heads": "4"}, "layers.default.mixer.n_heads", "expected an integer"),
        ({"layers.default.mixer.n_heads": True}, "layers.default.mixer.n_heads", "expected an integer"),
        ({"layers.default.norm.name": "rmsnrom"}, "layers.default.norm.name", "rmsnorm"),
        ({"layers.default.ffn.activation": "swish"}, "layers.default.ffn.activation", "unknown activation"),
        ({"d_model": 30}, "layers.default.mixer.n_heads", "not divisible"),
        ({"position.rotary_fraction": 0.375}, "position.rotary_fraction", "odd"),
        ({"position.rotary_dim": 7}, "position.rotary_dim", "even"),
        ({"layers.default.block.norm_position": "middle"}, "layers.default.block.norm_position", "'pre'"),
        ({"layer_pattern": ["default", "global"]}, "layer_pattern[1]", "not a layer kind"),
        ({"dropout": 1.5}, "dropout", "[0, 1)"),
        ({"vocab_size": 0}, "vocab_size", "positive"),
        ({"mystery": 1}, "mystery", "unknown key"),
        ({"head.softcap": -1.0}, "head.softcap", "positive"),
        ({"position.scaling": {"name": "linear", "factor": 0.5}}, "position.scaling.factor", ">= 1"),
    ],
)
def test_errors_name_the_exact_path_and_value(override, path, words):
    err = error_of(override)
    assert err.path == path
    assert words in str(err)


def test_missing_required_key_is_named():
    data = tiny()
    del data["layers"]["default"]["mixer"]["n_heads"]
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(data)
    err = info.value
    assert err.path == "layers.default.mixer.n_heads" and "missing" in str(err)


def test_specs_are_immutable():
    spec = ModelSpec.from_dict(tiny())
    with pytest.raises(Exception):
        spec.d_model = 8
    with pytest.raises(Exception):
        spec.layers["default"].mixer.config.n_heads = 8


@pytest.mark.parametrize("name", zoo.list_models())
def test_every_preset_round_trips_json_and_toml(name):
    spec = zoo.get_spec(name)
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert ModelSpec.from_toml(spec.to_toml()) == spec
    # and the plain data is itself stable
    assert json.loads(ModelSpec.from_json(spec.to_json()).to_json()) == json.loads(spec.to_json())


def test_a_users_recipe_file_builds(tmp_path):
    spec = zoo.get_spec("gemma2-2b", n_layers=2, d_model=64, vocab_size=128,
                        overrides={"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 96})
    toml_path = tmp_path / "my-recipe.toml"
    toml_path.write_text(spec.to_toml())
    json_path = tmp_path / "my-recipe.json"
    json_path.write_text(spec.to_json())
    for path in (toml_path, str(json_path)):
        model = zoo.build(path)
        assert model.spec == spec
        assert model.layers[0].mixer.window == 4096 and model.layers[1].mixer.window is None


def test_recipe_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(ModelSpec.from_dict(tiny()).to_toml().replace("n_heads = 4", "n_heads = 5"))
    with pytest.raises(SpecError) as info:
        zoo.build(path)
    assert str(path) in str(info.value) and info.value.path == "layers.default.mixer.n_kv_heads"


def test_overrides_top_level_one_part_and_every_layer_kind():
    base = zoo.get_spec("gemma2-2b")
    spec = zoo.get_spec("gemma2-2b", n_layers=4, overrides={"layers.local.mixer.window": 64})
    assert spec.n_layers == 4
    assert spec.layers["local"].mixer.window == 64
    assert spec.layers["global"].mixer.window is None
    assert spec.layers["local"].mixer.softcap == base.layers["local"].mixer.softcap == 50.0
    every = zoo.get_spec("gemma2-2b", overrides={"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2})
    assert {layer.mixer.n_heads for layer in every.layers.values()} == {4}
    # double underscores spell dots, so overrides can be keyword arguments
    kw = zoo.get_spec("gemma2-2b", layers__local__mixer__window=32)
    assert kw.layers["local"].mixer.window == 32


def test_override_can_swap_a_part_and_unset_an_option():
    spec = zoo.get_spec("llama2-7b", overrides={"layers.default.norm": {"name": "layernorm", "bias": False}})
    assert spec.layers["default"].norm.name == "layernorm" and spec.layers["default"].norm.bias is False
    no_window = zoo.get_spec("mistral-7b", overrides={"layers.default.mixer.window": None})
    assert no_window.layers["default"].mixer.window is None


def test_override_errors_name_the_path():
    with pytest.raises(SpecError) as info:
        zoo.get_spec("llama2-7b", overrides={"layers.default.mixer.head_dm": 8})
    assert info.value.path == "layers.default.mixer.head_dm"
    with pytest.raises(SpecError) as info:
        zoo.get_spec("llama2-7b", overrides={"layers.nothing*.mixer.n_heads": 8})
    assert "matches nothing" in str(info.value)


def test_hf_repo_ids_resolve_to_presets():
    assert zoo.get_spec("google/gemma-2-2b") == zoo.get_spec("gemma2-2b")
    assert zoo.get_spec("meta-llama/Llama-2-7b-hf") == zoo.get_spec("llama2-7b")


def test_unknown_model_suggests_close_names():
    with pytest.raises(zoo.UnknownNameError) as info:
        zoo.build("gemma2-2", device="meta")
    assert "gemma2-2b" in str(info.value)


def test_list_models_takes_shell_patterns():
    assert zoo.list_models("gemma2*") == ["gemma2-27b", "gemma2-2b", "gemma2-9b"]
    assert set(zoo.list_models("llama3.1-*")) == {"llama3.1-8b", "llama3.1-70b", "llama3.1-405b"}
    names = set(zoo.list_models())
    expected = {
        "transformer-2017", "gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
        "gpt3-13b", "gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b",
        "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "llama3.2-3b", "palm-8b", "palm-62b",
        "palm-540b", "gemma2-2b", "gemma2-9b", "gemma2-27b", "gemma3-1b", "gemma3-4b", "gemma3-12b",
        "gemma3-27b", "olmo2-7b", "olmo2-13b", "mistral-7b", "mistral-7b-v0.3",
    }
    assert expected <= names


def test_listing_every_kind_first_thing_loads_the_plugins():
    # In a fresh interpreter the first call loads the plugins, which may add kinds.
    import subprocess
    import sys

    code = "import zoo; d = zoo.list_components(); print('rmsnorm' in d['norm'], 'llama' in d['checkpoint_format'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
