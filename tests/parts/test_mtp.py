"""Multi-token prediction: the spec, the loss against a hand-written reference, the forward against
transformers' MTP layer, checkpoints in DeepSeek's layout (layer n_layers), and self-speculative
decoding (greedy output identical to plain greedy, with a rolled-back decode state)."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.core import registry as _registry
from zoo.checkpoints import CheckpointError
from zoo.checkpoints.hf.formats.llama import LlamaStyle
from zoo.core.context import ForwardContext
from zoo.checkpoints.hf.mtp import DEEPSEEK, QWEN3_NEXT, mtp_rules, read_mtp
from zoo.inference.speculative import SpeculationStats
from zoo.core.spec import SpecError
from zoo.core.state import KVState, step_layout

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

SMALL = {"n_layers": 2, "d_model": 32, "vocab_size": 64, "layers.*.mixer.n_heads": 4,
         "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64, "max_seq_len": 256}


def tiny(mtp=None, preset="llama3-8b", seed=0, **over):
    overrides = {**SMALL, **over}
    if mtp is not None:
        overrides["mtp"] = mtp
    model = zoo.build(preset, seed=seed, overrides=overrides)
    with torch.no_grad():  # norms away from 1, so that a missing or misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("mtp, path", [({"depth": 0}, "mtp.depth"), ({"weight": -0.1}, "mtp.weight"),
                                       ({"layer": "moe"}, "mtp.layer"), ({"depht": 1}, "mtp.depht"),
                                       ({"depth": "1"}, "mtp.depth")])
def test_bad_mtp_settings_name_the_field(mtp, path):
    with pytest.raises(SpecError) as err:
        zoo.get_spec("llama3-8b", overrides={"mtp": mtp})
    assert err.value.path == path


def test_loss_adds_weight_over_depth_times_each_depths_cross_entropy():
    """A hand-written reference: depth d at position i reads the depth d-1 hidden state at i and the
    embedding of token i+d, and is scored on token i+1+d; DeepSeek's total is ce + lambda/D * sum."""
    model = tiny({"depth": 2, "weight": 0.4})
    ids = torch.randint(0, 64, (2, 12))
    out = model.loss(ids)
    h = model.hidden_states(ids)
    ref, T = {}, ids.shape[1]
    for d, m in enumerate(model.mtp.layers):
        n = T - 1 - d
        x = m.eh_proj(torch.cat([m.enorm(model.embed(ids[:, 1 + d:])), m.hnorm(h[:, :n])], dim=-1))
        slots, _, positions = step_layout(2, n, ids.device)
        ctx = ForwardContext(position_ids=positions, slots=slots)
        h = m.block(x, ctx, model.position_state(positions, x.dtype, 1))
        logits = model.logits_from_hidden(m.norm(h))
        ref[f"mtp_{d + 1}"] = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 2 + d:].reshape(-1))
    assert set(out.aux) == set(ref)
    for k in ref:
        torch.testing.assert_close(out.aux[k], ref[k])
        assert out.aux_weights[k] == pytest.approx(0.2)
    torch.testing.assert_close(out.loss, out.ce + 0.2 * (ref["mtp_1"] + ref["mtp_2"]))
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())


def test_padding_is_no_target_of_any_depth():
    model = tiny({"depth": 1})
    ids = torch.randint(0, 64, (1, 10))
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, :3] = 0
    padded = model.loss(ids, attention_mask=mask).aux["mtp_1"]
    alone = model.loss(ids[:, 3:]).aux["mtp_1"]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


# -- checkpoints: a llama-shaped format that stores MTP as DeepSeek does --------------------------

class LlamaMTP(LlamaStyle):
    model_type = "llama_mtp"
    layout = DEEPSEEK

    def config_to_spec(self, config, *, strict=False):
        from zoo.checkpoints.hf.format import Fields

        config = dict(config)
        mtp = read_mtp(Fields({k: config.pop(k) for k in ["num_nextn_predict_layers"] if k in config}, "llama_mtp"))
        spec = super().config_to_spec(config, strict=strict)
        return spec.with_overrides(mtp=mtp) if mtp else spec

    def spec_to_config(self, spec):
        return {**super().spec_to_config(spec), **({"num_nextn_predict_layers": spec.mtp.depth} if spec.mtp else {})}

    def rules(self, spec):
        rules = super().rules(spec)
        return mtp_rules(rules, spec, self.layout) + rules


