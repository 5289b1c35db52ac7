"""DBRX (``dbrx``) against transformers on tiny random checkpoints transformers writes itself: the
clamp on the fused QKV output reached, a left-padded row, greedy tokens, decode states against its
cache, several tokens onto a state; the nested config read field by field; the preset at the size
transformers builds from the released config.

(The sweep of tests/formats/test_parity.py takes the format's tiny config too: float32 logits against a
float64 run of transformers, and a save that transformers loads into the very same weights.)"""

import json
from pathlib import Path

import pytest
import torch

import zoo
import zoo.testing as zt
from hf_pairs import (assert_logits_equal_with_a_left_padded_row, assert_several_tokens_continue_the_full_forward,
                      assert_within_reference_error, float64_twin)
from zoo.checkpoints import ConfigError, config_to_spec, ignored_fields
from zoo.checkpoints.tiny import tiny_config
from zoo.tools.accounting import account

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]  # compared with transformers in float32

RELEASED = Path(__file__).parents[1] / "data" / "configs" / "databricks--dbrx-instruct.json"


def ids_of(B, T, seed=0):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(hf_pair):
    hf, ours, _ = hf_pair("dbrx")
    return hf.eval(), ours.eval()


@torch.no_grad()
def test_the_clamp_binds_and_matters(pair):
    """The tiny config's clip_qkv (0.5) clamps a good part of every layer's q, k and v; without the
    clamp zoo computes another function."""
    hf, ours = pair
    ids = ids_of(2, 20)
    clip = hf.config.attn_config.clip_qkv
    assert ours.spec.layer(0).mixer.clip_qkv == clip == 0.5
    seen = []
    hooks = [b.norm_attn_norm.attn.Wqkv.register_forward_hook(lambda m, i, o: seen.append(o)) for b in hf.transformer.blocks]
    ref = hf(ids).logits
    for h in hooks:
        h.remove()
    assert len(seen) == 2 and all((o.abs() > clip).float().mean() > 0.2 for o in seen)
    unclipped = zoo.build_model(ours.spec.with_overrides({"layers.default.mixer.clip_qkv": None}))
    unclipped.load_state_dict(ours.state_dict())
    assert (unclipped.eval()(ids) - ref).abs().max() > 0.1
    assert_within_reference_error(ours(ids), ref, float64_twin(hf)(ids).logits)


def test_logits_match_with_a_left_padded_row(pair):
    hf, ours = pair
    assert_logits_equal_with_a_left_padded_row(hf, ours, atol=1e-5)


@torch.no_grad()
def test_greedy_tokens_and_decode_states_match_the_cache(pair):
    hf, ours = pair
    ids = ids_of(2, 9, seed=1)
    want = hf.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None,
                       attention_mask=torch.ones_like(ids))
    assert torch.equal(zoo.generate(ours, ids, max_new_tokens=10), want)

    cache = hf(ids, use_cache=True).past_key_values
    state = ours.new_state(2, None)
    ours(ids, state=state)
    for t in range(3):  # then single tokens onto both
        nxt = ids_of(2, 1, seed=10 + t)
        cache = hf(nxt, past_key_values=cache, use_cache=True).past_key_values
        ours(nxt, state=state)
    for i in range(hf.config.n_layers):
        mine, ref = state.layers[i], cache.layers[i]
        torch.testing.assert_close(mine.k[:, :, :12], ref.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.v[:, :, :12], ref.values, atol=1e-5, rtol=0)
        assert ref.values.abs().max() <= 0.5  # the cached values are clamped ones


def test_several_tokens_onto_a_state(pair):
    hf, ours = pair
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=1e-5)


def test_decoding_conformance(pair):
    _, ours = pair
    zt.check_decoding(ours, ids_of(2, 13, seed=4), what="dbrx", atol=1e-5)


