"""GLM-5 (format glm_moe_dsa, mixer dsa with IndexShare) against transformers on tiny random
checkpoints that transformers writes: layers whose indexer is "shared" reuse the previous full
layer's top-k selection, on sequences longer than index_topk so that the selection decides what
each query sees. Logits with a left-padded row, greedy tokens, the decode state against
transformers' cache, several tokens fed onto a state; the schedule transformers derives from
index_topk_freq / index_skip_topk_offset / index_topk_pattern; the preset against transformers'
build of GLM-5's config; the cost of shared layers; refusals by field."""

import pytest
import torch

import zoo
from zoo.checkpoints import ConfigError, _architecture, config_to_spec
from zoo.checkpoints.hf.formats.glm_moe_dsa import schedule
from zoo.checkpoints.hf.format import Fields
from zoo.core.spec import ModelSpec, SpecError

from hf_pairs import (assert_dsa_state_is_the_cache, assert_logits_equal_with_a_left_padded_row,
                      assert_several_tokens_continue_the_full_forward, assert_within_reference_error, float64_twin)
from test_deepseek_v32 import gaps_at_the_cut  # noqa: F401  (a fixture)

pytestmark = pytest.mark.parity  # compared with transformers in float32

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

# Four layers: full, shared, full, shared (layer 0 dense, the rest MoE): index_topk 5 of up to 20 keys,
# with 8 indexer heads so that an index score is rarely an exact 0 (no ties at the cut).
SHARED = {"num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"], "index_topk": 5,
          "index_n_heads": 8}


@pytest.fixture(scope="module")
def pair(hf_pair):
    hf, ours, _ = hf_pair("glm_moe_dsa", std=0.15, **SHARED)
    return hf, ours


def test_the_shared_layers_reuse_the_previous_full_layers_selection(pair):
    hf, ours = pair
    assert [layer.self_attn.skip_topk for layer in hf.model.layers] == [False, True, False, True]
    assert [layer.mixer.source for layer in ours.layers] == [None, 0, None, 2]
    assert [hasattr(layer.mixer, "indexer") for layer in ours.layers] == [True, False, True, False]
    assert all(layer.ffn.router.bias.abs().sum() > 0 for layer in ours.layers[1:])


def batch():
    return torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_logits_equal_transformers_with_a_left_padded_row(pair, gaps_at_the_cut):  # noqa: F811
    """Each query attends to its 5 best keys of up to 20 (in the padded row, of its real ones)."""
    hf, ours = pair
    assert_logits_equal_with_a_left_padded_row(hf, ours)
    assert len(gaps_at_the_cut) == 2 and min(gaps_at_the_cut) > 2e-6, "a tie at the cut: choose another seed"


@torch.no_grad()
def test_sparse_logits_are_within_transformers_own_error(pair, gaps_at_the_cut):  # noqa: F811
    """zoo's float32 logits are no further from transformers' float64 run than twice transformers' own
    float32 are."""
    hf, ours = pair
    ids = batch()
    got = ours(ids)
    assert min(gaps_at_the_cut) > 2e-6, "a tie at the cut: choose another seed"
    assert_within_reference_error(got, hf(ids).logits, float64_twin(hf)(ids).logits)


@torch.no_grad()
def test_the_shared_selection_changes_the_result(pair):
    """Were a shared layer to attend to every visible key, the logits would move: the selection it
    reuses is binding."""
    _, ours = pair
    ids = batch()
    spec = ours.spec.with_overrides({"layers.*.mixer.index_topk": 64})
    dense = zoo.build_model(spec, device="meta")
    dense.load_state_dict(ours.state_dict(), assign=True)
    assert (dense(ids) - ours(ids)).abs().max() > 1e-2


@torch.no_grad()
def test_greedy_tokens_equal_transformers(pair, gaps_at_the_cut):  # noqa: F811
    hf, ours = pair
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    want = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1, pad_token_id=0,
                       eos_token_id=None)
    assert torch.equal(zoo.generate(ours, ids, 12), want)
    assert min(gaps_at_the_cut) > 2e-6, "a tie at the cut: choose another seed"


