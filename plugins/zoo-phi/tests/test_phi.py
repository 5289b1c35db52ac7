"""The phi plugin: conformance (family presets with their published parameter counts, the
checkpoint format's save/load round trip), and parity of logits with transformers' Phi.
Needs the plugin installed (``pip install ./plugins/zoo-phi``): zoo finds it by entry point."""

from collections import Counter

import pytest
import torch

import zoo
import zoo.testing as zt

transformers = pytest.importorskip("transformers")

# The README test command installs the plugin; elsewhere (a venv without it) these tests are skipped.
pytest.importorskip("zoo_phi", reason="the plugin is not installed: pip install ./plugins/zoo-phi")

PLUGIN = "phi"


@pytest.fixture(scope="module", autouse=True)
def plugin():
    info = zoo.manager().load_plugin(PLUGIN)
    assert info.error is None and info.distribution == "zoo-phi", (
        f"the plugin is not installed or failed to load ({info.error}); run: pip install ./plugins/zoo-phi")
    return info


def test_conformance():
    checked = zt.check_plugin(PLUGIN)
    assert sorted(checked) == [("checkpoint_format", "phi"), ("family", "phi")]


@pytest.mark.parametrize("preset,hf", [
    ("phi-1", dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=8192, partial_rotary_factor=0.5)),
    ("phi-2", dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=10240, partial_rotary_factor=0.4)),
])
def test_presets_match_transformers_shapes(preset, hf):
    """The recipe builds the same parameters, shape for shape, as transformers' Phi of the published config."""
    cfg = transformers.PhiConfig(vocab_size=51200, num_attention_heads=32, **hf)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(cfg)
    model = zoo.build(preset, device="meta")
    shapes = lambda m: Counter(tuple(p.shape) for p in m.parameters())  # noqa: E731
    assert shapes(model) == shapes(ref)
    assert model.num_parameters() == sum(p.numel() for p in ref.parameters()) == zoo.published_params(preset)
    assert zoo.get_spec(f"microsoft/{preset}") == model.spec


def _batch(vocab, seq=20, pad=4):
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("overrides", [{}, {"qk_layernorm": False, "tie_word_embeddings": True,
                                            "hidden_act": "gelu", "num_key_value_heads": 2}])
def test_parity_with_transformers(tmp_path, overrides):
    from zoo.checkpoints.tiny import make_tiny

    hf = make_tiny("phi", tmp_path / "hf", overrides=overrides)
    model = zoo.from_pretrained(tmp_path / "hf")
    assert model.checkpoint_format == "phi"
    ids, mask, pos = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = model(ids, attention_mask=mask, position_ids=pos)
        real = mask.bool()
        torch.testing.assert_close(out[real], ref[real], atol=1e-4, rtol=0)
        assert ref.abs().max() > 1.0  # not trivially flat
        zoo.save_pretrained(model, tmp_path / "zoo")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zoo", attn_implementation="eager")
        a, b = back.state_dict(), hf.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # every tensor, bit for bit
        # (gelu_new is written as gelu_pytorch_tanh: the same function, rounded differently)
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_unread_phi_field_is_kept_or_refused_on_request():
    from zoo.checkpoints import ConfigError, config_to_spec, ignored_fields

    fmt = zoo.get("checkpoint_format", "phi")
    config = {"model_type": "phi", **fmt.tiny, "resid_scale": 2.0}
    assert ignored_fields(config) == ["resid_scale"]  # PhiConfig does not declare it: transformers ignores it
    with pytest.raises(ConfigError, match="'resid_scale'"):
        config_to_spec(config, strict=True)
    with pytest.raises(ConfigError, match="'qk_layernorm'.*must be a boolean"):
        config_to_spec({**config, "qk_layernorm": "yes"})
