"""Nemotron 3's MoE layers (``nemotron_h`` with ``E`` / ``moe`` layers) against transformers on tiny
random checkpoints it writes: a latent MoE (routed experts on a 24-wide latent of a 32-wide token,
expert width 20, shared expert 28: every width different), group-limited sigmoid routing with a
random selection bias, between Mamba-2, attention and MLP layers. Logits with a left-padded row,
greedy tokens, the decode state, several tokens fed onto a state; refusals by field."""

import pytest
import torch

import zoo
from zoo.checkpoints import ConfigError, config_to_spec
from zoo.core.spec import SpecError

from hf_pairs import assert_several_tokens_continue_the_full_forward
from test_nemotron_h import greedy_and_states_equal
# nemotron_h's own left-padding test, run here on this module's pair (the fixture is looked up here)
from test_nemotron_h import test_logits_equal_transformers_with_a_left_padded_row  # noqa: F401

pytestmark = pytest.mark.parity

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

MOE = {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "moe", "linear_attention"],
       "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 20,
       "moe_shared_expert_intermediate_size": 28, "moe_latent_size": 24, "n_group": 2, "topk_group": 1,
       "routed_scaling_factor": 1.5}


@pytest.fixture(scope="module")
def pair(hf_pair):
    return hf_pair("nemotron_h", std=0.1, **MOE)


def test_the_moe_layers_are_latent_moes_as_transformers_builds_them(pair):
    hf, ours, _ = pair
    moe = ours.layers[1].ffn
    assert (moe.latent_down.weight.shape, moe.experts.w_up.shape, moe.shared.up.weight.shape) == ((24, 32), (8, 20, 24), (28, 32))
    assert hf.model.layers[1].mixer.fc1_latent_proj.weight.shape == (24, 32)
    assert moe.router.bias.abs().sum() > 0  # the selection bias was drawn at random
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


@torch.no_grad()
def test_the_routed_experts_run_between_the_latent_projections(pair):
    """Routed on the whole token, the experts' weighted sum computed on its latent and projected back,
    the shared expert on the whole token."""
    _, ours, _ = pair
    moe = ours.layers[1].ffn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    flat = x.reshape(-1, 32)
    r = moe.route(flat)
    routed = moe.latent_up(moe.routed(moe.latent_down(flat), r.indices, r.weights)[0])
    assert torch.allclose(moe(x).reshape(-1, 32), routed + moe.shared(flat), atol=1e-6)


@torch.no_grad()
def test_greedy_tokens_and_decode_states_equal_transformers(pair):
    hf, ours, _ = pair
    assert greedy_and_states_equal(hf, ours) == {"linear_attention", "full_attention", "mlp", "moe"}


@torch.no_grad()
def test_several_new_tokens_onto_an_existing_state(pair):
    hf, ours, _ = pair
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=1e-4)  # SSD's


@torch.no_grad()
def test_a_checkpoint_zoo_saves_is_transformers_own(pair, tmp_path):
    hf, ours, _ = pair
    zoo.save_pretrained(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.config.moe_latent_size == 24


@pytest.mark.parametrize("latent", [32, 40])
def test_a_latent_that_does_not_fit_is_refused_naming_the_field(latent):
    config = {**tiny.tiny_config("nemotron_h"), **MOE, "moe_latent_size": latent, "model_type": "nemotron_h"}
    with pytest.raises(ConfigError, match=r"moe_latent_size.*does not fit"):
        config_to_spec(config)
    spec = config_to_spec({**config, "moe_latent_size": 24}).to_dict()
    spec["layers"]["moe"]["ffn"]["latent_dim"] = latent
    with pytest.raises(SpecError, match=r"layers\.moe\.ffn\.latent_dim: .* does not fit"):
        zoo.ModelSpec.from_dict(spec)


def test_biased_experts_are_refused_naming_the_field():
    config = {**tiny.tiny_config("nemotron_h"), **MOE, "mlp_bias": True, "model_type": "nemotron_h"}
    with pytest.raises(ConfigError, match=r"mlp_bias"):
        config_to_spec(config)


NANO = {"model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
        "chunk_size": 128, "max_position_embeddings": 262144, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "n_routed_experts": 128, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "num_experts_per_tok": 6, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "mlp_hidden_act": "relu2"}


def test_the_nano_preset_is_transformers_build_of_its_sizes():
    """Nemotron 3 Nano 30B-A3B's sizes (Megatron-Bridge's Nemotron3NanoProvider; its config.json is not
    stored here): the preset is the spec zoo reads from them, with transformers' count on the meta device,
    about 3B active per token under each of the three conventions."""
    from zoo.tools.accounting import account

    spec = zoo.model.recipes.get_spec("nemotron-3-nano-30b-a3b")
    assert spec.with_overrides({"label": None}) == config_to_spec(NANO)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**NANO))
    model = zoo.build("nemotron-3-nano-30b-a3b", device="meta")
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters()) == 31_577_937_344
    idle = 23 * (128 - 6) * 2 * 1856 * 2688  # the experts a token does not use, in each MoE layer
    embed = 131072 * 2688
    assert account(model, context=4096)["params"]["active_conventions"] == {
        "with_embeddings_and_head": 31_577_937_344 - idle, "without_input_embedding": 31_577_937_344 - idle - embed,
        "without_embeddings_and_head": 31_577_937_344 - idle - 2 * embed}
