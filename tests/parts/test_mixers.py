"""Token mixers that own their state, parts that state their own facts, auxiliary losses: a toy
recurrent mixer and a toy top-2 MoE, registered from a test plugin (tests/toy_plugin.py), go
through every path the built-in parts go through."""

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import zoo
import zoo.testing as zt
from zoo.tools.accounting import account
from zoo.cli import main
from hf_pairs import assert_same_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def toy():
    info = zoo.load_plugin("toy_plugin")
    assert info.error is None, info.error
    import toy_plugin

    return toy_plugin


def hybrid(toy, seed=0, **over):
    return zoo.build(toy.SPEC, seed=seed, **over).eval()


def greedy_without_state(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def test_the_plugin_registers_mixers_ffns_and_a_format(toy):
    info = zoo.manager().plugins["toy_plugin"]
    assert ("mixer", "toy_recurrent") in info.registered and ("ffn", "toy_moe") in info.registered
    assert ("checkpoint_format", "toy-hybrid") in info.registered
    assert zoo.manager().provider_of("mixer", "toy_recurrent") == "toy_plugin"
    with pytest.deprecated_call():  # the old kind name reaches the mixers
        assert "toy_recurrent" in zoo.list_components("attention")


def test_a_mixer_that_takes_no_rotation_leaves_attention_its_whole_head(toy):
    model = hybrid(toy)
    rec, att = model.layers[0].mixer, model.layers[1].mixer
    assert model._pos_key[0] is None and model._pos_key[2] is None  # recurrent layers: no RoPE
    rope = model.positions[model._pos_key[1]]
    assert rope.dim == att.head_dim == 8 and type(rec).__name__ == "ToyRecurrent"


@torch.no_grad()
def test_two_head_widths_in_one_model_each_rotate_their_whole_head():
    model = zoo.build("gemma2-2b", n_layers=2, d_model=64, vocab_size=128, seed=0,
                      overrides={"layers.local.mixer.head_dim": 16, "layers.global.mixer.head_dim": 32,
                                 "layers.*.ffn.d_ff": 64, "layers.local.mixer.window": 4})
    assert len(model.positions) == 2
    for i, layer in enumerate(model.layers):
        D = layer.mixer.head_dim
        rope = model.positions[model._pos_key[i]]
        q = torch.randn(1, 1, 3, D)
        cos_sin = rope.prepare(torch.tensor([[5, 6, 7]]), torch.float32)
        turned, _ = rope.rotate(q, q, cos_sin)
        # Rotation keeps each pair's norm and moves every dimension of the head, the last half included.
        torch.testing.assert_close(turned.norm(dim=-1), q.norm(dim=-1))
        assert (turned[..., D // 2:] - q[..., D // 2:]).abs().min() > 0, f"layer {i}: part of the head is not rotated"


def test_the_loss_carries_each_auxiliary_term_with_its_weight(toy):
    model = hybrid(toy).train()
    ids = torch.randint(0, 64, (2, 12))
    out = model.loss(ids)
    assert set(out.aux) == {"moe_balance"} and set(out.metrics) == {"router_entropy"}
    assert out.aux_weights == {"moe_balance": 0.01}
    torch.testing.assert_close(out.loss, out.ce + 0.01 * out.aux["moe_balance"])
    assert 4 * 0.9 < float(out.aux["moe_balance"]) < 4 * 2  # four layers, each near 1 when balanced
    assert 0 < float(out.metrics["router_entropy"]) <= torch.log(torch.tensor(4.0)) + 1e-5
    router = model.layers[0].ffn.router.weight
    (g_total,) = torch.autograd.grad(out.loss, router, retain_graph=True)
    (g_ce,) = torch.autograd.grad(out.ce, router)
    assert not torch.allclose(g_total, g_ce)  # the balance term reaches the router
    assert set(out.terms()) == {"loss", "ce", "z", "moe_balance", "router_entropy"}


@pytest.mark.slow  # compiled decoding
@torch.no_grad()
def test_generate_eager_and_compiled_equal_the_full_forward(toy):
    model = hybrid(toy)
    ids = torch.randint(0, 64, (2, 7))
    eager = zoo.generate(model, ids, 9)
    assert torch.equal(eager, greedy_without_state(model, ids, 9))
    torch._dynamo.reset()  # another test may have compiled the step for another model in this process
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(zoo.generate(model, ids, 9, compile=True), eager)
    # A left-padded batch: each row generates what it would alone.
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    padded = zoo.generate(model, ids, 5, attention_mask=mask)
    assert torch.equal(padded[1:], zoo.generate(model, ids[1:], 5))
    assert torch.equal(padded[:1, 2:], zoo.generate(model, ids[:1, 2:], 5))


@torch.no_grad()
def test_accounting_sums_what_each_part_reports(toy):
    model = hybrid(toy)
    a = account(model, context=10, batch=3, dtype=torch.float32)
    moe = model.layers[0].ffn
    per_expert = sum(w[0].numel() for w in (moe.w_gate, moe.w_up, moe.w_down))  # the toy plugin's own MoE
    assert a["params"]["total"] - a["params"]["active"] == 4 * 2 * per_expert  # 4 layers, 2 of 4 experts idle
    assert a["flops"]["forward_per_token_2n"] == 2 * (a["flops"]["matmul_params"] - 4 * 2 * per_expert)
    state = a["decode_state"]
    assert state["bytes_per_token"] == 2 * (2 * 2 * 8) * 4  # two attention layers: k and v, 2 kv heads of 8
    assert state["fixed_bytes"] == 2 * (4 * 8 * 8) * 4 * 3  # two recurrent layers: S of 4 heads, 8 x 8, batch 3
    held = model.new_state(3, 10)
    model(torch.randint(0, 64, (3, 10)), state=held)
    assert held.nbytes() == state["bytes"]
    assert a["shape"]["experts"] == "top-2 of 4" and a["shape"]["attention"] == {"att": "GQA-2"}


def test_describe_shows_each_parts_facts(toy, tmp_path, capsys):
    recipe = tmp_path / "hybrid.json"
    recipe.write_text(json.dumps(toy.SPEC))
    assert main(["describe", str(recipe)]) == 0
    text = capsys.readouterr().out
    assert "[rec] mixer" in text and "toy_recurrent" in text and "decayed linear attention" in text
    assert "[att] attention" in text and "GQA-2" in text and "[rec] experts" in text
    assert "active per token" in text and "fixed (recurrent) state" in text


def test_shrink_is_each_parts_own_rule(toy):
    spec = zoo.get_spec(toy.SPEC, {"layers.*.ffn.d_ff": 128, "layers.rec.mixer.head_dim": 16,
                                   "layers.att.mixer.n_heads": 8, "layers.att.mixer.n_kv_heads": 1})
    small = zt.shrink(spec, head_dim=4, d_ff=24)
    rec, att = small.layers["rec"], small.layers["att"]
    assert (rec.mixer.n_heads, rec.mixer.head_dim, rec.ffn.d_ff) == (2, 4, 24)
    assert (att.mixer.n_heads, att.mixer.n_kv_heads, att.mixer.head_dim, att.ffn.d_ff) == (4, 1, 4, 24)
    zt.check_model(small, "shrunk hybrid")


@torch.no_grad()
def test_save_and_load_through_a_plugin_format_keeps_buffers(toy, tmp_path):
    model = hybrid(toy, seed=3)
    for layer in model.layers:  # buffers set, as a trained model has them
        layer.ffn.expert_bias.normal_()
    zoo.save_pretrained(model, tmp_path / "ckpt", model_type="toy-hybrid")
    loaded = zoo.from_pretrained(tmp_path / "ckpt")
    assert_same_model(model, loaded, 64)


def test_conformance_passes_the_toy_parts_and_fails_their_broken_variants(toy):
    zt.check("mixer", "toy_recurrent")
    zt.check("ffn", "toy_moe")
    with pytest.raises(AssertionError, match="toy_recurrent_broken.*one token at a time differs"):
        zt.check("mixer", "toy_recurrent_broken")
    with pytest.raises(AssertionError, match="toy_moe_broken.*mixes tokens"):
        zt.check("ffn", "toy_moe_broken")


def test_training_logs_every_term_and_runs_the_post_step_hook(toy, tmp_path):
    from zoo.training.checkpointer import CheckpointWeights

    result = zoo.train(toy.SPEC, overrides={"vocab_size": 256}, steps=3, seq_len=16, global_batch=4, micro_batch=4, lr=3e-3, out_dir=str(tmp_path),
                       progress=False, plot=False, export=False, cpu=True)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all({"loss", "ce", "z", "moe_balance", "router_entropy"} <= set(r) for r in rows)
    for r, t in zip(rows, result.terms):
        assert r["loss"] == pytest.approx(r["ce"] + 0.01 * r["moe_balance"], rel=1e-5)
        assert t["moe_balance"] == r["moe_balance"]
    weights = CheckpointWeights(result.checkpoint)
    bias = weights["layers.0.ffn.expert_bias"]
    # Three steps of +-0.01 per expert, summing to zero when counts straddle the mean.
    assert bias.abs().max() > 0 and torch.all((bias * 100).round() == bias * 100)


# ----------------------------------------------------------------- plugins written before mixers

class OldStyleAttention(nn.Module):
    """An attention plugin as written against the old contract: registered with add_attention,
    ``head_dim_for`` instead of ``rotary_dim``, ``forward(x, ctx, rotary)``, no decode state."""

    @dataclass(frozen=True)
    class Config:
        n_heads: int = 4

    @staticmethod
    def head_dim_for(cfg, d_model):
        return d_model // cfg.n_heads

    def __init__(self, cfg, *, d_model, layer, spec, index=0):
        super().__init__()
        self.cfg, self.proj = cfg, nn.Linear(d_model, d_model)

    def forward(self, x, ctx, rotary):
        B, T, d = x.shape
        H = self.cfg.n_heads
        q = self.proj(x).view(B, T, H, d // H).transpose(1, 2)
        q, k = rotary.rotate(q, q)
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        if ctx.key_mask is not None:
            allowed = allowed & ctx.key_mask[:, None, None, :]
            allowed = allowed | ~allowed.any(-1, keepdim=True)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, q, attn_mask=allowed)
        return y.transpose(1, 2).reshape(B, T, d)


def test_an_attention_plugin_written_before_mixers_still_builds_and_trains(tmp_path):
    with pytest.deprecated_call():  # every old spelling of a mixer, on purpose
        manager = zoo.manager()
        with manager.providing("old_plugin"):
            manager.add_attention("old_style", OldStyleAttention, override=True)
        spec = zoo.get_spec({**zt.TINY, "layers": {"default": {"attention": {"name": "old_style"}}}},
                            {"layers.*.attention.n_heads": 2})
        assert spec.layer(0).mixer.name == "old_style" and spec.layer(0).attention.n_heads == 2
        model = zoo.build(spec, seed=0)
        assert model.positions["0"].dim == 16  # RoPE sized by the old head_dim_for
        model.loss(torch.randint(0, 64, (2, 8))).loss.backward()
        # It keeps no decode state: generation refuses it by name instead of decoding wrongly.
        with pytest.raises(ValueError, match="OldStyleAttention.*'old_style'.*cannot decode incrementally"):
            zoo.generate(model, torch.randint(0, 64, (1, 4)), 2)
        with pytest.raises(AssertionError, match="cannot decode incrementally"):
            zt.check("attention", "old_style")


def test_the_plugin_guides_mixer_example_passes_the_contract():
    """docs/guides/plugins.md's decayed linear attention is run as written, and decodes as it computes."""
    from pathlib import Path

    import torch.nn.functional as F

    from zoo.core.kinds import Cost

    guide = (Path(__file__).parents[2] / "docs" / "guides" / "plugins.md").read_text()
    code = guide.split("## 5. A mixer with its own state")[1].split("```python")[1].split("```")[0]
    scope = {"torch": torch, "nn": nn, "F": F, "dataclass": dataclass, "Cost": Cost}
    exec(code, scope)
    with zoo.manager().providing("guide_example"):
        zoo.manager().add_mixer("decayed_linear", scope["DecayedLinear"], override=True)
    zt.check("mixer", "decayed_linear")


def test_a_loss_pooled_over_layers_is_computed_once_at_the_end(toy):
    """Parts gather per-layer statistics in ``ctx.shared`` and register one ``at_end`` computation
    (how a balance loss pooled over every layer, transformers' convention, is made)."""
    class Pooled(nn.Module):
        @dataclass(frozen=True)
        class Config:
            pass

        def __init__(self, cfg, *, d_model):
            super().__init__()
            self.lin = nn.Linear(d_model, d_model)

        def forward(self, x, ctx=None):
            if ctx is not None:
                ctx.shared.setdefault("pooled_means", []).append(x.mean())
                ctx.at_end("pooled", lambda c: c.add_loss("pooled", torch.stack(c.shared["pooled_means"]).mean()))
            return self.lin(x)

    with zoo.manager().providing("pooled_test"):
        zoo.manager().add_ffn("pooled_test_ffn", Pooled, override=True)
    model = zoo.build(zt.TINY, overrides={"layers.default.ffn": "pooled_test_ffn", "n_layers": 3}, seed=0)
    ids = torch.randint(0, 64, (2, 6))
    means = []
    hooks = [layer.ffn.register_forward_hook(lambda m, a, out: means.append(a[0].mean())) for layer in model.layers]
    out = model.loss(ids)
    for h in hooks:
        h.remove()
    assert set(out.aux) == {"pooled"}
    torch.testing.assert_close(out.aux["pooled"], torch.stack(means).mean())


def test_a_context_slot_is_one_instance_of_its_kind_for_the_whole_forward():
    """``ctx.slot(kind)``: what the layers of one forward share of a kind its producer defines (the
    mixture of experts' layer count and pooled statistics), typed where ``ctx.shared`` takes strings."""
    from zoo.components.ffn.moe import MoEForward
    from zoo.components.mixers.dsa import Selections
    from zoo.core.context import ForwardContext

    ctx = ForwardContext(torch.zeros(1, 2, dtype=torch.long), torch.arange(2))
    seen = ctx.slot(MoEForward)
    seen.layers += 1
    assert ctx.slot(MoEForward) is seen and ctx.slot(MoEForward).layers == 1
    assert isinstance(ctx.slot(Selections), Selections) and ctx.slot(Selections).by_layer == {}
    assert ForwardContext(torch.zeros(1, 2, dtype=torch.long), torch.arange(2)).slot(MoEForward).layers == 0
