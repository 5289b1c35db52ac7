"""The plugin passes zoo's conformance suite, and each part computes its paper's formula.
Needs the plugin installed (``pip install ./plugins/zoo-alibi-dyt``): zoo finds it by entry point."""

import math

import pytest
import torch

import zoo
import zoo.testing as zt

# The README test command installs the plugin; elsewhere (a venv without it) these tests are skipped.
pytest.importorskip("zoo_alibi_dyt", reason="the plugin is not installed: pip install ./plugins/zoo-alibi-dyt")

PLUGIN = "alibi_dyt"


@pytest.fixture(scope="module", autouse=True)
def plugin():
    info = zoo.manager().load_plugin(PLUGIN)
    assert info.error is None and info.distribution == "zoo-alibi-dyt", (
        f"the plugin is not installed or failed to load ({info.error}); run: pip install ./plugins/zoo-alibi-dyt")
    return info


def test_conformance():
    checked = zt.check_plugin(PLUGIN, {("norm", "dyt"): [{}, {"alpha_init": 2.0, "bias": False}],
                                       ("position", "alibi"): [{}, {"max_bias": 4.0}]})
    assert sorted(checked) == [("norm", "dyt"), ("position", "alibi")]


def test_alibi_slopes_are_geometric():
    from zoo_alibi_dyt import alibi_slopes

    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2.0 ** -k for k in (2, 4, 6, 8)]))
    # 12 heads: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...).
    expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


def _alibi(**cfg):
    spec = zt.tiny_spec({"position": {"name": "alibi", **cfg}})
    return spec.position.build(spec=spec, layer=spec.layer(0))


def test_alibi_bias_is_minus_slope_times_distance():
    bias = _alibi().score_bias(None, torch.arange(6), torch.arange(6), 4)
    assert bias.shape == (1, 4, 6, 6)
    slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    for h, m in enumerate(slopes):
        for i in range(6):
            for j in range(i + 1):
                assert bias[0, h, i, j].item() == pytest.approx(-m * (i - j))


def test_alibi_matches_bloom_up_to_a_constant_per_row():
    """transformers' BLOOM adds m_h * j for key j; ALiBi's -m_h (i - j) differs by a constant in
    each query row, which softmax ignores."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    H, T = 6, 9
    bloom = build_alibi_tensor(torch.ones(1, T), H, torch.float32).view(H, 1, T)
    ours = _alibi().score_bias(None, torch.arange(T), torch.arange(T), H)[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p_ours = ours.masked_fill(~causal, float("-inf")).softmax(-1)
    p_bloom = bloom.expand(H, T, T).masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(p_ours, p_bloom)


def test_alibi_model_sdpa_equals_eager_and_prefers_near_tokens():
    model = zt.tiny_model({"position": {"name": "alibi"}})
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        outs = []
        for backend in ("sdpa", "eager"):
            for layer in model.layers:
                layer.mixer.backend = backend
            outs.append(model(ids))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    # With identical queries and keys, the bias alone decides: attention decays with distance.
    bias = _alibi().score_bias(None, torch.tensor([11]), torch.arange(12), 4)
    probs = bias.softmax(-1)[0, :, 0]
    assert (probs[:, 1:] > probs[:, :-1]).all()


def test_dyt_formula():
    norm = zt.part("norm", "dyt", {"alpha_init": 0.5}).build(dim=16)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(3, 16) * 4
    torch.testing.assert_close(norm(x), norm.weight * torch.tanh(0.5 * x) + norm.bias)
    assert norm.alpha.item() == 0.5
    assert zt.part("norm", "dyt", {"bias": False}).build(dim=16).bias is None
    # Near 0 it is linear with slope alpha; far out it saturates at +-weight.
    plain = zt.part("norm", "dyt", {"alpha_init": 2.0, "bias": False}).build(dim=4)
    torch.testing.assert_close(plain(torch.full((4,), 1e-4)), torch.full((4,), 2e-4), rtol=1e-4, atol=0)
    torch.testing.assert_close(plain(torch.full((4,), 1e4)), torch.ones(4))


def test_a_preset_builds_with_both_parts():
    model = zoo.build("llama3-8b", n_layers=2, d_model=64, vocab_size=128, seed=0,
                      overrides={"position": "alibi", "layers.*.norm": "dyt", "final_norm": "dyt",
                                 "layers.*.mixer.n_heads": 8, "layers.*.mixer.n_kv_heads": 2,
                                 "layers.*.ffn.d_ff": 128})
    assert isinstance(model.layers[0].attn_norm, zoo.get("norm", "dyt"))
    assert not list(model.positions.parameters())  # ALiBi has no weights
    out = model.loss(torch.randint(0, 128, (2, 16)))
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and model.layers[0].attn_norm.alpha.grad is not None
    assert zoo.manager().provider_of("position", "alibi") == PLUGIN
