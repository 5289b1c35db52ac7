"""DeepSeek-V2 and DeepSeek-V3 against transformers on tiny random checkpoints that transformers
itself writes (its routers' selection-bias buffers randomised too): fp32 logits within 1e-5 with a
left-padded row, greedy tokens identical, and zoo's decode state equal to what transformers'
DynamicCache stores (the normed latent and the rotated key part), after a prefill and after several
tokens fed onto it. Then the released configs and their presets, and refusals by field."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import zoo
from zoo.checkpoints import ConfigError, _architecture, config_to_spec

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

CONFIGS = Path(__file__).parent / "data" / "configs"
RELEASED = {
    "deepseek-v2-lite": "deepseek-ai--DeepSeek-V2-Lite.json",
    "deepseek-v2": "deepseek-ai--DeepSeek-V2.json",
    "deepseek-v3": "deepseek-ai--DeepSeek-V3.json",
}
# (model_type, overrides of the format's tiny config): V2 with a q latent and greedy routing, V2-Lite's
# shape (no q latent, group-limited greedy), V3 with and without rope_interleave.
CASES = {
    "v2-greedy": ("deepseek_v2", {"q_lora_rank": 16, "topk_method": "greedy", "n_group": None, "topk_group": None}),
    "v2-grouped": ("deepseek_v2", {}),
    "v3": ("deepseek_v3", {}),
    "v3-half": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None, "first_k_dense_replace": 0}),
}


def make(model_type, directory, overrides, seed=0, std=0.1):
    """A transformers model of the tiny config, every parameter moved by N(0, std) and the routers'
    ``e_score_correction_bias`` buffers drawn at random (large enough to change which experts win)."""
    cfg = transformers.AutoConfig.for_model(model_type, **tiny.tiny_config(model_type, **overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model.eval().save_pretrained(str(directory))
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            d = tmp_path_factory.mktemp(case)
            model_type, overrides = CASES[case]
            made[case] = (make(model_type, d, overrides), zoo.from_pretrained(d))
        return made[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_equal_transformers_with_a_left_padded_row(case, pair):
    hf, ours = pair(case)
    if CASES[case][0] == "deepseek_v3":
        assert all(layer.ffn.router.bias.abs().sum() > 0 for layer in ours.layers if hasattr(layer.ffn, "router"))
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = hf(ids, attention_mask=mask, position_ids=pos).logits
    got = ours(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)


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
        layer.attention.cfg = dataclasses.replace(layer.attention.cfg, decode=decode)
    try:
        check_state_against_cache(hf, ours)
    finally:
        for layer in ours.layers:
            layer.attention.cfg = dataclasses.replace(layer.attention.cfg, decode="absorbed")


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

@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_released_configs_are_the_presets(preset):
    config = json.loads((CONFIGS / RELEASED[preset]).read_text())
    config.pop("quantization_config", None)  # the storage of the weights (FP8), not the architecture
    spec = config_to_spec(config)
    model = zoo.build(preset, device="meta")
    assert _architecture(spec) == _architecture(model.spec)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_published_sizes():
    assert zoo.build("deepseek-v2-lite", device="meta").num_parameters() == 15_706_484_224
    assert zoo.build("deepseek-v3", device="meta").num_parameters() == 671_026_404_352  # without its MTP module


def test_deepseek_v3_state_is_61_layers_of_512_plus_64_values_per_token():
    from zoo.accounting import account

    state = account("deepseek-v3", context=1000, dtype="bf16")["decode_state"]
    assert state["bytes_per_token"] == 61 * (512 + 64) * 2
    assert state["mha_bytes_per_token"] == 61 * 128 * (128 + 64 + 128) * 2
    assert state["bytes"] == 1000 * state["bytes_per_token"]


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
    with pytest.raises((ConfigError, zoo.spec.SpecError), match=rf"{field}.*{match}"):
        config_to_spec(config)
