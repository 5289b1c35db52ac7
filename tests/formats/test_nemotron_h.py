"""Nemotron-H (``nemotron_h``): tiny random checkpoints written by transformers, whose layers reach all
three kinds (Mamba-2, attention, MLP), load into zoo and compute what transformers' torch path
computes: logits with a left-padded row, greedy tokens, the cache contents after a prefill and single
tokens, several tokens fed onto a state; and they save back to the same tensors."""

import json

import pytest
import torch
from safetensors.torch import load_file

import zoo
import zoo.testing as zt
from zoo.checkpoints import CheckpointError, ConfigError, config_to_spec, ignored_fields

from hf_pairs import assert_several_tokens_continue_the_full_forward

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

# SSD's tolerance: transformers' chunked scan takes exp of cumulative sums of dt * A and zoo's shared
# core exp of segment sums, in chunks of another length; in float32 the two orders of summation differ
# by a few ulps per step, compounded through the decay, the gated norm (which divides by the RMS of
# small outputs) and the layers.
SSD_ATOL = 1e-4
PATTERN = "M-*M-M*"  # every kind, attention after Mamba state and after an MLP


@pytest.fixture(scope="module")
def pair(hf_pair):
    return hf_pair("nemotron_h", std=0.1, layers_block_type=None, hybrid_override_pattern=PATTERN)


def ids_of(B, T, seed=0):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_schedule_is_read_as_transformers_reads_it(pair):
    hf, ours, _ = pair
    kinds = {"linear_attention": ("mamba2", "mixer_only"), "full_attention": ("attention", "mixer_only"),
             "mlp": ("none", "ffn_only")}
    assert hf.config.layers_block_type == ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp",
                                           "linear_attention", "full_attention"]
    assert [(ours.spec.layer(i).mixer.name, ours.spec.layer(i).block.name) for i in range(7)] == [
        kinds[t] for t in hf.config.layers_block_type]
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


@torch.no_grad()
def test_logits_equal_transformers_with_a_left_padded_row(pair):
    hf, ours, _ = pair
    ids = ids_of(2, 29)  # three chunks of 8 and a ragged one
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ref = hf(ids, attention_mask=mask).logits
    got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got[real], ref[real], atol=SSD_ATOL, rtol=0)
    alone = ours(ids[1:, 5:])  # the padded row computes what the row alone computes
    torch.testing.assert_close(got[1, 5:], alone[0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_greedy_tokens_and_decode_states_equal_transformers(pair):
    hf, ours, _ = pair
    assert greedy_and_states_equal(hf, ours) == {"linear_attention", "full_attention", "mlp"}


def greedy_and_states_equal(hf, ours):
    """Greedy tokens equal transformers'; then the decode state after a prefill of 9 and 4 single tokens
    equals its cache (see :func:`state_is_the_cache`, whose kinds it returns)."""
    ids = ids_of(1, 9, seed=1)
    expected = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1,
                           pad_token_id=0, eos_token_id=None)
    assert torch.equal(zoo.generate(ours, ids, 12), expected)

    # The cache after a prefill of 9 and 4 single tokens: conv windows and SSM states, keys and values.
    ids = ids_of(2, 13, seed=2)
    cache = hf(ids[:, :9], use_cache=True).past_key_values
    state = ours.new_state(2)
    ours(ids[:, :9], state=state)
    for t in range(9, 13):
        cache = hf(ids[:, t : t + 1], past_key_values=cache, use_cache=True).past_key_values
        ours(ids[:, t : t + 1], state=state)
    return state_is_the_cache(hf, state, cache, 13)


def state_is_the_cache(hf, state, cache, seen):
    """Asserts zoo's decode state equals transformers' cache over ``seen`` slots, layer by layer (every
    layer after the first reads hidden states that passed SSD: its tolerance); returns the kinds seen."""
    checked = set()
    for i, kind in enumerate(hf.config.layers_block_type):
        ref, mine = cache.layers[i], state.layers[i]
        if kind == "linear_attention":
            torch.testing.assert_close(mine.conv, ref.conv_states[0], atol=SSD_ATOL, rtol=0)
            # zoo keeps the SSM state (B, H, N, P), keys by values, as the shared core does
            torch.testing.assert_close(mine.ssm.transpose(-1, -2), ref.recurrent_states[0], atol=SSD_ATOL, rtol=0)
        elif kind == "full_attention":
            torch.testing.assert_close(mine.k[:, :, :seen], ref.keys, atol=SSD_ATOL, rtol=0)
            torch.testing.assert_close(mine.v[:, :, :seen], ref.values, atol=SSD_ATOL, rtol=0)
        else:
            assert ref.keys is None and mine.nbytes() == 0  # an MLP or MoE layer keeps nothing
        checked.add(kind)
    return checked


@torch.no_grad()
def test_several_new_tokens_onto_an_existing_state(pair):
    """transformers' nemotron_h continues a cache with several tokens correctly (its convolution reads
    the cached window, its chunked scan starts from the cached state, attention appends to the cached
    keys): both equal the full forward."""
    hf, ours, _ = pair
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="past_key_values", atol=SSD_ATOL)


