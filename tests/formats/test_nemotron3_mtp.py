"""Nemotron 3's multi-token prediction module (``nemotron_h`` with ``num_nextn_predict_layers = 1``): a
tiny checkpoint written by transformers (which builds no MTP and ignores ``mtp.*`` on loading), with an
MTP module of its ``mtp_layers_block_type`` layers (attention, then a latent MoE) added under vLLM's
names. zoo loads and saves it tensor for tensor, its main model still equals transformers', the module
computes the equations written out below, and self-speculative decoding gives plain greedy's tokens
through the Mamba-2 layers' rolled-back states. Bad MTP fields are refused by name."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints import ConfigError, config_to_spec
from zoo.core.context import ForwardContext
from zoo.core.spec import SpecError
from zoo.core.state import step_layout
from zoo.inference.speculative import SpeculationStats

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

SSD_ATOL = 1e-4  # tests/formats/test_nemotron_h.py: transformers' and zoo's chunked scans sum in other orders
MOE = {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "moe", "linear_attention"],
       "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 20,
       "moe_shared_expert_intermediate_size": 28, "moe_latent_size": 24, "n_group": 2, "topk_group": 1,
       "routed_scaling_factor": 1.5}
ATTN, EXPERTS = 2, 1  # main layers of the two kinds the MTP module repeats (their tensors give its shapes)


def ids_of(B, T, seed=0):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def mtp_tensors(main: dict, gen: torch.Generator) -> dict:
    """Random MTP tensors under vLLM's nemotron_h_mtp names: layer 0 the fusion and an attention layer,
    layer 1 a MoE layer and the head's norm; norms near 1, a random selection bias."""
    d = main["backbone.embeddings.weight"].shape[1]
    out = {}
    for j, src in ((0, ATTN), (1, EXPERTS)):
        for name, t in main.items():
            if name.startswith(f"backbone.layers.{src}."):
                out[name.replace(f"backbone.layers.{src}.", f"mtp.layers.{j}.")] = t
    out.update({"mtp.layers.0.enorm.weight": torch.ones(d), "mtp.layers.0.hnorm.weight": torch.ones(d),
                "mtp.layers.0.eh_proj.weight": torch.zeros(d, 2 * d), "mtp.layers.1.final_layernorm.weight": torch.ones(d)})
    for name, t in out.items():
        scale = 0.3 if name.endswith("e_score_correction_bias") else 0.1
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = base + scale * torch.randn(t.shape, generator=gen)
    return out


@pytest.fixture(scope="module")
def checkpoint(hf_pair, tmp_path_factory):
    """(transformers' model, the directory with MTP, every stored tensor)."""
    hf, _, path = hf_pair("nemotron_h", std=0.1, **MOE)
    d = tmp_path_factory.mktemp("nemotron3_mtp")
    for f in path.iterdir():
        shutil.copy(f, d / f.name)
    tensors = load_file(d / "model.safetensors")
    tensors.update(mtp_tensors(tensors, torch.Generator().manual_seed(7)))
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"])  # a legacy name, remapped
    (d / "config.json").write_text(json.dumps(cfg))
    return hf, d, tensors


@pytest.fixture(scope="module")
def model(checkpoint):
    return zoo.from_pretrained(checkpoint[1]).eval()


def test_the_module_is_read_from_its_block_types(model):
    assert model.spec.mtp.depth == 1 and model.spec.mtp.layer == ("attention", "moe")
    attn, moe = model.mtp.layers[0].block
    assert attn.mixer.q_proj.weight.shape == model.layers[ATTN].mixer.q_proj.weight.shape
    assert moe.ffn.latent_down.weight.shape == (24, 32) and moe.ffn.router.bias.abs().sum() > 0
    extra = sum(p.numel() for i in (ATTN, EXPERTS) for p in model.layers[i].parameters()) + 2 * 32 * 32 + 3 * 32
    assert model.num_parameters(mtp=True) - model.num_parameters() == extra


@torch.no_grad()
def test_load_then_save_gives_back_every_tensor(checkpoint, model, tmp_path):
    _, _, tensors = checkpoint
    zoo.save_pretrained(model, tmp_path)
    back = load_file(tmp_path / "model.safetensors")
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_nextn_predict_layers"], cfg["mtp_layers_block_type"]) == (1, ["full_attention", "moe"])
    again = zoo.from_pretrained(tmp_path)
    assert again.spec == model.spec


