"""GLM-4.5 (``glm4_moe``) against transformers on tiny random checkpoints it writes, the selection-bias
buffer drawn too (logits and the round trip are in test_parity.py's sweep): GQA with q/k/v biases
and per-head QK-norm, RoPE on half of each head, a dense first layer, sigmoid routing with the bias
over groups, the shared expert; greedy tokens, several tokens onto a state, the MTP module saved and
read back, the presets' sizes."""

import pytest
import torch

import zoo
import zoo.testing as zt
from zoo.checkpoints import config_to_spec
from zoo.checkpoints.hf.format import get_format
from zoo.checkpoints.tiny import tiny_config

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]

from hf_pairs import (assert_greedy_tokens_equal, assert_logits_equal_with_a_left_padded_row,  # noqa: E402
                      assert_several_tokens_continue_the_full_forward, assert_within_reference_error, float64_twin)


def test_the_parts_are_read(hf_pair):
    hf, ours, _ = hf_pair("glm4_moe")
    att, moe = ours.spec.layer(0).mixer, ours.spec.layer(1).ffn
    assert (att.n_heads, att.n_kv_heads, att.head_dim, att.bias, att.out_bias, att.qk_norm) == (4, 2, 24, True, False, "head")
    assert ours.spec.position.rotary_fraction == 0.5 and ours.spec.layer(0).ffn.name != "moe"
    assert moe.router.name == "sigmoid_group" and moe.router.n_groups == 4 and moe.routed_scaling == 2.5
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # drawn, so the choice depends on it
    torch.testing.assert_close(ours.layers[1].ffn.router.bias, bias)
    assert ours.spec.mtp is None  # transformers wrote no MTP tensors (its config still counts one)


@torch.no_grad()
def test_without_qk_norm_and_with_the_default_rotary_fraction(hf_pair):
    """GLM-4.5-Air has no QK-norm; a config without partial_rotary_factor rotates half (Glm4MoeConfig)."""
    hf, ours, _ = hf_pair("glm4_moe", use_qk_norm=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert ours.spec.layer(0).mixer.qk_norm == "none" and ours.spec.position.rotary_fraction == 0.5
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    assert_within_reference_error(ours(ids), hf(ids).logits, float64_twin(hf)(ids).logits)


def test_greedy_tokens_and_several_tokens_onto_a_state(hf_pair):
    hf, ours, _ = hf_pair("glm4_moe")
    assert_logits_equal_with_a_left_padded_row(hf, ours, atol=5e-5)  # (float64-bounded: test_parity.py)
    assert_greedy_tokens_equal(hf, ours)
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=5e-5)


def test_the_mtp_module_is_saved_as_layer_n_and_read_back(tmp_path):
    """A release stores its MTP module as layer num_hidden_layers (DeepSeek-V3's layout); zoo writes it
    so and reads it back, and transformers loads the main model from that directory unchanged."""
    spec = config_to_spec({"model_type": "glm4_moe", **tiny_config("glm4_moe"), "num_nextn_predict_layers": 1})
    assert spec.mtp.depth == 1
    model = zt.tiny_model(spec)
    zoo.save_pretrained(model, tmp_path / "zoo", model_type="glm4_moe")
    from safetensors import safe_open

    with safe_open(tmp_path / "zoo" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.3.mlp.gate.e_score_correction_bias" in names
    again = zoo.from_pretrained(tmp_path / "zoo")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zoo")
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=5e-5, rtol=0)


@pytest.mark.parametrize("preset", ["glm-4.5", "glm-4.5-air"])
def test_the_presets_are_what_transformers_builds_from_their_config(preset):
    from test_released_configs import same_as_transformers

    model = zoo.build(preset, device="meta")
    config = {**get_format("glm4_moe").spec_to_config(model.spec), "model_type": "glm4_moe"}
    same_as_transformers(config)
    assert zoo.core.spec.differences(config_to_spec(config).to_dict(), model.spec.to_dict()) == [("label", None, preset)]