@torch.no_grad()
def test_the_decode_state_is_transformers_cache_and_carries_the_selection(pair, gaps_at_the_cut):  # noqa: F811
    """A prompt of 9 (past index_topk), then one token at a time: the logits and every layer's state
    equal transformers' (the latent and rotated key part, the indexer keys its full layers hold);
    shared layers keep no indexer keys, and their queries attend where the full layer before them
    chose in the same step."""
    hf, ours = pair
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    cache = transformers.DynamicCache(config=hf.config)
    state = ours.new_state(2, 13)
    for a in range(9, 14):
        start = 0 if a == 9 else a - 1
        ref = hf(ids[:, start:a], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(ours(ids[:, start:a], state=state), ref, atol=1e-5, rtol=0)
        assert_dsa_state_is_the_cache(state, cache, a)
    assert [s.keys is None for s in state.layers] == [False, True, False, True]
    assert min(gaps_at_the_cut) > 2e-6, "a tie at the cut: choose another seed"
    held = sum(t.keys.numel() + t.values.numel() + (t.indexer_keys.numel() if t.indexer_keys is not None else 0)
               for t in cache.layers)
    assert state.nbytes() == held * 4


@torch.no_grad()
def test_several_tokens_fed_onto_a_state_continue_the_full_forward(pair, gaps_at_the_cut):  # noqa: F811
    """A prefill of 7, then 12 tokens at once, then the last 4 (each query past index_topk): zoo's
    state and transformers' cache each give what their full forward gives."""
    hf, ours = pair
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=1e-5)
    assert min(gaps_at_the_cut) > 2e-6, "a tie at the cut: choose another seed"


@torch.no_grad()
def test_a_checkpoint_zoo_saves_loads_in_transformers(pair, tmp_path):
    """zoo writes no indexer for a shared layer (GLM's releases have none there); transformers builds
    one it never runs, so its reload of zoo's file gives the same logits."""
    hf, ours = pair
    zoo.save_pretrained(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert back.config.indexer_types == SHARED["indexer_types"]
    ids = batch()
    torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-6, rtol=0)
    again = zoo.from_pretrained(tmp_path)
    assert again.spec == ours.spec


# ------------------------------------------------------------------------------------- schedule

@pytest.mark.parametrize("fields", [
    {},
    {"index_topk_freq": 4, "index_skip_topk_offset": 3},
    {"index_topk_freq": 2, "index_skip_topk_offset": 1},
    {"index_topk_freq": 3},
    {"index_topk_pattern": "FSSFFSFS"},
    {"index_topk_pattern": "FFSS", "indexer_types": ["full", "shared"] * 4},  # the list wins
])
def test_the_indexer_schedule_is_the_one_transformers_derives(fields):
    config = transformers.GlmMoeDsaConfig(num_hidden_layers=8, **fields)
    f = Fields({"num_hidden_layers": 8, **fields}, "glm_moe_dsa")
    assert schedule(f, 8) == config.indexer_types


def test_the_released_sizes_share_every_fourth_layer_as_glm_5_2_does():
    types = schedule(Fields({"index_topk_freq": 4, "index_skip_topk_offset": 3}, "glm_moe_dsa"), 78)
    assert types.count("full") == 21 and types[:8] == ["full"] * 3 + ["shared"] * 3 + ["full", "shared"]


# ------------------------------------------------------------------------------- preset and cost

def test_the_preset_is_transformers_build_of_glm_5s_config():
    """No copy of zai-org/GLM-5's config.json is stored anywhere this project can read; transformers'
    GlmMoeDsaConfig defaults are GLM-5's sizes (its docstring's checkpoint), and its model built from
    them on the meta device has the preset's count. (The RoPE base 1e6 is the one copies of GLM-5's
    config in other projects' code give; transformers' default is 1e4.)"""
    config = transformers.GlmMoeDsaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    fields = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "architectures")}
    spec = config_to_spec(fields)
    model = zoo.build("glm-5", device="meta")
    assert _architecture(spec) == _architecture(model.spec.with_overrides(mtp=None))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert model.num_parameters() == zoo.published_params("glm-5")


