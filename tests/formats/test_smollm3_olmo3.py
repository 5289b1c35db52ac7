"""SmolLM3 (``smollm3``: NoPE every fourth layer) and OLMo 3 (``olmo3``: OLMo 2 with sliding windows
on three layers of four) against transformers on tiny random checkpoints it writes (their logits and
round trip are in test_parity.py's sweep): the layer kinds read, greedy tokens past the window and
across the NoPE layers, several tokens onto a decode state, the presets' sizes, bad input named."""

import pytest
import torch

import zoo
from zoo.checkpoints import ConfigError, config_to_spec
from zoo.checkpoints.hf.format import get_format
from zoo.checkpoints.tiny import tiny_config

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]

from hf_pairs import (assert_greedy_tokens_equal, assert_logits_equal_with_a_left_padded_row,  # noqa: E402
                      assert_several_tokens_continue_the_full_forward)


def test_smollm3_reads_its_nope_layers_and_windows(hf_pair):
    hf, ours, _ = hf_pair("smollm3")
    assert hf.config.no_rope_layers == [1, 0, 1, 0]  # no_rope_layer_interval 2
    assert [ours.spec.position_for(i).name for i in range(4)] == ["rope", "nope"] * 2
    # transformers' rule: with use_sliding_window, the NoPE layers slide
    assert [ours.spec.layer(i).mixer.window for i in range(4)] == [None, 8] * 2


def test_olmo3_reads_three_sliding_layers_to_one_full_each_with_its_rope(hf_pair):
    _, ours, _ = hf_pair("olmo3")
    assert [ours.spec.layer(i).mixer.window for i in range(4)] == [8, 8, 8, None]
    assert ours.spec.position_for(0).scaling is None and ours.spec.position_for(3).scaling.name == "yarn"


@pytest.mark.parametrize("model_type", ["smollm3", "olmo3"])
def test_greedy_tokens_past_the_window_and_several_tokens_onto_a_state(hf_pair, model_type):
    hf, ours, _ = hf_pair(model_type)
    # (the float32 error against a float64 run is bounded in test_parity.py; here the two float32 runs agree)
    assert_logits_equal_with_a_left_padded_row(hf, ours, atol=5e-5)
    assert_greedy_tokens_equal(hf, ours, prompt=6, new=14)  # past the window of 8
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=5e-5)


@pytest.mark.parametrize("preset,model_type", [("smollm3-3b", "smollm3"), ("olmo3-7b", "olmo3"), ("olmo3-32b", "olmo3")])
def test_the_presets_are_what_transformers_builds_from_their_config(preset, model_type):
    from test_released_configs import same_as_transformers

    model = zoo.build(preset, device="meta")
    config = {**get_format(model_type).spec_to_config(model.spec), "model_type": model_type}
    same_as_transformers(config)
    assert zoo.core.spec.differences(config_to_spec(config).to_dict(), model.spec.to_dict()) == [
        ("label", None, preset), *[(f"layers.{k}.ffn.name", "glu", "swiglu") for k in sorted(model.spec.layers)]]


def test_transformers_defaults_and_the_nope_schedule():
    from test_released_configs import same_as_transformers

    for model_type in ("smollm3", "olmo3"):
        defaults = transformers.AutoConfig.for_model(model_type).to_dict()
        same_as_transformers({"model_type": model_type, **{k: defaults[k] for k in
                                                           ("vocab_size", "hidden_size", "intermediate_size",
                                                            "num_hidden_layers", "num_attention_heads")}})
    spec = config_to_spec({"model_type": "smollm3", **tiny_config("smollm3"), "no_rope_layer_interval": 4,
                           "num_hidden_layers": 8, "use_sliding_window": False})
    assert [spec.position_for(i).name for i in range(8)] == ["rope", "rope", "rope", "nope"] * 2


@pytest.mark.parametrize("field,value,match", [
    ("no_rope_layers", [1, 2, 1, 0], "no_rope_layers"), ("no_rope_layers", [1, 0], "no_rope_layers"),
    ("no_rope_layer_interval", 0, "no_rope_layer_interval"), ("use_sliding_window", "yes", "use_sliding_window")])
def test_bad_smollm3_fields_are_named(field, value, match):
    with pytest.raises(ConfigError, match=match):
        config_to_spec({"model_type": "smollm3", **tiny_config("smollm3"), field: value})