@torch.no_grad()
def test_where_the_step_clamp_binds_zoo_decodes_as_transformers_forward(tmp_path):
    """With ``time_step_min`` 0.001 and larger weights, softplus(dt + dt_bias) falls below it. transformers'
    chunked forward clamps the step there, its one-token step does not, so its cached decoding departs
    from its own forward. zoo clamps both forms: its decoding equals its forward and transformers'."""
    hf = tiny.make_tiny("nemotron_h", tmp_path, overrides={"time_step_min": 0.001})
    ours = zoo.from_pretrained(tmp_path)
    ids = ids_of(1, 24)
    lowest = []
    for layer in ours.layers:
        m = layer.mixer
        if hasattr(m, "dt_bias"):  # the steps of this layer on its input (a hook records it)
            m.register_forward_hook(lambda m, i, o: lowest.append(torch.nn.functional.softplus(
                m.in_proj(i[0])[..., -m.cfg.n_heads:] + m.dt_bias).min().item()))
    full = ours(ids)
    assert min(lowest) < 0.001  # the clamp binds
    ref = hf(ids).logits
    torch.testing.assert_close(full, ref, atol=SSD_ATOL, rtol=0)
    state, mine = ours.new_state(1), []
    cache = hf(ids[:, :12], use_cache=True).past_key_values
    mine.append(ours(ids[:, :12], state=state))
    theirs = []
    for t in range(12, 24):
        mine.append(ours(ids[:, t : t + 1], state=state))
        theirs.append(hf(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(mine, 1), ref, atol=SSD_ATOL, rtol=0)
    assert (torch.cat(theirs, 1) - ref[:, 12:]).abs().max() > 1e-3  # transformers' steps: no clamp


def test_decoding_conformance(pair):
    _, ours, _ = pair
    zt.check_decoding(ours, ids_of(2, 14, seed=4))


@torch.no_grad()
def test_saving_gives_back_every_tensor_and_transformers_reads_it(pair, tmp_path):
    hf, ours, d = pair
    zoo.save_pretrained(ours, tmp_path)
    assert load_file(tmp_path / "model.safetensors").keys() == load_file(d / "model.safetensors").keys()
    for name, t in load_file(d / "model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "model.safetensors")[name], t), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert back.config.layers_block_type == hf.config.layers_block_type
    ids = ids_of(1, 11)
    torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_verify_lines_up_every_layer(tmp_path):
    """``zoo verify --tiny all`` takes nemotron_h from the format registry (its ``tiny`` config); the
    report lines up transformers' hidden states layer by layer."""
    assert "nemotron_h" in tiny.tiny_formats()
    tiny.make_tiny("nemotron_h", tmp_path)
    report = zoo.verify(tmp_path, seq_len=12)
    assert report.passed and max(report.hidden) < 1e-4, report.hidden


# ------------------------------------------------------------------------------ config fields

def base_config():
    return {**tiny.tiny_config("nemotron_h"), "model_type": "nemotron_h"}


def test_the_pattern_string_and_the_legacy_names_read_as_the_list():
    config = base_config()
    listed = config_to_spec(config)
    text = {k: v for k, v in config.items() if k != "layers_block_type"}
    assert config_to_spec({**text, "hybrid_override_pattern": "M-*M-M"}) == listed
    assert config_to_spec({**text, "layer_types": config["layers_block_type"]}) == listed
    legacy = {**config, "layers_block_type": ["mamba", "mlp", "attention", "mamba", "mlp", "mamba"]}
    assert config_to_spec(legacy) == listed
    renamed = {k: v for k, v in config.items() if k not in ("n_groups", "chunk_size")}
    assert config_to_spec({**renamed, "mamba_n_groups": 2, "mamba_chunk_size": 8}) == listed
    # The Mamba-2 step is clamped below at time_step_min (transformers' mixer reads no other limit).
    mixer = config_to_spec({**config, "time_step_min": 0.01, "time_step_limit": [0.0, 0.5]}).layer(0).mixer
    assert (mixer.dt_limit_min, mixer.dt_limit_max) == (0.01, None)


def test_what_zoo_cannot_read_is_refused_by_name():
    config = base_config()
    with pytest.raises(ConfigError, match="'layers_block_type'.*'conv'"):
        config_to_spec({**config, "layers_block_type": ["linear_attention", "conv"]})
    with pytest.raises(ConfigError, match="'hybrid_override_pattern'.*'X'"):
        config_to_spec({**{k: v for k, v in config.items() if k != "layers_block_type"},
                        "hybrid_override_pattern": "M-X"})
    with pytest.raises(ConfigError, match="'num_nextn_predict_layers'.*at most 1"):  # (one is read: test_nemotron3_mtp.py)
        config_to_spec({**config, "num_nextn_predict_layers": 2})
    with pytest.raises(ConfigError, match="'mtp_layers_block_type'.*'moe' is not a layer of the main model"):
        config_to_spec({**config, "num_nextn_predict_layers": 1})  # NemotronHConfig's default: attention, moe
    with pytest.raises(ConfigError, match="'mamba_hidden_act'"):
        config_to_spec({**config, "mamba_hidden_act": "gelu"})


def test_a_state_size_that_disagrees_with_the_checkpoint_is_refused(pair, tmp_path):
    _, _, d = pair
    config = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "ssm_state_size": 8}))
    (tmp_path / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"in_proj\.weight.*the weights have ssm_state_size = 16 .*says 8"):
        zoo.from_pretrained(tmp_path)


def test_every_field_transformers_declares_is_read():
    """A config as transformers writes it (every NemotronHConfig field) leaves nothing unread."""
    written = transformers.NemotronHConfig(**tiny.tiny_config("nemotron_h")).to_dict()
    assert {"mamba_ssm_cache_dtype", "time_step_limit", "mtp_layers_block_type", "expand"} <= set(written)
    assert ignored_fields(written) == []


def test_the_preset_is_nemotron_h_8b_as_transformers_builds_it():
    """nvidia/Nemotron-H-8B-Base-8K's sizes (its released config.json is not stored here): the preset is
    the spec zoo reads from them, with the parameter count transformers builds on the meta device."""
    config = {"model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096,
              "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
              "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
              "chunk_size": 128, "max_position_embeddings": 8192, "layer_norm_epsilon": 1e-5,
              "tie_word_embeddings": False}
    spec = zoo.model.recipes.get_spec("nemotron-h-8b")
    assert spec.with_overrides({"label": None}) == config_to_spec(config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert zoo.build("nemotron-h-8b", device="meta").num_parameters() == sum(p.numel() for p in hf.parameters()) \
        == 8_100_852_736
