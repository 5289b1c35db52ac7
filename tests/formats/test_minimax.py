"""MiniMax-Text-01 (``minimax``) against transformers' torch path on tiny random checkpoints that
transformers writes itself: logits, greedy tokens, decode states against its cache, several tokens
onto a state (where transformers raises), the alpha/beta residual scales and the layer schedule."""

import json

import pytest
import torch

import zoo
import zoo.testing as zt
from zoo.checkpoints import ConfigError, config_to_spec
from zoo.checkpoints.tiny import make_tiny, tiny_config

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny MiniMax saved by transformers, with its slope buffers moved off the schedule (and the
    decay tables transformers derives from them rebuilt to match), and zoo's reading of it."""
    d = tmp_path_factory.mktemp("minimax")
    hf = make_tiny("minimax", d / "made", std=0.1)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            att = layer.self_attn
            if hasattr(att, "slope_rate"):
                att.slope_rate.mul_(0.5 + torch.rand(att.slope_rate.shape, generator=gen))
                for name, t in zip(("query_decay", "key_decay", "diagonal_decay"), att.decay_factors(att.slope_rate)):
                    getattr(att, name).copy_(t)
    hf.save_pretrained(d / "hf")
    return hf, zoo.from_pretrained(d / "hf").eval()


def ids_batch(T=20, B=2, seed=0):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_schedule_and_scales_come_from_the_config(pair):
    hf, ours = pair
    assert [ours.spec.layer(i).mixer.name for i in range(4)] == ["lightning_attention"] * 2 + ["attention", "lightning_attention"]
    assert ours.spec.layer(2).block.config.attn_alpha == 1.5 and ours.spec.layer(0).block.config.attn_beta == 0.9
    torch.testing.assert_close(ours.layers[1].mixer.slope, hf.model.layers[1].self_attn.slope_rate.reshape(-1))


def test_logits_match_with_padding(pair):
    hf, ours = pair
    ids = ids_batch(T=21)  # 3 full blocks of 6 and a partial one
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask, position_ids=pos)
    assert ref.abs().max() > 1.0
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)


def test_greedy_tokens_and_decode_states_match_the_cache(pair):
    hf, ours = pair
    ids = ids_batch(T=9)
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        got = zoo.generate(ours, ids, max_new_tokens=8)  # greedy
        assert torch.equal(got, want)

        out = hf(ids, use_cache=True)
        state = ours.new_state(2, None)
        ours(ids, state=state)
        cache = out.past_key_values
        for i in (0, 1, 3):
            torch.testing.assert_close(state.layers[i].S, cache.linear_cache[i], atol=1e-5, rtol=0)
        # One token onto both states: the caches agree again. (transformers is given the position:
        # without it, it counts the past from layer 0's KV cache, which a lightning layer leaves empty.)
        nxt = ids_batch(T=1, seed=3)
        hf(nxt, past_key_values=cache, use_cache=True, position_ids=torch.full((2, 1), 9))
        ours(nxt, state=state)
        for i in (0, 1, 3):
            torch.testing.assert_close(state.layers[i].S, cache.linear_cache[i], atol=1e-5, rtol=0)


def test_several_tokens_onto_a_state(pair):
    """zoo carries the state through a chunk of new tokens; transformers' minimax raises a shape
    error on this (its cached path runs token by token with a mask for one). If this test's
    expectation about transformers fails, transformers was fixed: compare against it then."""
    hf, ours = pair
    ids = ids_batch(T=17)
    with torch.no_grad():
        full = ours(ids)
        state = ours.new_state(2, None)
        parts = [ours(ids[:, a:b], state=state) for a, b in ((0, 7), (7, 15), (15, 17))]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)
        cache = hf(ids[:, :7], use_cache=True).past_key_values
        with pytest.raises(RuntimeError, match="must match the size"):
            hf(ids[:, 7:15], past_key_values=cache, use_cache=True, position_ids=torch.arange(7, 15)[None].expand(2, -1))


def test_decoding_conformance(pair):
    _, ours = pair
    zt.check_decoding(ours, ids_batch(T=13), what="minimax", atol=1e-5)


def test_round_trip_through_transformers(pair, tmp_path):
    hf, ours = pair
    zoo.save_pretrained(ours, tmp_path / "zoo")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zoo")
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-7, rtol=1e-6, msg=k)
    assert back.config.layer_types == hf.config.layer_types and back.config.mlp_beta_factor == 0.7


@pytest.mark.parametrize("field,value", [("layer_types", ["linear_attention", "mamba", "full_attention", "linear_attention"]),
                                         ("layer_types", ["full_attention"]), ("block_size", 0)])
def test_bad_config_is_named(field, value):
    with pytest.raises((ConfigError, zoo.core.spec.SpecError), match=field if field != "block_size" else "chunk"):
        config_to_spec({**tiny_config("minimax"), "model_type": "minimax", field: value})


def test_the_preset_is_the_published_model_and_what_transformers_builds():
    from test_released_configs import same_as_transformers

    model = zoo.build("minimax-text-01", device="meta")
    assert model.num_parameters() == 456_089_655_296  # "456B total parameters"
    assert [model.spec.layer(i).mixer.name for i in range(16)] == (["lightning_attention"] * 7 + ["attention"]) * 2
    config = {**zoo.checkpoints.hf.format.get_format("minimax").spec_to_config(model.spec), "model_type": "minimax"}
    same_as_transformers(config)  # the parameter count transformers builds from that config, on meta
    assert zoo.core.spec.differences(config_to_spec(config).to_dict(), model.spec.to_dict()) == [("label", None, "minimax-text-01")]


