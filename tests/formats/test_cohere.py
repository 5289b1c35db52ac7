"""Command R (``cohere``) and Command R7B / Command A (``cohere2``) against transformers on tiny random
checkpoints it writes (logits and the round trip are in test_parity.py's sweep): the parallel
LayerNorm block, interleaved RoPE, the logit scale, cohere2's windows on three layers of four and its
global layers without positions, greedy tokens past the window, several tokens onto a state, the
presets' sizes, and what cannot be expressed refused by name."""

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


def test_the_parts_are_read(hf_pair):
    _, ours, _ = hf_pair("cohere")
    spec = ours.spec
    assert spec.layer(0).block.name == "parallel" and spec.layer(0).norm.name == "layernorm"
    assert not spec.layer(0).norm.bias and spec.position.layout == "interleaved"
    assert spec.head.scale == 0.5 and spec.layer(0).mixer.head_dim == 24


def test_cohere2_slides_three_layers_of_four_and_its_global_layers_have_no_position(hf_pair):
    hf, ours, _ = hf_pair("cohere2")
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert [ours.spec.layer(i).mixer.window for i in range(4)] == [8, 8, 8, None]
    assert [ours.spec.position_for(i).name for i in range(4)] == ["rope"] * 3 + ["nope"]


@torch.no_grad()
def test_the_logit_scale_is_reached(hf_pair):
    hf, ours, _ = hf_pair("cohere")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    unscaled = zoo.build_model(ours.spec.with_overrides({"head.scale": None}), device="meta")
    unscaled.load_state_dict(ours.state_dict(), assign=True)
    torch.testing.assert_close(unscaled(ids) * 0.5, hf(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["cohere", "cohere2"])
def test_greedy_tokens_past_the_window_and_several_tokens_onto_a_state(hf_pair, model_type):
    hf, ours, _ = hf_pair(model_type)
    assert_logits_equal_with_a_left_padded_row(hf, ours, atol=5e-5)  # (the float64-bounded check: test_parity.py)
    assert_greedy_tokens_equal(hf, ours, prompt=6, new=14)  # past the window of 8
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=5e-5)


@pytest.mark.parametrize("preset,model_type", [("command-r-35b", "cohere"), ("command-r7b", "cohere2")])
def test_the_presets_are_what_transformers_builds_from_their_config(preset, model_type):
    from test_released_configs import same_as_transformers

    model = zoo.build(preset, device="meta")
    config = {**get_format(model_type).spec_to_config(model.spec), "model_type": model_type}
    same_as_transformers(config)
    assert config["logit_scale"] == model.spec.head.scale


def test_cohere2_reads_the_older_sliding_window_pattern_and_transformers_defaults():
    from test_released_configs import same_as_transformers

    config = {"model_type": "cohere2", **tiny_config("cohere2"), "sliding_window_pattern": 2}
    same_as_transformers(config)
    spec = config_to_spec(config)
    assert [spec.layer(i).mixer.window for i in range(4)] == [8, None, 8, None]
    for model_type in ("cohere", "cohere2"):
        defaults = transformers.AutoConfig.for_model(model_type).to_dict()
        same_as_transformers({"model_type": model_type, **{k: defaults[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}})


def test_what_zoo_cannot_hold_is_refused_by_name():
    with pytest.raises(ConfigError, match="'use_qk_norm'"):
        config_to_spec({"model_type": "cohere", **tiny_config("cohere"), "use_qk_norm": True})
    spec = config_to_spec({"model_type": "cohere2", **tiny_config("cohere2")})
    with pytest.raises(ValueError, match="no position encoding"):
        get_format("cohere2").spec_to_config(spec.with_overrides({"layers.global.position": {"name": "rope"}}))
