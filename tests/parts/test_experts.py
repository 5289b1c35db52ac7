"""Experts are a registered kind (``expert``), chosen by name in the ``moe`` FFN's spec: biased stacked
experts on the grouped and the loop path against a float64 reference of every expert one token at a
time, a plugin's activation of gate and up, and the five built-in kinds under their old names.

Tolerances: float32 against float64 on 32-wide experts; 1e-5 of the outputs' scale is far above float32
rounding and far below a missing bias (each is drawn N(0, 1)) or a wrong activation."""

import pytest
import torch
import torch.nn.functional as F

import zoo
import zoo.testing as zt
from zoo.components.ffn import moe as moe_module
from zoo.components.ffn.moe import GroupedExperts
from zoo.core.spec import SpecError

D, E = 32, 4


def moe(**cfg):
    return zt.part("ffn", "moe", {"n_experts": E, "top_k": 2, "d_ff": 16, **cfg}).build(d_model=D)


def randomise(m):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 2 else 1.0))
    return m


def reference(m, x, act):
    """float64: each token through each of its chosen experts, weighted and summed."""
    flat = x.reshape(-1, D)
    r = m.route(flat)
    ex = m.experts
    w = {n: (getattr(ex, n).double() if getattr(ex, n) is not None else None)
         for n in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")}
    out = torch.zeros(flat.shape, dtype=torch.float64)
    for t in range(flat.shape[0]):
        xt = flat[t].double()
        for j in range(r.indices.shape[1]):
            e = int(r.indices[t, j])
            lin = lambda v, name: v @ w["w_" + name][e].T + (w["b_" + name][e] if w["b_" + name] is not None else 0)  # noqa: E731
            h = act(lin(xt, "gate"), lin(xt, "up")) if w["w_gate"] is not None else act(None, lin(xt, "up"))
            out[t] += r.weights[t, j].double() * lin(h, "down")
    return out.view(x.shape)


PATHS = ["loop"] + (["grouped"] if moe_module._grouped_mm_ok(torch.device("cpu"), torch.float32) else [])


@pytest.mark.parametrize("dispatch", PATHS)
@pytest.mark.parametrize("expert", [{"name": "swiglu", "bias": True}, {"name": "mlp", "bias": True}])
def test_biased_experts_chosen_by_name_are_the_float64_reference(expert, dispatch):
    m = randomise(moe(expert=expert, dispatch=dispatch))
    assert m.experts.b_up is not None and m.experts.b_down is not None
    assert (m.experts.b_gate is not None) == (expert["name"] != "mlp")
    x = torch.randn(2, 5, D)
    act = (lambda g, u: F.silu(g) * u) if expert["name"] == "swiglu" else (lambda g, u: F.gelu(u))
    torch.testing.assert_close(m(x).double(), reference(m, x, act), rtol=1e-5, atol=1e-5)


def test_the_bias_gradients_of_the_grouped_and_loop_paths_agree():
    if "grouped" not in PATHS:
        pytest.skip("torch._grouped_mm does not run on this CPU")
    grads = []
    for dispatch in PATHS:
        m = randomise(moe(expert={"name": "geglu", "bias": True}, dispatch=dispatch))
        x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
        (m(x) * torch.linspace(-1, 1, x.numel()).view_as(x)).sum().backward()
        grads.append([m.experts.b_gate.grad, m.experts.b_up.grad, m.experts.b_down.grad])
    for a, b in zip(*grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class ClampedSwiGLU(GroupedExperts):
    """gpt-oss's activation of gate and up: gate clamped above, up both ways, ``(up + 1) * glu``."""

    def activate(self, gate, up):
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def test_a_plugin_expert_kind_is_chosen_by_name_and_the_spec_names_it():
    zoo.register("expert", "test_clamped_swiglu")(ClampedSwiGLU)
    experts = zoo.manager().registry("expert")
    try:
        spec = zt.tiny_spec({"layers.default.ffn": {"name": "moe", "n_experts": E, "top_k": 2, "d_ff": 16,
                                                    "expert": {"name": "test_clamped_swiglu", "bias": True}}})
        assert spec.to_dict()["layers"]["default"]["ffn"]["expert"]["name"] == "test_clamped_swiglu"
        m = randomise(moe(expert={"name": "test_clamped_swiglu", "bias": True}))
        assert type(m.experts) is ClampedSwiGLU
        x = torch.randn(2, 5, D) * 4  # reaches the clamps
        ref = reference(m, x, lambda g, u: (u.clamp(-7, 7) + 1) * g.clamp(max=7) * torch.sigmoid(1.702 * g.clamp(max=7)))
        torch.testing.assert_close(m(x).double(), ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(SpecError, match="shared_d_ff"):  # no dense FFN of that name to be the shared expert
            zt.part("ffn", "moe", {"expert": "test_clamped_swiglu", "shared_d_ff": 16})
    finally:  # the suite's other tests see the registry as zoo ships it
        experts.remove("test_clamped_swiglu", experts.entry("test_clamped_swiglu").provider)


def test_the_five_built_in_experts_keep_their_names_parameters_and_settings():
    assert {"mlp", "glu", "swiglu", "geglu", "reglu"} <= set(zoo.list_components("expert"))
    for name, gated in [("swiglu", True), ("glu", True), ("geglu", True), ("reglu", True), ("mlp", False)]:
        m = moe(expert={"name": name, "bias": False})
        names = {n for n, _ in m.named_parameters() if n.startswith("experts.")}
        assert names == {"experts.w_up", "experts.w_down"} | ({"experts.w_gate"} if gated else set()), name
        assert type(m.experts).gated is gated and m.gated is gated
    assert type(moe().experts) is GroupedExperts and moe().experts.b_up is None  # swiglu, unbiased, by default
