"""DeepSeek-V2 and DeepSeek-V3 against transformers on tiny random checkpoints that transformers
itself writes (its routers' selection-bias buffers randomised too): fp32 logits within 1e-5 with a
left-padded row, greedy tokens identical, and zoo's decode state equal to what transformers'
DynamicCache stores (the normed latent and the rotated key part), after a prefill and after several
tokens fed onto it. Then the released configs and their presets, and refusals by field."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import zoo
from zoo.tools.accounting import account
from zoo.checkpoints import ConfigError, config_to_spec, ignored_fields

from hf_pairs import assert_logits_equal_with_a_left_padded_row
from test_released_configs import load

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
# Each vendor's headline active count (billions): DeepSeek-V2-Lite 2.4B, V2 21B, V3 37B.
HEADLINES = {"deepseek-v2-lite": 2.4, "deepseek-v2": 21, "deepseek-v3": 37}
# (model_type, overrides of the format's tiny config): V2 with a q latent and greedy routing, V2-Lite's
# shape (no q latent, group-limited greedy), V3 with and without rope_interleave.
CASES = {
    "v2-greedy": ("deepseek_v2", {"q_lora_rank": 16, "topk_method": "greedy", "n_group": None, "topk_group": None}),
    "v2-grouped": ("deepseek_v2", {}),
    "v3": ("deepseek_v3", {}),
    "v3-half": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None, "first_k_dense_replace": 0}),
}


@pytest.fixture(scope="module")
def pair(hf_pair):
    # Weights at std 0.1 (as tests/parts/test_moe.py: fp32 summation order alone moves larger logits by
    # 1e-5); the routers' e_score_correction_bias buffers are drawn at random too.
    return lambda case: hf_pair(CASES[case][0], std=0.1, **CASES[case][1])[:2]


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_equal_transformers_with_a_left_padded_row(case, pair):
    hf, ours = pair(case)
    if CASES[case][0] == "deepseek_v3":  # the selection bias is loaded, and changes which experts are chosen
        router = ours.layers[-1].ffn.router
        scores = router.logits(torch.randn(64, 64, generator=torch.Generator().manual_seed(3))).sigmoid()
        unbiased = dataclasses.replace(router.cfg, selection_bias=False)
        plain = type(router)(unbiased, d_model=64, n_experts=router.n_experts, top_k=router.top_k)
        assert not torch.equal(router.select(scores).sort(-1).values, plain.select(scores).sort(-1).values)
    assert_logits_equal_with_a_left_padded_row(hf, ours)


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_greedy_tokens_equal_transformers(case, pair):
    hf, ours = pair(case)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    want = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1, pad_token_id=0,
                       eos_token_id=None)
    assert torch.equal(zoo.generate(ours, ids, 12), want)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("decode", ["absorbed", "plain"])
@torch.no_grad()
def test_the_decode_state_is_transformers_cache_after_prefill_and_several_tokens(case, decode, pair):
    hf, ours = pair(case)
    for layer in ours.layers:
        layer.mixer.cfg = dataclasses.replace(layer.mixer.cfg, decode=decode)
    try:
        check_state_against_cache(hf, ours)
    finally:
        for layer in ours.layers:
            layer.mixer.cfg = dataclasses.replace(layer.mixer.cfg, decode="absorbed")


def check_state_against_cache(hf, ours):
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(2))
    cache = transformers.DynamicCache(config=hf.config)
    state = ours.new_state(2, 14)  # sized once (without a length it grows by doubling)
    for a, b in ((0, 9), (9, 13), (13, 14)):  # a prompt, several tokens onto it, then one
        ref = hf(ids[:, a:b], past_key_values=cache, use_cache=True).logits
        got = ours(ids[:, a:b], state=state)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        for i, (mine, theirs) in enumerate(zip(state.layers, cache.layers)):
            # transformers stores the latent as keys (B, 1, T, kv_lora_rank) and the rotated key part as values
            torch.testing.assert_close(mine.k[:, :, :b], theirs.keys, atol=1e-5, rtol=0, msg=f"layer {i} latent")
            torch.testing.assert_close(mine.v[:, :, :b], theirs.values, atol=1e-5, rtol=0, msg=f"layer {i} k_rope")
    assert state.nbytes() == sum(t.keys.numel() + t.values.numel() for t in cache.layers) * 4


# ------------------------------------------------------------------------------ released configs

def test_published_sizes():
    assert zoo.build("deepseek-v2-lite", device="meta").num_parameters() == 15_706_484_224
    assert zoo.build("deepseek-v3", device="meta").num_parameters() == 671_026_404_352  # without its MTP module


@pytest.mark.parametrize("preset", sorted(HEADLINES))
def test_active_parameters_under_the_three_conventions(preset):
    """The released model's experts are counted top-k of n, the shared experts and dense layers whole
    (docs/mechanisms/moe.md); DeepSeek's headline lies between the counts without and with embeddings and head."""
    a = account(preset)
    c = a["params"]["active_conventions"]
    spec = zoo.get_spec(preset)
    matrix = spec.vocab_size * spec.d_model
    assert c["without_input_embedding"] == c["with_embeddings_and_head"] - matrix
    assert c["without_embeddings_and_head"] == c["with_embeddings_and_head"] - 2 * matrix
    assert c["without_embeddings_and_head"] / 1e9 < HEADLINES[preset] < c["with_embeddings_and_head"] / 1e9
    moe = spec.layer(spec.n_layers - 1).ffn
    inactive_per_layer = (moe.n_experts - moe.top_k) * 3 * moe.d_ff * spec.d_model
    sparse = sum(spec.layer(i).ffn.name == "moe" for i in range(spec.n_layers))
    assert a["params"]["total"] - a["params"]["active"] == sparse * inactive_per_layer