@torch.no_grad()
def test_the_main_model_still_equals_transformers_which_ignores_the_module(checkpoint, model):
    _, path, _ = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert not any(n.startswith("mtp.") for n in hf.state_dict())
    ids = ids_of(2, 13)
    ref = hf(ids).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model(ids), ref, atol=SSD_ATOL, rtol=0)


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp_logits(t: dict, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """vLLM's nemotron_h_mtp equations, in float64 from the stored tensors: fuse the next token's embedding
    with the main model's final hidden state, an attention layer (causal GQA, no positions), a latent MoE
    layer (top 3 of sigmoid scores plus the selection bias within the best of 2 groups, weights the
    plain scores renormalised times 1.5; squared-ReLU experts on the 24-wide latent; a shared expert
    on the whole token), the head's norm and the main model's head."""
    t = {k: v.double() for k, v in t.items()}
    L = lambda n: t[f"mtp.layers.{n}"]  # noqa: E731
    e = t["backbone.embeddings.weight"][nxt]
    x = torch.cat([rms(e, L("0.enorm.weight")), rms(h.double(), L("0.hnorm.weight"))], -1) @ L("0.eh_proj.weight").T
    # attention: 4 query heads of 12, 2 key-value heads
    a = rms(x, L("0.norm.weight"))
    B, T, _ = a.shape
    q = (a @ L("0.mixer.q_proj.weight").T).view(B, T, 4, 12).transpose(1, 2)
    k = (a @ L("0.mixer.k_proj.weight").T).view(B, T, 2, 12).transpose(1, 2).repeat_interleave(2, 1)
    v = (a @ L("0.mixer.v_proj.weight").T).view(B, T, 2, 12).transpose(1, 2).repeat_interleave(2, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(12)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 48)
    x = x + y @ L("0.mixer.o_proj.weight").T
    # latent MoE
    u = rms(x, L("1.norm.weight")).reshape(B * T, -1)
    scores = torch.sigmoid(u @ L("1.mixer.gate.weight").T)
    choice = scores + L("1.mixer.gate.e_score_correction_bias")
    groups = choice.view(-1, 2, 4).topk(2, -1).values.sum(-1)  # each group's best two
    best = groups.argmax(-1)
    allowed = torch.zeros_like(choice, dtype=torch.bool).view(-1, 2, 4)
    allowed[torch.arange(len(best)), best] = True
    top = choice.masked_fill(~allowed.view(-1, 8), float("-inf")).topk(3, -1).indices
    w = scores.gather(-1, top)
    w = w / w.sum(-1, keepdim=True) * 1.5
    lat = u @ L("1.mixer.fc1_latent_proj.weight").T
    routed = torch.zeros_like(lat)
    for r in range(B * T):
        for j in range(3):
            n = int(top[r, j])
            hid = F.relu(lat[r] @ L(f"1.mixer.experts.{n}.up_proj.weight").T) ** 2
            routed[r] += w[r, j] * (hid @ L(f"1.mixer.experts.{n}.down_proj.weight").T)
    shared = (F.relu(u @ L("1.mixer.shared_experts.up_proj.weight").T) ** 2) @ L("1.mixer.shared_experts.down_proj.weight").T
    x = x + (routed @ L("1.mixer.fc2_latent_proj.weight").T + shared).view(B, T, -1)
    return rms(x, L("1.final_layernorm.weight")) @ t["lm_head.weight"].T


@torch.no_grad()
def test_the_module_computes_the_reference_equations(checkpoint, model):
    _, _, tensors = checkpoint
    ids = ids_of(2, 11, seed=2)
    T = ids.shape[1]
    h = model.hidden_states(ids)
    slots, _, pos = step_layout(2, T - 1, ids.device)
    got = model.mtp.logits(model, 0, model.mtp.run(model, 0, h[:, :-1], ids[:, 1:],
                                                   ForwardContext(position_ids=pos, slots=slots)))
    want = reference_mtp_logits(tensors, h[:, :-1], ids[:, 1:])
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_training_adds_the_modules_cross_entropy_of_the_reference(checkpoint, model):
    _, _, tensors = checkpoint
    ids = ids_of(2, 10, seed=8)
    out = model.loss(ids)
    with torch.no_grad():
        want = reference_mtp_logits(tensors, model.hidden_states(ids)[:, :-1], ids[:, 1:])[:, :-1]
    ce = F.cross_entropy(want.reshape(-1, 128), ids[:, 2:].reshape(-1))
    torch.testing.assert_close(out.aux["mtp_1"].double(), ce, atol=1e-5, rtol=1e-5)
    assert out.aux_weights["mtp_1"] == pytest.approx(0.3)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.mtp.named_parameters()
               if "experts" not in n)  # (an expert no token chose gets no gradient)
    model.zero_grad(set_to_none=True)


@torch.no_grad()
def test_speculative_decoding_gives_the_tokens_of_plain_greedy(model):
    """The random module's drafts are mostly rejected: each rejection drops a token from the attention
    layers' keys and from the Mamba-2 layers' convolution windows and SSM states."""
    stats = SpeculationStats()
    for ids in (ids_of(1, 9, seed=3), ids_of(1, 1, seed=4), ids_of(1, 17, seed=5)):
        plain = zoo.generate(model, ids, 24)
        assert torch.equal(zoo.generate(model, ids, 24, speculative="mtp", stats=stats), plain)
    assert stats.drafted == stats.steps > 0 and stats.accepted < stats.drafted


