"""A zoo release that adds a name a plugin already had does not break the plugin (docs/guides/plugins.md,
"Names zoo and a plugin share"): both entries stay, reachable as ``zoo:name`` and ``plugin:name``;
the bare name means zoo's, except in the plugin's own families; a warning names both providers."""

import warnings

import pytest
import torch

import zoo
from zoo.components.activations import ReLU2
from zoo.core import registry


class Other(ReLU2):
    """Another activation (a plugin's) for the registrations below."""


@pytest.fixture(scope="module")
def loaded():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = zoo.load_plugin("relu2_plugin")
    assert info.error is None, info.error
    return info, [w for w in caught if issubclass(w.category, registry.NameCollisionWarning)]


def test_the_plugin_loads_whole_with_a_warning_naming_both_providers(loaded):
    info, warned = loaded
    text = "\n".join(str(w.message) for w in warned)
    assert "activation 'relu2'" in text and "relu2_plugin" in text and "zoo.components" in text
    assert "'zoo:relu2'" in text and "'relu2_plugin:relu2'" in text
    assert "checkpoint_format 'llama'" in text  # the format clashes too, and stays
    # nothing the plugin registered vanished: its family and its format are there
    assert "relu2-plugin" in zoo.list_components("family")
    assert "relu2_plugin:llama" in registry.registry("checkpoint_format")


def test_qualified_names(loaded):
    import relu2_plugin

    assert zoo.get("activation", "relu2") is ReLU2
    assert zoo.get("activation", "zoo:relu2") is ReLU2
    assert zoo.get("activation", "relu2_plugin:relu2") is relu2_plugin.PluginReLU2
    assert registry.registry("activation").qualified_names("relu2") == ["relu2_plugin:relu2", "zoo:relu2"]
    with pytest.raises(registry.UnknownNameError, match="no provider 'other'.*relu2_plugin:relu2, zoo:relu2"):
        zoo.get("activation", "other:relu2")


def test_the_plugins_family_builds_with_its_own_part_and_round_trips(loaded):
    import relu2_plugin

    spec = zoo.get_spec("relu2-plugin-tiny")
    act = spec.layer(0).ffn.config.activation
    assert act.name == "relu2_plugin:relu2" and act.cls is relu2_plugin.PluginReLU2
    again = zoo.get_spec(spec.to_dict())  # the qualified name round-trips outside the family too
    assert again.layer(0).ffn.config.activation.cls is relu2_plugin.PluginReLU2
    model = zoo.build("relu2-plugin-tiny", seed=0)
    assert isinstance(model.layers[0].ffn.act, relu2_plugin.PluginReLU2)
    assert torch.isfinite(model(torch.randint(0, 64, (1, 8)))).all()
    # a recipe of zoo's own (or a user's) that says relu2 gets zoo's
    mine = zoo.get_spec({**spec.to_dict(), "layers": {"default": {
        "mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2},
        "ffn": {"name": "mlp", "d_ff": 64, "activation": "relu2"}}}})
    assert mine.layer(0).ffn.config.activation.cls is ReLU2


def test_two_third_party_plugins_claiming_one_name_is_an_error_naming_both():
    mgr = registry.PluginManager(builtin_plugins=())
    with mgr.providing("first_plugin"):
        mgr.add_activation("shared_act", ReLU2)
    with mgr.providing("second_plugin"):
        with pytest.raises(registry.DuplicateNameError, match="first_plugin.*second_plugin"):
            mgr.add_activation("shared_act", Other)


def test_zoo_adding_a_name_after_the_plugin_keeps_both_the_same_way():
    mgr = registry.PluginManager(builtin_plugins=())
    with mgr.providing("old_plugin"):
        mgr.add_activation("newname", Other)
    with pytest.warns(registry.NameCollisionWarning, match="'old_plugin:newname'"):
        with mgr.providing("zoo.components"):
            mgr.add_activation("newname", ReLU2)
    assert mgr.registry("activation").get("newname") is ReLU2
    assert mgr.registry("activation").get("old_plugin:newname") is Other
    mgr.registry("activation").remove("newname", "zoo.components")  # withdrawing zoo's leaves the plugin's
    assert mgr.registry("activation").get("old_plugin:newname") is Other


def test_zoo_list_shows_both_entries_of_a_shared_name(loaded):
    from zoo.commands.list import rows

    found = {r["name"]: r for r in rows("activation", "*relu2")}
    assert found["relu2"]["provider"] != "relu2_plugin" and found["relu2"]["qualified"] == "zoo:relu2"
    plugin = found["relu2_plugin:relu2"]
    assert plugin["provider"] == "relu2_plugin" and plugin["shadowed_by"] == found["relu2"]["provider"]
    # an exact name asked for lists the plugin's entry too, which `zoo list` alone never showed
    assert [r["name"] for r in rows("activation", "relu2")] == ["relu2", "relu2_plugin:relu2"]
