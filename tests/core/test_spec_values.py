"""Spec values: every number finite and in range, sizes bounded, malformed recipe files named."""

import math

import pytest

import zoo
from zoo.core.spec import Family
from zoo.core.spec import MAX_SIZES, ModelSpec, SpecError


@pytest.mark.parametrize("path, value", [
    ("layers.default.norm.eps", math.nan),
    ("final_norm.eps", math.inf),
    ("head.softcap", math.nan),
    ("position.theta", math.nan),
    ("position.theta", -math.inf),
    ("z_loss", math.inf),
    ("init_std", math.nan),
    ("dropout", math.nan),
    ("layers.default.mixer.softcap", math.inf),
])
def test_nan_and_infinity_are_refused_naming_the_field(path, value):
    with pytest.raises(SpecError, match=rf"^{path}: must be a finite number, got {value!r}") as exc:
        zoo.get_spec("llama3-8b", {path.replace("default", "*"): value})
    assert exc.value.path == path


def test_nan_in_a_plugin_parts_config_is_refused_too():
    with pytest.raises(SpecError, match=r"layers.default.norm.alpha_init: must be a finite number, got nan"):
        zoo.get_spec("llama3-8b", {"layers.*.norm": {"name": "dyt", "alpha_init": math.nan}})


def test_nan_in_a_json_recipe_names_the_field_and_the_file(tmp_path):
    data = zoo.get_spec("llama3-8b", n_layers=2).to_json().replace('"z_loss": 0.0', '"z_loss": NaN')
    (tmp_path / "r.json").write_text(data)
    with pytest.raises(SpecError, match=r"z_loss: must be a finite number, got nan \(in .*r\.json\)"):
        zoo.get_spec(str(tmp_path / "r.json"))


def test_negative_init_std_is_refused_before_torch_sees_it():
    with pytest.raises(SpecError, match=r"init_std: must be >= 0, got -0.02"):
        zoo.build("llama3-8b", n_layers=1, d_model=32, vocab_size=64, init_std=-0.02, device="meta")


@pytest.mark.parametrize("field", sorted(MAX_SIZES))
def test_sizes_beyond_any_model_are_refused_at_once(field):
    with pytest.raises(SpecError, match=rf"^{field}: 1000000000 is beyond zoo's limit of {MAX_SIZES[field]:,}"):
        zoo.get_spec("llama3-8b", {field: 10**9})
    zoo.get_spec("llama3-8b", {field: MAX_SIZES[field]} if field != "vocab_size" else {})  # the limit itself is fine


def test_a_recipe_that_contains_itself_is_refused_naming_where():
    data = zoo.get_spec("llama3-8b", n_layers=2).to_dict()
    data["layers"]["default"]["ffn"]["activation"] = data["layers"]
    with pytest.raises(SpecError, match=r"^layers.default.ffn.activation: the recipe contains itself here"):
        zoo.get_spec(data)


def test_a_recipe_file_nested_beyond_any_spec_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match=r"deep\.json nests deeper than any spec"):
        zoo.get_spec(str(tmp_path / "deep.json"))
    (tmp_path / "deep2.json").write_text('{"vocab_size": ' + "[" * 50 + "]" * 50 + "}")
    with pytest.raises(SpecError, match=r"^vocab_size(\[0\])+: the recipe nests deeper than any spec"):
        zoo.get_spec(str(tmp_path / "deep2.json"))


def test_a_directory_given_as_a_recipe_is_named(tmp_path):
    (tmp_path / "model.toml").mkdir()
    with pytest.raises(SpecError, match=r"model\.toml is a directory, not a recipe file"):
        zoo.get_spec(str(tmp_path / "model.toml"))
    with pytest.raises(SpecError, match=r"is a directory, not a recipe file"):
        ModelSpec.from_file(tmp_path)


def test_syntax_errors_name_the_file_and_the_line(tmp_path):
    (tmp_path / "bad.toml").write_text("vocab_size = 256\nd_model = = 64\n")
    with pytest.raises(SpecError, match=r"bad\.toml is not valid TOML: .*line 2"):
        zoo.get_spec(str(tmp_path / "bad.toml"))
    (tmp_path / "bad.json").write_text('{"vocab_size": 256,\n "d_model": }')
    with pytest.raises(SpecError, match=r"bad\.json is not valid JSON: .*line 2"):
        zoo.get_spec(str(tmp_path / "bad.json"))
    (tmp_path / "fam.toml").write_text("[family]\nname = 'x'\n[base\n")
    with pytest.raises(SpecError, match=r"family file .*fam\.toml is not valid TOML: .*line 3"):
        Family.from_toml(tmp_path / "fam.toml")