def test_speculative_decoding_of_a_trained_module_accepts_its_drafts_and_keeps_the_tokens():
    """The same hybrid with a module trained on a few periodic sequences drafts well: accepted drafts
    feed the Mamba-2 layers two tokens at a time, and the tokens stay plain greedy's."""
    torch.manual_seed(0)
    trained = zoo.build(config_to_spec(config()), seed=0).train()
    opt = torch.optim.Adam(trained.parameters(), lr=1e-2)
    base = torch.tensor([3, 17, 5, 42, 9, 11, 30])
    for _ in range(25):
        ids = torch.stack([base[(torch.arange(24) + s) % 7] for s in torch.randint(0, 7, (8,))])
        opt.zero_grad()
        trained.loss(ids).loss.backward()
        opt.step()
    trained.eval()
    stats = SpeculationStats()
    with torch.no_grad():
        for ids in (torch.tensor([[3, 17, 5, 42, 9]]), torch.tensor([[1, 2, 3, 60, 61, 7, 8]])):
            assert torch.equal(zoo.generate(trained, ids, 30, speculative="mtp", stats=stats), zoo.generate(trained, ids, 30))
    assert stats.acceptance > 0.9


@torch.no_grad()
def test_a_mamba2_state_truncated_is_the_state_of_the_tokens_kept(model):
    """Two tokens onto a state, the second dropped: the Mamba-2 layers' states are those after the
    first alone."""
    ids = ids_of(1, 8, seed=6)
    one = model.new_state(1, 16)
    model(ids[:, :7], state=one)
    two = model.new_state(1, 16)
    model(ids[:, :6], state=two)
    model(ids[:, 6:8], state=two)
    two.truncate(7)
    for i in (0, 5):  # the Mamba-2 layers
        a, b = one.layers[i], two.layers[i]
        torch.testing.assert_close(b.conv, a.conv, atol=1e-6, rtol=0)
        torch.testing.assert_close(b.ssm, a.ssm, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot drop slot 6"):
        two.truncate(6)  # the undo was spent
    long = model.new_state(1, 16)
    model(ids_of(1, 9), state=long)  # a prefill longer than Mamba2State.KEEP keeps nothing to undo
    with pytest.raises(ValueError, match="cannot drop slot 8 .* 2 to 8 tokens"):
        long.truncate(8)


def test_a_checkpoint_without_the_module_loads_the_main_model(checkpoint, tmp_path):
    """As transformers writes it: config.json counts one module, the files hold none of its tensors."""
    _, path, tensors = checkpoint
    shutil.copytree(path, tmp_path / "m")
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, tmp_path / "m" / "model.safetensors",
              metadata={"format": "pt"})
    assert zoo.from_pretrained(tmp_path / "m").mtp is None


def test_the_released_nano_has_no_module_so_its_count_is_the_main_models():
    model = zoo.build("nemotron-3-nano-30b-a3b", device="meta")
    assert model.spec.mtp is None and model.num_parameters(mtp=True) == model.num_parameters()


def config(**over):
    return {**tiny.tiny_config("nemotron_h"), **MOE, "model_type": "nemotron_h", "num_nextn_predict_layers": 1, **over}


@pytest.mark.parametrize("over, field", [
    ({"mtp_layers_block_type": ["full_attention", "sliding_attention"]}, "mtp_layers_block_type"),
    ({"mtp_layers_block_type": []}, "mtp_layers_block_type"),
    ({"mtp_layers_block_type": [{"type": "moe"}]}, "mtp_layers_block_type"),
    ({"mtp_layers_block_type": "*E"}, "mtp_layers_block_type"),
    ({"mtp_hybrid_override_pattern": "*X"}, "mtp_hybrid_override_pattern"),
    ({"layers_block_type": ["linear_attention", "full_attention", "mlp"]}, "mtp_layers_block_type"),  # no moe layer
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
])
def test_bad_mtp_fields_are_refused_naming_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        config_to_spec(config(**over))


@pytest.mark.parametrize("layer, path", [(["attention", "dense"], "mtp.layer[1]"), ([], "mtp.layer")])
def test_a_bad_list_of_mtp_layer_kinds_names_the_entry(layer, path):
    spec = config_to_spec(config()).to_dict()
    spec["mtp"]["layer"] = layer
    with pytest.raises(SpecError) as err:
        zoo.ModelSpec.from_dict(spec)
    assert err.value.path == path


def test_the_legacy_pattern_is_read_where_the_list_is_the_default():
    assert config_to_spec(config(mtp_hybrid_override_pattern="E*")).mtp.layer == ("moe", "attention")
    assert config_to_spec(config(mtp_hybrid_override_pattern="E*", mtp_layers_block_type=["moe"])).mtp.layer == ("moe",)
    assert config_to_spec(config()).mtp.layer == ("attention", "moe")  # NemotronHConfig's default
    assert config_to_spec(config(num_nextn_predict_layers=0, mtp_layers_block_type=["nonsense"])).mtp is None