@pytest.fixture
def llama_mtp():
    reg = _registry.registry("checkpoint_format")
    reg.add("llama_mtp", LlamaMTP(), provider="tests")
    yield
    reg.remove("llama_mtp", "tests")


def test_qwen3_next_layout_names_the_same_module_in_its_own_tree():
    spec = zoo.get_spec("llama3-8b", overrides={**SMALL, "mtp": {"depth": 1}})
    names = {h: z for r in mtp_rules(LlamaStyle().rules(spec), spec, QWEN3_NEXT) for h, z in zip(r.hf, r.zoo)}
    assert names["mtp.fc.weight"] == "mtp.layers.0.eh_proj.weight"
    assert names["mtp.pre_fc_norm_embedding.weight"] == "mtp.layers.0.enorm.weight"
    assert names["mtp.pre_fc_norm_hidden.weight"] == "mtp.layers.0.hnorm.weight"
    assert names["mtp.norm.weight"] == "mtp.layers.0.norm.weight"
    assert names["mtp.layers.0.self_attn.q_proj.weight"] == "mtp.layers.0.block.mixer.q_proj.weight"
    assert not any("embed_tokens" in h or "shared_head" in h for h in names)


def hf_llama_with_mtp(tmp_path, depth=1):
    """A tiny transformers Llama, saved by transformers, plus transformers' own MTP layer(s) on it
    (modeling_layers.MtpModel) with random weights, written into the checkpoint as DeepSeek-V3 stores them."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, rms_norm_eps=1e-6)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.config.num_mtp_layers = depth
    mtp = MtpModel(hf, depth).eval()
    with torch.no_grad():
        for p in list(hf.parameters()) + list(mtp.parameters()):
            p.normal_(1.0, 0.3) if p.dim() == 1 else p.normal_(0, 0.05)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    L = config.num_hidden_layers
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, d, rest = name.split(".", 2)
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        tensors[f"model.layers.{L + int(d)}.{rest}"] = t.clone()
    for d in range(depth):
        tensors[f"model.layers.{L + d}.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
        tensors[f"model.layers.{L + d}.shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="llama_mtp", num_nextn_predict_layers=depth)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return hf, mtp, tensors


def test_mtp_forward_matches_transformers_mtp_layer(tmp_path, llama_mtp):
    """Against transformers' generic MTP layer (transformers.modeling_layers.MtpLayer: enorm, hnorm,
    eh_proj over [enorm(embedding); hnorm(hidden)], the decoder layer, post_norm = shared_head.norm,
    then the shared head), run on a Llama decoder layer."""
    hf, mtp, _ = hf_llama_with_mtp(tmp_path)
    model = zoo.from_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 11))
    T = ids.shape[1]
    with torch.no_grad():
        hf_h = hf.model(ids).last_hidden_state
        positions = torch.arange(T - 1)[None].expand(2, -1)
        hf_out = mtp.forward_layer(0, hf_h[:, :-1], positions, None, input_ids=ids[:, 1:])
        hf_logits = mtp._project_to_logits(hf_out)
        h = model.hidden_states(ids)
        torch.testing.assert_close(h, hf_h, atol=1e-5, rtol=1e-5)
        slots, _, pos = step_layout(2, T - 1, ids.device)
        out = model.mtp.run(model, 0, h[:, :-1], ids[:, 1:], ForwardContext(position_ids=pos, slots=slots))
        logits = model.mtp.logits(model, 0, out)
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5)


def test_transformers_mtp_loss_raises_so_zoo_checks_against_a_reference(tmp_path):
    """transformers 5.23's ``MtpModel.forward`` starts with ``loss = None`` and, given labels, does
    ``loss += self.loss_function(...)``: a TypeError (NoneType += Tensor). zoo's MTP loss is checked
    against the hand-written reference above instead."""
    hf, mtp, _ = hf_llama_with_mtp(tmp_path)
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state
    with pytest.raises(TypeError, match="NoneType"):
        mtp(ids[:, 1:], h[:, :-1], None, torch.arange(7)[None], None, labels=ids[:, 1:])


def test_checkpoint_round_trip_keeps_every_mtp_tensor(tmp_path, llama_mtp):
    from safetensors.torch import load_file

    _, _, tensors = hf_llama_with_mtp(tmp_path / "in", depth=2)
    model = zoo.from_pretrained(tmp_path / "in")
    assert model.spec.mtp.depth == 2
    zoo.save_pretrained(model, tmp_path / "out")
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        torch.testing.assert_close(back[name], t, msg=name)
    again = zoo.from_pretrained(tmp_path / "out")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)


def test_a_depth_without_weights_is_refused_naming_it(tmp_path, llama_mtp):
    hf_llama_with_mtp(tmp_path, depth=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    with pytest.raises(CheckpointError, match=r"module 2 \(layer 3\) has no weights"):
        zoo.from_pretrained(tmp_path)


# -- self-speculative decoding -------------------------------------------------------------------

def trained(steps=20, **over):
    """A tiny model that has learnt a few periodic sequences, so that its MTP module drafts well."""
    torch.manual_seed(0)
    model = tiny({"depth": 1, "weight": 1.0}, **over).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    base = torch.tensor([3, 17, 5, 42, 9, 11, 30])
    for _ in range(steps):
        starts = torch.randint(0, 7, (8,))
        ids = torch.stack([base[(torch.arange(24) + s) % 7] for s in starts])
        opt.zero_grad()
        model.loss(ids).loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def periodic():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before the one_thread fixture
    try:
        return trained()
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("which", ["trained", "random"])
def test_speculative_greedy_equals_plain_greedy(periodic, which):
    """The trained model's drafts are accepted, the random one's rejected: both paths give plain greedy."""
    model = periodic if which == "trained" else tiny({"depth": 1}, seed=3)
    total = SpeculationStats()
    for ids in (torch.tensor([[3, 17, 5, 42, 9]]), torch.tensor([[1, 2, 3, 60, 61, 7, 8]]), torch.tensor([[30]])):
        plain = zoo.generate(model, ids, 30)
        stats = SpeculationStats()
        fast = zoo.generate(model, ids, 30, speculative="mtp", stats=stats)
        assert torch.equal(fast, plain)
        assert stats.drafted == stats.steps > 0
        total.drafted += stats.drafted
        total.accepted += stats.accepted
    if which == "trained":
        assert total.acceptance > 0.9
    else:
        assert total.acceptance < 0.2


def test_speculative_rolls_back_a_sliding_window_ring():
    """Window 4, so the ring wraps; the random model's drafts are all rejected and rolled back."""
    window = {"preset": "mistral-7b", "layers.*.mixer.window": 4}
    for model in (trained(**window), tiny({"depth": 1}, seed=3, **window)):
        stats = SpeculationStats()
        for ids in (torch.tensor([[3, 17, 5, 42, 9, 11]]), torch.tensor([[8, 1, 60, 2]])):
            assert torch.equal(zoo.generate(model, ids, 25, speculative="mtp", stats=stats), zoo.generate(model, ids, 25))
        assert stats.drafted > 0


