"""Multi-head Latent Attention (zoo/components/mixers/mla.py): the decode state holds only the latent and the
rotated key part, absorbed decoding equals the plain path, decoding equals the full forward, and
inconsistent dimensions are refused by name. Parity with transformers is tests/formats/test_deepseek.py."""

import pytest
import torch

import zoo
import zoo.testing as zt
from zoo.tools.accounting import account
from zoo.core.spec import SpecError

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

MLA = {"name": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 12}
YARN = {"name": "rope", "theta": 10000.0, "layout": "pairs_to_half",
        "scaling": {"name": "yarn", "factor": 4.0, "original_max_seq_len": 16, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}}


def _spec(q_lora_rank=None, position=None, decode="absorbed", **mla):
    overrides = {"layers.default.mixer": {**MLA, "q_lora_rank": q_lora_rank, "decode": decode, **mla}}
    if position is not None:
        overrides["position"] = position
    return zt.tiny_spec(overrides)


@pytest.mark.parametrize("q_lora_rank,position", [(None, None), (12, YARN), (12, {"name": "rope", "layout": "interleaved"})])
def test_decoding_equals_the_full_forward(q_lora_rank, position):
    for decode in ("absorbed", "plain"):
        model = zt.tiny_model(_spec(q_lora_rank, position, decode))
        ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
        zt.check_decoding(model, ids, what=f"mla decode={decode}", atol=1e-5)


def test_absorbed_decoding_gives_the_plain_logits_without_building_per_head_keys():
    """Folding W_UK into the query and W_UV into the output changes nothing but fp32 rounding, and
    the absorbed decode never up-projects the cached latents (kv_b_proj is never called)."""
    torch.manual_seed(0)
    plain = zt.tiny_model(_spec(12, YARN, "plain"))
    absorbed = zt.tiny_model(_spec(12, YARN, "absorbed"))
    absorbed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 64, (2, 12))
    calls = {"plain": 0, "absorbed": 0}
    outs = []
    with torch.no_grad():
        for name, model in (("plain", plain), ("absorbed", absorbed)):
            for layer in model.layers:
                layer.mixer.kv_b_proj.register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
            state = model.new_state(2, 12)
            outs.append(torch.cat([model(ids[:, :4], state=state)] + [model(ids[:, t:t + 1], state=state)
                                                                      for t in range(4, 12)], 1))
    assert calls == {"plain": 2 * 9, "absorbed": 0}
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)


def test_the_state_holds_only_the_latent_and_the_rotated_key_part_as_accounted():
    spec = _spec(12)
    model = zt.tiny_model(spec)
    B, T = 3, 10
    state = model.new_state(B, T)
    with torch.no_grad():
        model(torch.randint(0, 64, (B, T)), state=state)
    per_token = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]  # 16 + 4, never heads x (k + v)
    assert state.nbytes() == spec.n_layers * B * T * per_token * 4
    report = account(model, context=T, batch=B, dtype="fp32")["decode_state"]
    assert report["bytes_per_token"] == spec.n_layers * per_token * 4
    assert report["mha_bytes_per_token"] == spec.n_layers * 4 * (8 + 4 + 12) * 4  # heads x (k + v), fp32
    assert state.nbytes() == report["bytes"] == B * T * report["bytes_per_token"]
    for layer in state.layers:
        assert layer.k.shape == (B, 1, T, 16) and layer.v.shape == (B, 1, T, 4)


def test_the_latent_in_the_state_is_the_normed_compression_and_the_key_part_is_rotated():
    spec = _spec(None)
    model = zt.tiny_model(spec)
    x = torch.randn(1, 6, spec.d_model)
    mla = model.layers[0].mixer
    ctx = zoo.core.context.ForwardContext(position_ids=torch.arange(6)[None], slots=torch.arange(6),
                                        state=zoo.core.state.DecodeState([mla.new_state(1, 6)]))
    _, _, pos = zt.attention_inputs(spec, B=1, T=6)
    with torch.no_grad():
        mla(x, ctx, pos)
        c, k_rope = mla.kv_a_proj(x).split([16, 4], dim=-1)
        _, want = pos.rotate(k_rope[:, None], k_rope[:, None])
        torch.testing.assert_close(ctx.state.layers[0].k[:, 0], mla.kv_a_norm(c))
        torch.testing.assert_close(ctx.state.layers[0].v, want)


def test_yarn_mscale_all_dim_multiplies_the_softmax_scale():
    plain = zt.tiny_model(_spec(None, {"name": "rope"}))
    yarn = zt.tiny_model(_spec(None, YARN))
    m = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert plain.layers[0].mixer.scale == pytest.approx((8 + 4) ** -0.5)
    assert yarn.layers[0].mixer.scale == pytest.approx((8 + 4) ** -0.5 * m * m)
    no_all_dim = {**YARN, "scaling": {**YARN["scaling"], "mscale_all_dim": None}}
    assert zt.tiny_model(_spec(None, no_all_dim)).layers[0].mixer.scale == pytest.approx((8 + 4) ** -0.5)


def test_pairs_to_half_rotates_interleaved_pairs_and_writes_them_half_split():
    spec = zt.tiny_spec({"position": {"name": "rope", "layout": "interleaved"}})
    inter = spec.position.build(spec=spec, layer=spec.layer(0))
    spec2 = zt.tiny_spec({"position": {"name": "rope", "layout": "pairs_to_half"}})
    p2h = spec2.position.build(spec=spec2, layer=spec2.layer(0))
    q = torch.randn(1, 2, 5, 8)
    pos = torch.arange(5)[None]
    a, _ = inter.rotate(q, q, inter.prepare(pos, q.dtype))
    b, _ = p2h.rotate(q, q, p2h.prepare(pos, q.dtype))
    torch.testing.assert_close(b, torch.cat([a[..., 0::2], a[..., 1::2]], -1))


@pytest.mark.parametrize("field,value,match", [
    ("qk_rope_head_dim", 5, "rotated in pairs"),
    ("kv_lora_rank", 0, "positive"),
    ("v_head_dim", -1, "positive"),
    ("q_lora_rank", 0, "positive"),
    ("n_heads", 2.5, "expected an integer"),
])
def test_inconsistent_dimensions_are_refused_naming_the_field(field, value, match):
    with pytest.raises(SpecError, match=rf"layers\.default\.mixer\.{field}: .*{match}"):
        _spec(**{field: value})


def test_a_rope_width_other_than_the_decoupled_part_is_refused():
    with pytest.raises(SpecError, match="qk_rope_head_dim"):
        zt.tiny_model(_spec(None, {"name": "rope", "rotary_dim": 2}))


def test_describe_shows_state_per_token_beside_mha():
    facts = zt.tiny_model(_spec(12)).layers[0].mixer.facts()
    assert facts["state_per_token"] == 16 + 4
    assert facts["mha_state_per_token"] == 4 * (8 + 4 + 12)