def test_released_extras_are_kept_as_transformers_ignores_them():
    assert ignored_fields(load(CONFIGS / "deepseek-ai--DeepSeek-V2-Lite.json")) == ["aux_loss_alpha", "scoring_func", "seq_aux"]
    assert ignored_fields(load(CONFIGS / "deepseek-ai--DeepSeek-V3.json")) == [
        "aux_loss_alpha", "ep_size", "scoring_func", "seq_aux", "topk_method"]


def test_deepseek_v3_state_is_61_layers_of_512_plus_64_values_per_token():
    state = account("deepseek-v3", context=1000, dtype="bf16")["decode_state"]
    assert state["bytes_per_token"] == 61 * (512 + 64) * 2
    assert state["mha_bytes_per_token"] == 61 * 128 * (128 + 64 + 128) * 2
    assert state["bytes"] == 1000 * state["bytes_per_token"]


def test_describe_shows_the_latent_state_beside_mha(capsys):
    from zoo.cli import main

    assert main(["describe", "deepseek-v3", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"KV cache/token \(bf16\) +70,272 B", text)
    assert re.search(r"MHA with the same heads +4,997,120 B .*71\.1x", text)


# ------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("model_type, field, value, match", [
    ("deepseek_v2", "num_key_value_heads", 2, "differs from num_attention_heads"),
    ("deepseek_v2", "topk_method", "noaux_tc", "not supported"),
    ("deepseek_v3", "moe_layer_freq", 2, "not supported"),
    ("deepseek_v3", "qk_rope_head_dim", 7, "rotated in pairs"),
    ("deepseek_v3", "kv_lora_rank", 0, "must be positive"),
    ("deepseek_v3", "v_head_dim", None, "required"),
])
def test_inconsistent_configs_are_refused_naming_the_field(model_type, field, value, match):
    config = {"model_type": model_type, **tiny.tiny_config(model_type), field: value}
    with pytest.raises((ConfigError, zoo.core.spec.SpecError), match=rf"{field}.*{match}"):
        config_to_spec(config)