def test_active_parameters_under_the_three_conventions():
    """Per token 8 of the 256 experts of each of the 75 MoE layers run (each 3 x 6144 x 2048);
    GLM-5's "40B active" is the count without the input embedding."""
    from zoo.tools.accounting import account

    params = account(zoo.build("glm-5", device="meta"), context=4096)["params"]
    idle = 75 * (256 - 8) * 3 * 6144 * 2048
    embed = 154880 * 6144
    assert params["active_conventions"] == {"with_embeddings_and_head": 743_911_199_232 - idle,
                                            "without_input_embedding": 743_911_199_232 - idle - embed,
                                            "without_embeddings_and_head": 743_911_199_232 - idle - 2 * embed}
    assert params["active_conventions"]["without_input_embedding"] == 40_833_126_912


def test_shared_layers_cost_no_indexer():
    """A shared layer attends to the same top-k as a full one but scores no key and keeps no indexer
    key: its FLOPs per token are MLA's over min(context, index_topk) keys, its state MLA's."""
    from zoo.tools.accounting import account

    config = {"model_type": "glm_moe_dsa", **tiny.tiny_config("glm_moe_dsa"), **SHARED}
    model = zoo.build_model(config_to_spec(config), device="meta")
    full, shared = model.layers[0].mixer, model.layers[1].mixer
    per_key = 2 * 4 * (12 + 8 + 20)  # 2 H (nope + rope + v)
    index_per_key = 2 * 8 * (16 + 1)  # 2 H_I (d_I + 1)
    for context in (3, 64):
        assert shared.cost(context).flops == per_key * min(context, 5)
        assert full.cost(context).flops == per_key * min(context, 5) + index_per_key * context
    assert shared.cost(64).state_per_token == 24 + 8 and full.cost(64).state_per_token == 24 + 8 + 16
    state = account(model, context=100, dtype="bf16")["decode_state"]
    assert state["bytes_per_token"] == (4 * (24 + 8) + 2 * 16) * 2
    assert "shared: layer 0" in shared.facts()["indexer"]


# ------------------------------------------------------------------------------------- refusals

def three_layers(**fields):
    """The tiny config with three layers and no indexer_types of its own, and ``fields``."""
    config = {k: v for k, v in tiny.tiny_config("glm_moe_dsa").items() if k != "indexer_types"}
    return {"model_type": "glm_moe_dsa", **config, "num_hidden_layers": 3, **fields}


@pytest.mark.parametrize("fields, key", [
    ({"indexer_types": ["shared", "full", "full"]}, "indexer_types"),
    ({"index_topk_pattern": "SFF"}, "index_topk_pattern"),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, "index_topk_freq"),  # layer 0: max(1, 0) % 2 != 0
])
def test_a_shared_layer_before_any_full_one_is_refused_naming_the_field(fields, key):
    with pytest.raises(ConfigError, match=rf"{key}.*none comes before it"):
        config_to_spec(three_layers(**fields))


@pytest.mark.parametrize("field, value, match", [
    ("indexer_types", ["full", "shared"], "each of the 3 layers"),
    ("indexer_types", ["full", "partial", "full"], "each of the 3 layers"),
    ("index_topk_pattern", "FXF", "'F' \\(full\\) and 'S' \\(shared\\)"),
    ("layer_types", ["full_attention"] * 3, "indexed_attention"),
    ("mlp_layer_types", ["sparse", "dense", "sparse"], "first_k_dense_replace"),
])
def test_inconsistent_configs_are_refused_naming_the_field(field, value, match):
    with pytest.raises(ConfigError, match=rf"{field}.*{match}"):
        config_to_spec(three_layers(**{field: value}))


def test_a_spec_whose_first_dsa_layer_shares_is_refused_naming_the_field():
    data = config_to_spec(three_layers()).to_dict()
    data["layers"]["dense"]["mixer"]["indexer"] = "shared"
    with pytest.raises(SpecError, match=r"layers\.dense\.mixer\.indexer: 'shared' at layer 0 .*make the first DSA"):
        ModelSpec.from_dict(data)