def test_speculative_stops_and_pads_like_plain(periodic):
    ids = torch.tensor([[0, 0, 3, 17, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    plain = zoo.generate(periodic, ids, 20, attention_mask=mask, stop=9)
    seen = []
    fast = zoo.generate(periodic, ids, 20, attention_mask=mask, stop=9, speculative="mtp", callback=seen.append)
    assert torch.equal(fast, plain)
    assert torch.equal(torch.cat(seen), fast[0, 5:])


def test_speculative_refusals(periodic):
    ids = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="one sequence at a time"):
        zoo.generate(periodic, ids, 4, speculative="mtp")
    with pytest.raises(ValueError, match="greedily"):
        zoo.generate(periodic, ids[:1], 4, speculative="mtp", temperature=0.7)
    with pytest.raises(ValueError, match="multi-token prediction"):
        zoo.generate(tiny(), ids[:1], 4, speculative="mtp")
    with pytest.raises(ValueError, match="'mtp'"):
        zoo.generate(periodic, ids[:1], 4, speculative="medusa")


def test_speculative_refuses_a_mixer_that_cannot_roll_back():
    import zoo.testing as zt

    zoo.load_plugin("toy_plugin")  # tests/toy_plugin.py: a recurrent mixer whose state has no truncate
    model = zt.tiny_model(zt.hybrid_spec("toy_recurrent", mtp={"depth": 1}))
    with pytest.raises(ValueError, match=r"layer 0's decode state .* has no truncate"):
        zoo.generate(model, torch.tensor([[1, 2, 3]]), 4, speculative="mtp")


def test_kv_ring_truncate_restores_what_the_drafts_replaced():
    torch.manual_seed(0)
    state = KVState(window=4)
    k = torch.randn(1, 1, 7, 2)
    state.update(k[:, :, :5], k[:, :, :5], torch.arange(5))
    before = (state.k.clone(), state.idx.clone(), state.filled)
    state.update(k[:, :, 5:7], k[:, :, 5:7], torch.arange(5, 7))
    state.truncate(6)  # drop slot 6 only: its ring entry holds slot 2 again
    assert sorted(state.idx.tolist()) == [2, 3, 4, 5] and state.filled == 4
    assert torch.equal(state.k[:, :, state.idx == 2], before[0][:, :, before[1] == 2])
    state.update(k[:, :, 6:7], k[:, :, 6:7], torch.tensor([6]))
    with pytest.raises(ValueError, match="cannot drop slot 6"):
        state.truncate(6)  # a one-token update keeps no copy of what it replaced


def test_zoo_train_logs_each_depth_and_adds_it_to_the_loss(tmp_path):
    """`zoo train` with mtp.depth = 2: every step's terms and metrics.jsonl carry mtp_1 and mtp_2, the
    loss is ce + weight / depth * (mtp_1 + mtp_2), and the modules learn (their losses fall)."""
    from zoo.cli import main

    out = tmp_path / "run"
    assert main(["train", "llama3-8b", *[f"--set={k}={v}" for k, v in SMALL.items() if k != "vocab_size"],
                 "--set=vocab_size=256", "--set=mtp.depth=2", "--set=mtp.weight=0.5", "--steps=30", "--seq-len=32",
                 "--global-batch=8", "--lr=3e-3", "--cpu", "--no-progress", "--no-plot", "--no-export", f"--out-dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    for r in rows:
        assert r["loss"] == pytest.approx(r["ce"] + 0.25 * (r["mtp_1"] + r["mtp_2"]), rel=1e-5)
    assert rows[-1]["mtp_1"] < rows[0]["mtp_1"] - 0.5 and rows[-1]["mtp_2"] < rows[0]["mtp_2"] - 0.5


# -- DeepSeek-V3: the MTP module as layer n_layers, against transformers' MTP layer -------------------

def deepseek_v3_with_mtp(tmp_path):
    """A tiny DeepSeek-V3 written by transformers (which drops MTP weights), transformers' own MTP layer
    on it (an MoE MLA decoder layer, as DeepSeek's), its weights added to the checkpoint as layer
    n_layers with transformers' own on-disk names (a one-layer model saved by transformers carries them)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    from zoo.checkpoints.tiny import make_tiny

    hf = make_tiny("deepseek_v3", tmp_path / "main", std=0.1)
    mtp = MtpModel(hf, 1).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mtp.layers.parameters():  # (built uninitialised)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        for name, b in mtp.layers.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    one = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**hf.config.to_dict(), "num_hidden_layers": 1,
                                                                              "first_k_dense_replace": 0}))
    one.model.layers[0].load_state_dict(mtp.layers[0].mtp_block.state_dict())
    one.save_pretrained(tmp_path / "one")
    L = hf.config.num_hidden_layers
    tensors = load_file(tmp_path / "main" / "model.safetensors")
    for name, t in load_file(tmp_path / "one" / "model.safetensors").items():
        if name.startswith("model.layers.0."):
            tensors[name.replace("model.layers.0.", f"model.layers.{L}.")] = t
    layer = mtp.layers[0]
    for name, t in {"enorm": layer.enorm.weight, "hnorm": layer.hnorm.weight, "eh_proj": layer.eh_proj.weight,
                    "shared_head.norm": layer.post_norm.weight, "embed_tokens": hf.model.embed_tokens.weight,
                    "shared_head.head": hf.lm_head.weight}.items():
        tensors[f"model.layers.{L}.{name}.weight"] = t.detach().clone()
    save_file(tensors, tmp_path / "main" / "model.safetensors", metadata={"format": "pt"})
    return hf, mtp, tensors


@torch.no_grad()
def test_deepseek_v3_mtp_loads_matches_transformers_and_saves_back(tmp_path):
    from safetensors.torch import load_file

    hf, mtp, tensors = deepseek_v3_with_mtp(tmp_path)
    L = hf.config.num_hidden_layers
    model = zoo.from_pretrained(tmp_path / "main")
    assert model.spec.mtp.depth == 1 and model.mtp.layers[0].block.ffn.router.bias.abs().sum() > 0
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    T = ids.shape[1]
    hf_h = hf.model(ids).last_hidden_state
    positions = torch.arange(T - 1)[None].expand(2, -1)
    want = mtp._project_to_logits(mtp.forward_layer(0, hf_h[:, :-1], positions, None, input_ids=ids[:, 1:]))
    h = model.hidden_states(ids)
    slots, _, pos = step_layout(2, T - 1, ids.device)
    got = model.mtp.logits(model, 0, model.mtp.run(model, 0, h[:, :-1], ids[:, 1:],
                                                   ForwardContext(position_ids=pos, slots=slots)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stats = SpeculationStats()  # MLA's latent state rolls back too
    assert torch.equal(zoo.generate(model, ids[:1], 12, speculative="mtp", stats=stats), zoo.generate(model, ids[:1], 12))
    assert stats.drafted > 0
    zoo.save_pretrained(model, tmp_path / "out")
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert {n for n in back if n.startswith(f"model.layers.{L}.")} == {n for n in tensors if n.startswith(f"model.layers.{L}.")}
    for name, t in tensors.items():
        torch.testing.assert_close(back[name], t, atol=0, rtol=0, msg=name)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("copy", ["embed_tokens", "shared_head.head"])
def test_deepseek_v3_mtp_copies_that_differ_from_the_main_tensors_are_refused_naming_them(tmp_path, copy):
    """zoo keeps one embedding and one head; a stored copy that differs would be dropped unread."""
    from safetensors.torch import save_file

    hf, _, tensors = deepseek_v3_with_mtp(tmp_path)
    name = f"model.layers.{hf.config.num_hidden_layers}.{copy}.weight"
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, tmp_path / "main" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}.*both fill zoo's .*and they differ"):
        zoo.from_pretrained(tmp_path / "main", progress=False)


def test_deepseek_v3_written_by_transformers_loads_without_mtp_and_saves_a_config_that_says_so(tmp_path):
    """transformers drops the MTP weights but keeps num_nextn_predict_layers = 1: zoo builds the main
    model only (as transformers does), and a save writes 0, which is what the files then hold."""
    pytest.importorskip("transformers")
    from zoo.checkpoints.tiny import make_tiny

    make_tiny("deepseek_v3", tmp_path / "in")
    assert json.loads((tmp_path / "in" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = zoo.from_pretrained(tmp_path / "in")
    assert model.mtp is None and model.spec.mtp is None
    zoo.save_pretrained(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_deepseek_v3_preset_has_one_mtp_module_outside_its_671b():
    """The module is one MoE layer like layer 60, eh_proj (2d -> d) and three norms; with the stored
    copies of the embedding and head the released files hold 684.5B (the model card's "685B")."""
    model = zoo.build("deepseek-v3", device="meta")
    d = model.spec.d_model
    mtp = model.num_parameters(mtp=True) - model.num_parameters()
    assert model.num_parameters() == 671_026_404_352
    assert mtp == sum(p.numel() for p in model.layers[60].parameters()) + 2 * d * d + 3 * d == 11_610_067_968
