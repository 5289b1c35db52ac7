"""Layer kinds that extend another (``extends = "global"`` plus a delta), resolved before parsing.

tests/data/families_expanded/ holds the recipes as they were written before ``extends`` (every layer
kind in full): each family file must give the same recipe data, the same spec and the same
parameter count for every preset.
"""

from pathlib import Path

import pytest

import zoo
from zoo.core.spec import Family, ModelSpec, SpecError, resolve_extends

ROOT = Path(__file__).resolve().parents[2]
EXPANDED = sorted((Path(__file__).parents[1] / "data" / "families_expanded").glob("*.toml"))


@pytest.mark.parametrize("path", EXPANDED, ids=lambda p: p.stem)
def test_a_family_with_extends_is_its_fully_expanded_recipe(path):
    written = ROOT / "zoo" / "families" / path.name
    assert "extends" in written.read_text() and "extends" not in path.read_text()
    short, full = Family.from_toml(written), Family.from_toml(path)
    assert short.presets == full.presets
    for preset in full.presets:
        assert short.recipe(preset) == full.recipe(preset), preset
        spec = short.spec(preset)
        assert spec == full.spec(preset)
        params = sum(p.numel() for p in zoo.build(spec, device="meta").parameters())
        assert params == sum(p.numel() for p in zoo.build(full.spec(preset), device="meta").parameters())


BASE = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "layer_pattern": ["local", "global"]}
GLOBAL = {"mixer": {"name": "attention", "n_heads": 2, "softcap": 5.0}, "ffn": {"name": "swiglu", "d_ff": 48},
          "block": {"name": "serial", "norm_position": "pre"}}


def layers(**kinds):
    return {**BASE, "layers": {"global": GLOBAL, **kinds}}


def test_a_delta_merges_into_a_part_of_the_same_name_and_replaces_one_of_another():
    data = resolve_extends(layers(local={"extends": "global", "mixer": {"window": 8}, "ffn": {"name": "mlp", "d_ff": 64}}))
    local = data["layers"]["local"]
    assert local["mixer"] == {**GLOBAL["mixer"], "window": 8}
    assert local["ffn"] == {"name": "mlp", "d_ff": 64}
    assert local["block"] == GLOBAL["block"] and "extends" not in local
    assert data["layers"]["global"] == GLOBAL  # the base is untouched
    ModelSpec.from_dict(data)


def test_drop_takes_an_inherited_setting_off():
    data = resolve_extends(layers(local={"extends": "global", "drop": ["mixer.softcap"]}))
    assert data["layers"]["local"]["mixer"] == {"name": "attention", "n_heads": 2}


def test_extends_chains_in_any_order():
    data = resolve_extends({**BASE, "layer_pattern": ["a", "b", "global"],
                            "layers": {"a": {"extends": "b", "mixer": {"window": 4}},
                                       "b": {"extends": "global", "mixer": {"softcap": 9.0}}, "global": GLOBAL}})
    assert data["layers"]["a"]["mixer"] == {"name": "attention", "n_heads": 2, "softcap": 9.0, "window": 4}
    assert list(data["layers"]) == ["a", "b", "global"]


@pytest.mark.parametrize("kinds, path, message", [
    ({"local": {"extends": "globl"}}, "layers.local.extends", "unknown layer kind 'globl'"),
    ({"local": {"extends": "other"}, "other": {"extends": "local"}}, "layers.", "in a cycle: "),
    ({"local": {"extends": "local"}}, "layers.local.extends", "in a cycle: local -> local"),
    ({"local": {"extends": "global", "block": {"name": "parallel"}}}, "layers.local.block",
     "block 'parallel' differs from 'serial' of layer kind 'global'"),
    ({"local": {"extends": "global", "drop": ["mixer.window"]}}, "layers.local.drop[0]",
     "'mixer.window' is not set in layer kind 'global'"),
    ({"local": {"extends": 3}}, "layers.local.extends", "must name a layer kind"),
])
def test_bad_extends_is_an_error_naming_the_path(kinds, path, message):
    with pytest.raises(SpecError, match=message) as err:
        resolve_extends(layers(**kinds))
    assert err.value.path.startswith(path)


def test_a_family_file_error_names_the_preset_and_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[family]\nname = "bad"\n[base]\nvocab_size = 64\nd_model = 32\nn_layers = 1\n'
                    'layer_pattern = ["local"]\n[base.layers.local]\nextends = "global"\n[presets.bad-1]\n')
    with pytest.raises(SpecError, match=r"layers\.local\.extends.*unknown layer kind 'global'.*bad-1.*bad\.toml"):
        Family.from_toml(path).spec("bad-1")