def test_the_fused_tensors_map_both_ways(pair, tmp_path):
    """Experts stored as one (n_experts * d_ff, d_model) tensor per projection, the down projections
    transposed; attention as one Wqkv. zoo's stacked experts are exactly those blocks, and a save
    gives transformers back every tensor."""
    hf, ours = pair
    mlp = hf.transformer.blocks[1].ffn.experts.mlp
    E, Fd, d = 4, 24, 64
    ffn = ours.layers[1].ffn
    assert torch.equal(ffn.experts.w_gate, mlp.w1.view(E, Fd, d)) and torch.equal(ffn.experts.w_up, mlp.v1.view(E, Fd, d))
    assert torch.equal(ffn.experts.w_down, mlp.w2.view(E, Fd, d).transpose(1, 2))
    att = ours.layers[1].mixer
    assert torch.equal(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                       hf.transformer.blocks[1].norm_attn_norm.attn.Wqkv.weight)
    zoo.save_pretrained(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_config"]["clip_qkv"] == 0.5 and saved["ffn_config"]["moe_top_k"] == 2


# ------------------------------------------------------------------------------------- config

def dbrx(**fields):
    config = {**tiny_config("dbrx"), "model_type": "dbrx"}
    for key, value in fields.items():
        sub, _, rest = key.partition("__")
        if rest:
            config[sub] = {**config[sub], rest: value}
        else:
            config[key] = value
    return config


def test_the_router_follows_the_expert_weights_norm():
    """p = 1 (the default) renormalises the top-k softmax probabilities: the softmax of the top-k
    logits; null keeps them; another p has no zoo router and is refused by name."""
    assert config_to_spec(dbrx()).layer(0).ffn.router.name == "topk_softmax"
    assert config_to_spec(dbrx(ffn_config__moe_normalize_expert_weights=1)).layer(0).ffn.router.name == "topk_softmax"
    kept = config_to_spec(dbrx(ffn_config__moe_normalize_expert_weights=None)).layer(0).ffn
    assert kept.router.name == "softmax_topk" and not kept.norm_topk_prob
    with pytest.raises(ConfigError, match=r"'ffn_config\.moe_normalize_expert_weights'.*2\.0"):
        config_to_spec(dbrx(ffn_config__moe_normalize_expert_weights=2.0))


@torch.no_grad()
def test_unnormalised_expert_weights_match_transformers(hf_pair):
    hf, ours, _ = hf_pair("dbrx", ffn_config={**tiny_config("dbrx")["ffn_config"], "moe_normalize_expert_weights": None})
    assert ours.spec.layer(0).ffn.router.name == "softmax_topk"
    ids = ids_of(2, 16, seed=5)
    assert_within_reference_error(ours(ids), hf(ids).logits, float64_twin(hf)(ids).logits)


@torch.no_grad()
def test_router_jitter_is_training_noise_that_inference_ignores(hf_pair):
    """``ffn_config.moe_jitter_eps`` scales the router's input by U(1 - eps, 1 + eps) in training
    only (transformers' DbrxRouter, ``if self.training``): a config with jitter loads, and the eval
    logits are transformers' eval logits."""
    hf, ours, _ = hf_pair("dbrx", ffn_config={**tiny_config("dbrx")["ffn_config"], "moe_jitter_eps": 0.01})
    assert hf.config.ffn_config.moe_jitter_eps == 0.01
    ids = ids_of(2, 16, seed=5)
    assert_within_reference_error(ours(ids), hf(ids).logits, float64_twin(hf)(ids).logits)


@pytest.mark.parametrize("key, value, match", [
    ("attn_config__clip_qkv", 0, r"clip_qkv.*must be positive"),
    ("attn_config__clip_qkv", -8.0, r"clip_qkv.*must be positive"),
    ("attn_config__clip_qkv", "8", r"'attn_config\.clip_qkv'.*must be a number"),
    ("attn_config__kv_n_heads", 3, r"n_kv_heads"),
    ("ffn_config__moe_jitter_eps", "0.01", r"'ffn_config\.moe_jitter_eps'.*must be a number"),
    ("ffn_config__ffn_act_fn", "silu", r"'ffn_config\.ffn_act_fn'.*object"),
    ("ffn_config__ffn_act_fn", {"name": "mish"}, r"'ffn_config\.ffn_act_fn'.*mish"),
    ("tie_word_embeddings", True, r"'tie_word_embeddings'"),
    ("attn_config", [2], r"'attn_config'.*JSON object"),
])
def test_bad_fields_are_named(key, value, match):
    with pytest.raises((ConfigError, zoo.core.spec.SpecError), match=match):
        config_to_spec(dbrx(**{key: value}))


def test_clip_qkv_must_be_positive_in_a_spec():
    for bad in (0.0, -1.0):
        with pytest.raises(zoo.core.spec.SpecError, match="clip_qkv"):
            zoo.get_spec("dbrx-132b", {"layers.default.mixer.clip_qkv": bad})


def test_the_balance_loss_is_transformers_when_router_logits_are_output():
    spec = config_to_spec(dbrx(output_router_logits=True, ffn_config__moe_loss_weight=0.05))
    assert spec.layer(0).ffn.switch_pooled_loss == 0.05
    assert config_to_spec(dbrx(ffn_config__moe_loss_weight=0.05)).layer(0).ffn.switch_pooled_loss == 0.0


# ----------------------------------------------------------------------------- the release

def test_the_preset_is_the_released_config():
    from test_released_configs import load, same_as_transformers

    config = load(RELEASED)
    spec = config_to_spec(config)
    assert spec.with_overrides({"label": "dbrx-132b"}) == zoo.get_spec("dbrx-132b")
    assert ignored_fields(config) == ["router_aux_loss_coef"]  # transformers reads ffn_config.moe_loss_weight
    same_as_transformers(config)  # the count transformers builds on meta from the released file
    # transformers 5.23 drops the release's RoPE base (tests/formats/test_released_configs.py ROPE_BASE_DROPPED);
    # zoo rotates by it. When this fails, transformers reads it again: compare the base then.
    assert transformers.AutoConfig.for_model(**config).rope_parameters["rope_theta"] == 10000.0
    assert spec.position.theta == config["attn_config"]["rope_theta"] == 500000
    assert zoo.build("dbrx-132b", device="meta").num_parameters() == 131_596_523_520 == zoo.published_params("dbrx-132b")


def test_active_parameters_under_the_three_conventions():
    """Four of sixteen experts per token: the published "36B active of 132B" is the count with
    embeddings and head."""
    a = account("dbrx-132b")
    c = a["params"]["active_conventions"]
    d, f, L, V = 6144, 10752, 40, 100352
    assert a["params"]["total"] - a["params"]["active"] == L * 12 * 3 * d * f
    assert c["with_embeddings_and_head"] == 36_469_708_800
    assert c["without_input_embedding"] == c["with_embeddings_and_head"] - V * d == 35_853_146_112
    assert c["without_embeddings_and_head"] == c["with_embeddings_and_head"] - 2 * V * d == 35_236_583_424