def test_absent_fields_take_transformers_defaults():
    from test_released_configs import SIZES, same_as_transformers

    defaults = transformers.MiniMaxConfig().to_dict()
    config = {"model_type": "minimax", **{k: defaults[k] for k in SIZES if k in defaults}}
    same_as_transformers(config)
    spec = config_to_spec(config)
    assert [spec.layer(i).mixer.name for i in range(4)] == ["attention", "lightning_attention"] * 2


def test_specs_minimax_cannot_hold_are_refused_on_saving(pair, tmp_path):
    _, ours = pair
    for over, message in (({"layers.linear.block.attn_beta": 0.3, "layers.full.block.ffn_beta": 0.2}, "mlp_beta_factor"),
                          ({"layers.linear.mixer.norm_eps": 1e-5}, "eps"),
                          ({"layers.linear.ffn.d_ff": 40}, "one ffn")):
        spec = ours.spec.with_overrides(over)
        with pytest.raises(ValueError, match=message):
            zoo.checkpoints.hf.format.get_format("minimax").spec_to_config(spec)


@pytest.mark.parametrize("preset", ["minimax-m1-80k", "minimax-m1-40k"])
def test_minimax_m1_is_text_01s_architecture_at_its_size(preset):
    """MiniMax-M1 (40k and 80k thinking budgets) has MiniMax-Text-01's config: the same spec under
    another name, the count transformers builds from its config, and MiniMax's "456B"."""
    from test_released_configs import same_as_transformers

    model = zoo.build(preset, device="meta")
    assert model.num_parameters() == 456_089_655_296
    text01 = zoo.build("minimax-text-01", device="meta").spec
    assert zoo.core.spec.differences(text01.to_dict(), model.spec.to_dict()) == [("label", "minimax-text-01", preset)]
    config = {**zoo.checkpoints.hf.format.get_format("minimax").spec_to_config(model.spec), "model_type": "minimax"}
    same_as_transformers(config)
    # The release config's sizes (github.com/MiniMax-AI/MiniMax-M1, config.json, remote-code layout).
    release = {"hidden_size": 6144, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 128, "intermediate_size": 9216, "num_local_experts": 32, "num_experts_per_tok": 2,
               "vocab_size": 200064, "max_position_embeddings": 10240000, "full_attn_alpha_factor": 3.5565588200778455,
               "linear_attn_alpha_factor": 3.5565588200778455, "mlp_alpha_factor": 3.5565588200778455}
    assert {k: config[k] for k in release} == release
    attn_type_list = ([0] * 7 + [1]) * 10  # the release's schedule: 0 lightning, 1 softmax
    assert config["layer_types"] == [["linear_attention", "full_attention"][t] for t in attn_type_list]
    assert config["rope_parameters"]["rope_theta"] == 1e7


def release_rope(hf, rotary_dim: int):
    """The release's RoPE on transformers' model (MiniMax-Text-01's own modelling code, as vLLM also
    runs it): frequencies over ``rotary_dim`` channels, the first ``rotary_dim`` channels of each
    head rotated half-split, the rest passed through. Returns the context that applies it."""
    import contextlib
    from transformers.models.minimax import modeling_minimax as mm

    theta = hf.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)

    def apply(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        out = []
        for x in (q, k):
            rot, kept = x[..., :rotary_dim], x[..., rotary_dim:]
            out.append(torch.cat([rot * cos + mm.rotate_half(rot) * sin, kept], -1))
        return tuple(out)

    @contextlib.contextmanager
    def applied():
        saved = hf.model.rotary_emb.inv_freq
        hf.model.rotary_emb.inv_freq = inv_freq
        original, mm.apply_rotary_pos_emb = mm.apply_rotary_pos_emb, apply
        try:
            yield
        finally:
            mm.apply_rotary_pos_emb, hf.model.rotary_emb.inv_freq = original, saved

    return applied()


@torch.no_grad()
def test_the_release_rotates_rotary_dim_channels_and_transformers_the_whole_head(tmp_path):
    """MiniMax-Text-01 and M1 rotate half of each head: their config.json says ``rotary_dim: 64`` of
    ``head_dim`` 128, and their own code and vLLM rotate ``rotary_dim`` channels. zoo follows the
    release (checked against transformers' model with the release's RoPE put in, everything else
    left as it is). transformers 5.23's ``minimax`` does not read ``rotary_dim`` and rotates the whole
    head; that reading is pinned here, so that a fix in transformers shows."""
    hf = make_tiny("minimax", tmp_path / "hf", std=0.1, overrides={"rotary_dim": 12})  # half of head_dim 24
    ours = zoo.from_pretrained(tmp_path / "hf")
    assert ours.spec.position.rotary_dim == 12
    ids = ids_batch(T=21)
    got = ours(ids)
    with release_rope(hf, 12):
        release = hf(ids).logits
    torch.testing.assert_close(got, release, atol=1e-5, rtol=0)
    # transformers' reading: the whole head (its rotary has head_dim / 2 frequencies), other logits
    assert hf.model.rotary_emb.inv_freq.numel() == 12
    assert (hf(ids).logits - got).abs().max() > 1e-2
    # saved, rotary_dim goes back into config.json, and zoo reads its own save as it read the release
    zoo.save_pretrained(ours, tmp_path / "zoo")
    saved = json.loads((tmp_path / "zoo" / "config.json").read_text())
    assert saved["rotary_dim"] == 12 and "partial_rotary_factor" not in saved["rope_parameters"]
    torch.testing.assert_close(zoo.from_pretrained(tmp_path / "zoo")(ids), got, atol=0, rtol=0)
