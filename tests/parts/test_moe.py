"""Mixture-of-Experts: routers against their formulas, balance losses against transformers'
(pooled Switch loss, ST-MoE router z-loss) and the lecture notes' (per-layer Switch loss),
aux-loss-free bias updates, grouped dispatch against the loop, the four MoE checkpoint formats
against transformers (fp32 logits within 1e-5, its aux_loss, stacked experts saved back per key),
released configs and their presets, and refusals that name the field or tensor.

Released config.json files (tests/data/configs) are as published on the hub under the repo id in
the file name."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zoo
import zoo.testing as zt
from zoo.checkpoints import CheckpointError, _architecture, config_to_spec
from zoo.training.data import TokenData, load_tokens
from zoo.core.context import ForwardContext
from zoo.core.spec import SpecError

from test_conformance import D_MOE as D, E, moe, router  # the shared MoE helpers
from test_released_configs import load

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
RELEASED = {
    "mixtral-8x7b": "mistralai--Mixtral-8x7B-v0.1.json",
    "mixtral-8x22b": "mistralai--Mixtral-8x22B-v0.1.json",
    "qwen1.5-moe-a2.7b": "Qwen--Qwen1.5-MoE-A2.7B.json",
    "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B.json",
    "qwen3-235b-a22b": "Qwen--Qwen3-235B-A22B.json",
    "olmoe-1b-7b": "allenai--OLMoE-1B-7B-0924.json",
    "deepseek-v2-lite": "deepseek-ai--DeepSeek-V2-Lite.json",
    "deepseek-v2": "deepseek-ai--DeepSeek-V2.json",
    "deepseek-v3": "deepseek-ai--DeepSeek-V3.json",
}
MOE_FORMATS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def ctx_for(B, T):
    return ForwardContext(position_ids=torch.arange(T).expand(B, T), slots=torch.arange(T))


# ------------------------------------------------------------------------------------- routers

def test_router_runs_in_float32_in_a_bfloat16_model():
    r = router("softmax_topk").to(torch.bfloat16)
    x = torch.randn(6, D).to(torch.bfloat16)
    out = r(x)
    assert out.logits.dtype == out.weights.dtype == torch.float32
    torch.testing.assert_close(out.logits, x.float() @ r.weight.float().t())


def test_group_settings_must_fit_the_experts():
    with pytest.raises(SpecError, match=r"router\.n_groups"):
        zt.part("ffn", "moe", {"n_experts": 8, "router": {"name": "greedy_group", "n_groups": 3}})
    with pytest.raises(SpecError, match=r"router\.topk_group"):
        zt.part("ffn", "moe", {"n_experts": 8, "top_k": 6, "router": {"name": "greedy_group", "n_groups": 4,
                                                                       "topk_group": 2}})


# ------------------------------------------------------------------------------------ the FFN

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_dispatch_equals_the_loop(dtype):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    loop, grouped = moe(dispatch="loop").to(dtype), moe(dispatch="grouped").to(dtype)
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(3, 7, D).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = loop(xa), grouped(xb)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(yb, ya, atol=tol, rtol=tol)
    g = torch.randn_like(ya)
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(grouped.experts.w_down.grad, loop.experts.w_down.grad, atol=tol, rtol=tol)


def test_top_k_above_n_experts_and_unknown_router_are_refused_by_name():
    with pytest.raises(SpecError, match=r"^ffn\.top_k: top_k = 9 is more than n_experts = 8"):
        zt.part("ffn", "moe", {"n_experts": 8, "top_k": 9})
    with pytest.raises(SpecError, match=r"layers\.default\.ffn\.router\.name: unknown router 'nope'"):
        zt.tiny_spec({"layers.default.ffn": {"name": "moe", "router": {"name": "nope"}}})
    with pytest.raises(SpecError, match="bias_update"):
        zt.part("ffn", "moe", {"bias_update": "sign"})


# --------------------------------------------------------------------------------- balancing

def test_switch_loss_per_layer_is_the_notes_formula():
    m = moe(switch_loss=0.1)
    x = torch.randn(2, 9, D)
    ctx = ctx_for(2, 9)
    m(x, ctx)
    flat = x.reshape(-1, D)
    p = (flat @ m.router.weight.detach().t()).softmax(-1)
    chosen = F.one_hot(p.topk(2, dim=-1).indices, E).sum(1).float()
    f, P = chosen.mean(0), p.mean(0)  # share of tokens sent to each expert; mean probability
    torch.testing.assert_close(ctx.aux["moe_switch"], E * (f * P).sum())
    assert ctx.aux_weights["moe_switch"] == 0.1


def test_router_z_loss_is_switch_transformers():
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    m = moe(z_loss=1e-3)
    x = torch.randn(2, 9, D)
    ctx = ctx_for(2, 9)
    m(x, ctx)
    logits = (x @ m.router.weight.detach().t())
    torch.testing.assert_close(ctx.aux["router_z"], router_z_loss_func(logits))


def test_sequence_and_device_losses():
    m = moe(sequence_loss=1.0, device_loss=1.0, n_devices=2)
    x = torch.randn(2, 9, D)
    ctx = ctx_for(2, 9)
    m(x, ctx)
    p = (x @ m.router.weight.detach().t()).softmax(-1)  # (B, T, E)
    chosen = F.one_hot(p.topk(2, dim=-1).indices, E).sum(2).float()
    f = chosen.mean(1) * E / 2  # DeepSeek's f_i = E / (k T) * count_i, per sequence
    P = p.mean(1)
    torch.testing.assert_close(ctx.aux["moe_sequence"], (f * P).sum(-1).mean())
    f_dev, P_dev = f.view(2, 2, 4).mean(-1), P.view(2, 2, 4).sum(-1)
    torch.testing.assert_close(ctx.aux["moe_device"], (f_dev * P_dev).sum(-1).mean())


def test_pooled_loss_is_transformers_over_every_layer():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    spec = zt.tiny_spec({"n_layers": 3, "layers.default.ffn": {"name": "moe", "n_experts": E, "top_k": 2, "d_ff": 16,
                                                                  "switch_pooled_loss": 0.01, "switch_loss": 0.01}})
    model = zt.tiny_model(spec)
    logits = []
    hooks = [layer.ffn.router.register_forward_hook(lambda mod, i, out: logits.append(out.logits))
             for layer in model.layers]
    ids = torch.randint(0, 64, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = model.loss(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    expected = load_balancing_loss_func(tuple(logits), E, 2, mask)
    torch.testing.assert_close(out.aux["moe_switch_pooled"], expected)
    per_layer = sum(E * (F.one_hot(l.softmax(-1).topk(2, dim=-1).indices, E).sum(1).float()[mask.reshape(-1) > 0]
                         .mean(0) * l.softmax(-1)[mask.reshape(-1) > 0].mean(0)).sum() for l in logits)
    torch.testing.assert_close(out.aux["moe_switch"], per_layer)
    assert not torch.allclose(out.aux["moe_switch"] / 3, out.aux["moe_switch_pooled"])  # they differ
    torch.testing.assert_close(out.loss, out.ce + 0.01 * (out.aux["moe_switch"] + out.aux["moe_switch_pooled"]))
    assert {"moe_load_max", "moe_load_max.0", "moe_load_max.2", "router_entropy"} <= set(out.metrics)


@pytest.mark.parametrize("rule", ["sign", "sign_centered"])
def test_aux_free_bias_moves_towards_balance_by_the_global_load(rule):
    m = moe(router={"name": "softmax_topk", "selection_bias": True}, bias_update=rule, bias_rate=0.1).train()
    with torch.no_grad():
        m.router.bias.copy_(torch.randn(E))
    before = m.router.bias.clone()
    m(torch.randn(4, 8, D))
    local = m.load.clone()
    assert local.sum() == 4 * 8 * 2
    seen = []

    def reduce(t):  # two processes with the same load: the global load is twice the local one
        seen.append(t.clone())
        return 2 * t

    m.after_optimizer_step(reduce=reduce)
    assert torch.equal(seen[0], local)
    load = 2 * local
    step = 0.1 * torch.sign(load.mean() - load)
    if rule == "sign_centered":
        step = step - step.mean()
        torch.testing.assert_close(m.router.bias.sum(), before.sum())
    torch.testing.assert_close(m.router.bias, before + step)
    assert m.load.sum() == 0  # counted afresh until the next step


def test_aux_free_bias_is_trained_through_zoo_train_hook():
    from zoo.training.loop import after_optimizer_step

    spec = zt.tiny_spec({"layers.default.ffn": {"name": "moe", "n_experts": E, "top_k": 2, "d_ff": 16,
                                                "router": {"name": "sigmoid_group", "n_groups": 4, "topk_group": 2},
                                                "bias_update": "sign"}})
    model = zt.tiny_model(spec).train()
    model.loss(torch.randint(0, 64, (2, 12))).loss.backward()

    class One:
        num_processes = 1

        def reduce(self, t, reduction="sum"):
            return t

    after_optimizer_step(model, One())
    assert all(layer.ffn.router.bias.abs().sum() > 0 for layer in model.layers)


# --------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    made = {}

    def get(model_type):
        if model_type not in made:
            d = tmp_path_factory.mktemp(model_type)
            # Weights drawn at std 0.1 (logits up to ~4, router logits of std ~0.8, most experts
            # chosen): at the usual 0.25, fp32 summation order alone moves logits of ~9 by 1e-5.
            made[model_type] = (tiny.make_tiny(model_type, d, std=0.1), d)
        return made[model_type]

    return get


@pytest.mark.parametrize("model_type", MOE_FORMATS)
def test_parity_logits_and_aux_loss(model_type, tiny_moe):
    hf, d = tiny_moe(model_type)
    ours = zoo.from_pretrained(d)
    assert any(layer.ffn.__class__.__name__ == "MoE" for layer in ours.layers)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        out = ours.loss(ids, attention_mask=mask, return_logits=True)
        logits = ours(ids, attention_mask=mask, position_ids=pos)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.aux["moe_switch_pooled"], ref.aux_loss, atol=1e-6, rtol=1e-6)
    assert out.aux_weights["moe_switch_pooled"] == hf.config.router_aux_loss_coef


def test_experts_are_saved_per_key_and_bad_shapes_name_the_tensor(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, d = tiny_moe("qwen2_moe")
    ours = zoo.from_pretrained(d)
    zoo.save_pretrained(ours, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved
    assert not any("w_gate" in k for k in saved)
    torch.testing.assert_close(saved["model.layers.2.mlp.experts.3.gate_proj.weight"], ours.layers[2].ffn.experts.w_gate[3])
    saved["model.layers.1.mlp.experts.5.up_proj.weight"] = torch.zeros(33, 64)
    save_file(saved, tmp_path / "out" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        zoo.from_pretrained(tmp_path / "out")


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_released_configs_are_the_presets(preset):
    config = load(CONFIGS / RELEASED[preset])
    spec = config_to_spec(config)
    model = zoo.build(preset, device="meta")
    assert _architecture(spec) == _architecture(model.spec)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_mixtral_8x7b_has_its_published_size():
    assert zoo.build("mixtral-8x7b", device="meta").num_parameters() == 46_702_792_704


def test_first_k_dense_is_a_full_length_pattern():
    config = {**tiny.tiny_config("qwen3_moe"), "model_type": "qwen3_moe", "decoder_sparse_step": 1,
              "mlp_only_layers": [0, 1]}
    spec = config_to_spec(config)
    assert spec.layer_pattern == ("dense", "dense", "moe")
    assert spec.layer(0).ffn.name == "glu" and spec.layer(2).ffn.name == "moe"


# ----------------------------------------------------------------------------- accounting

# Each vendor's headline active count (billions, rounded; Qwen writes 3.3B for Qwen3-30B-A3B's 3.35B)
# is the count with embeddings and head.
HEADLINES = {"mixtral-8x7b": 12.9, "qwen1.5-moe-a2.7b": 2.7, "qwen3-30b-a3b": 3.4, "qwen3-235b-a22b": 22.2,
             "olmoe-1b-7b": 1.3}


@pytest.mark.parametrize("preset", sorted(HEADLINES))
def test_active_parameters_under_the_three_conventions(preset):
    from zoo.tools.accounting import account

    a = account(preset)
    spec = zoo.get_spec(preset)
    c = a["params"]["active_conventions"]
    assert round(c["with_embeddings_and_head"] / 1e9, 1) == HEADLINES[preset]
    matrix = spec.vocab_size * spec.d_model
    assert c["without_input_embedding"] == c["with_embeddings_and_head"] - matrix
    assert c["without_embeddings_and_head"] == c["with_embeddings_and_head"] - 2 * matrix
    assert a["flops"]["forward_per_token_2n"] == 2 * c["without_input_embedding"]


def test_mixtral_active_parameters_by_hand():
    from zoo.tools.accounting import account

    d, f, L = 4096, 14336, 32
    attention = 2 * d * d + 2 * d * 1024
    per_layer = attention + 2 * 3 * d * f + 8 * d + 2 * d  # two experts, the router, two norms
    assert account("mixtral-8x7b")["params"]["active"] == L * per_layer + 2 * 32000 * d + d


# ------------------------------------------------------------------------------ upcycling

@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("ffn", ["swiglu", "mlp_nobias"])
def test_upcycled_model_equals_the_dense_one_and_trains(shared, ffn):
    part = {"name": "swiglu", "d_ff": 48} if ffn == "swiglu" else {"name": "mlp", "d_ff": 48, "bias": False}
    dense = zt.tiny_model(zt.tiny_spec({"layers.default.ffn": part}))
    moe_model = zoo.upcycle(dense, n_experts=4, top_k=2, shared=shared, seed=3)
    assert moe_model.spec.layer(0).ffn.name == "moe"
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe_model(ids), dense(ids), atol=1e-5, rtol=1e-5)
    routers = [layer.ffn.router.weight for layer in moe_model.layers]
    assert routers[0].std() > 0  # a real router, not a constant one
    moe_model.train()
    opt = torch.optim.SGD(moe_model.parameters(), lr=0.5)
    before = moe_model.loss(ids).loss
    before.backward()
    assert moe_model.layers[0].ffn.experts.w_down.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        assert moe_model.loss(ids).loss < before


def test_upcycle_a_spec_and_refuse_biased_ffns():
    spec = zoo.upcycle(zt.tiny_spec(), n_experts=8, top_k=2)
    assert spec.layer(0).ffn.n_experts == 8 and spec.layer(0).ffn.norm_topk_prob
    with pytest.raises(SpecError, match=r"layers\.default\.ffn"):
        zoo.upcycle(zt.tiny_spec({"layers.default.ffn": {"name": "mlp"}}), n_experts=4, top_k=2)


def test_an_upcycled_model_trains_with_zoo_train(tmp_path, one_thread):
    dense = zt.tiny_model(zt.tiny_spec({"vocab_size": 256, "layers.default.mixer.qk_norm": "head",
                                        "layers.default.ffn": {"name": "swiglu", "d_ff": 64}}))
    upcycled = zoo.upcycle(dense, n_experts=4, top_k=2)
    zoo.save_pretrained(upcycled, tmp_path / "moe", model_type="qwen3_moe")  # a Qwen3-MoE checkpoint
    r = zoo.train(init_from=str(tmp_path / "moe"), steps=3, seq_len=16, global_batch=4, micro_batch=4, lr=1e-3,
                  out_dir=str(tmp_path / "run"), progress=False, plot=False, export=False, cpu=True)
    assert len(r.losses) == 3 and all(math.isfinite(x) for x in r.losses)
    with torch.no_grad():  # the first step saw the upcycled model, which computes what the dense one does
        first = TokenData(load_tokens(), 16, seed=0).batch(0, 4)
        assert r.losses[0] == pytest.approx(float(dense.loss(first).loss), rel=1e-4)


def test_capacity_drops_the_latest_copies_and_counts_them():
    full, capped = moe(), moe(capacity_factor=0.5)
    x = torch.randn(1, 16, D)
    ctx = ctx_for(1, 16)
    y = capped(x, ctx)
    capacity = math.ceil(0.5 * 16 * 2 / E)  # 2 copies per expert
    flat = x.reshape(-1, D)
    r = full.route(flat)
    expected = torch.zeros_like(flat)
    taken = {e: 0 for e in range(E)}
    dropped = 0
    for n in range(16):  # earliest tokens first
        for j, e in enumerate(r.indices[n].tolist()):
            if taken[e] == capacity:
                dropped += 1
                continue
            taken[e] += 1
            one, _ = full.routed(flat[n : n + 1], r.indices[n : n + 1, j : j + 1], r.weights[n : n + 1, j : j + 1])
            expected[n] += one[0]
    assert dropped > 0
    torch.testing.assert_close(y.reshape(-1, D), expected.detach(), atol=1e-5, rtol=1e-5)
    assert ctx.metrics["moe_dropped"].item() == pytest.approx(dropped / 32)
    with pytest.raises(SpecError, match="capacity_factor"):
        zt.part("ffn", "moe", {"capacity_factor": 0.0})
