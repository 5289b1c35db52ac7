"""MiniMax-M2 (``minimax_m2``) against transformers on tiny random checkpoints it writes itself (the
selection-bias buffer drawn at random too): QK-norm over the projections, partial RoPE with
head_dim != d_model / heads, sigmoid routing with the bias, a left-padded row, greedy tokens, several
tokens fed onto a decode state, the round trip, and bad input named."""

import pytest
import torch

import zoo
import zoo.testing as zt
from zoo.checkpoints import ConfigError, config_to_spec
from zoo.checkpoints.tiny import tiny_config

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]

from hf_pairs import assert_logits_equal_with_a_left_padded_row, assert_several_tokens_continue_the_full_forward  # noqa: E402


@pytest.fixture(scope="module")
def pair(hf_pair):
    return hf_pair("minimax_m2")


def test_the_parts_are_read(pair):
    hf, ours, _ = pair
    spec = ours.spec
    att, moe = spec.layer(0).mixer, spec.layer(0).ffn
    assert (att.n_heads, att.n_kv_heads, att.head_dim, att.qk_norm) == (4, 2, 24, "proj")
    assert spec.position.rotary_fraction == 0.5 and spec.position.layout == "half"
    assert moe.router.name == "sigmoid_group" and moe.router.selection_bias and moe.norm_topk_prob
    bias = hf.model.layers[1].mlp.e_score_correction_bias
    assert bias.abs().max() > 0  # drawn, so the choice depends on it
    torch.testing.assert_close(ours.layers[1].ffn.router.bias, bias)


def test_logits_match_with_a_left_padded_row(pair):
    hf, ours, _ = pair
    assert_logits_equal_with_a_left_padded_row(hf, ours, atol=1e-5)


def test_greedy_tokens_and_several_tokens_onto_a_state(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        assert torch.equal(zoo.generate(ours, ids, max_new_tokens=8), want)
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=1e-5)


def test_decoding_conformance(pair):
    _, ours, _ = pair
    zt.check_decoding(ours, torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(2)),
                      what="minimax_m2", atol=1e-5)


def test_round_trip_through_transformers(pair, tmp_path):
    hf, ours, _ = pair
    zoo.save_pretrained(ours, tmp_path / "zoo")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zoo")
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_bad_input_is_named(pair):
    with pytest.raises(ConfigError, match="'router_jitter_noise'"):
        config_to_spec({**tiny_config("minimax_m2"), "model_type": "minimax_m2", "router_jitter_noise": 0.1})
    _, ours, _ = pair
    with pytest.raises(ValueError, match="norm_topk_prob"):
        zoo.checkpoints.hf.format.get_format("minimax_m2").spec_to_config(
            ours.spec.with_overrides({"layers.*.ffn.norm_topk_prob": False}))


def test_the_releases_rotary_dim_is_read(tmp_path):
    """Released MiniMax-M2 config.json files state partial RoPE as ``rotary_dim`` alone (beside a
    top-level ``rope_theta``); transformers reads it as ``partial_rotary_factor = rotary_dim /
    head_dim``. A checkpoint in that spelling gives transformers' logits, and strict reading accepts it."""
    import json

    hf = zoo.checkpoints.tiny.make_tiny("minimax_m2", tmp_path, overrides={
        "rope_parameters": None, "rope_theta": 10000.0, "rotary_dim": 12})
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.5  # 12 of head_dim 24
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, rotary_dim=12)  # the release's spelling
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = config_to_spec(cfg, strict=True)
    assert spec.position.rotary_fraction == 0.5 or spec.position.rotary_dim == 12
    ours = zoo.from_pretrained(tmp_path)
    assert_logits_equal_with_a_left_padded_row(hf, ours, atol=1e-5)
    # rope_parameters' own factor wins over rotary_dim, as transformers' setdefault gives it
    spec = config_to_spec({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 0.25}})
    assert spec.position.rotary_fraction == 0.25
