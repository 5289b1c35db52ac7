"""DeepSeek Sparse Attention: the lightning indexer against transformers' DeepseekV32Indexer, and
the selection compared tie-aware (ReLU scores tie exactly at 0, and which of the tied keys at the
cut a top-k returns depends on the implementation and the sequence length)."""

import contextlib
import copy

import pytest
import torch

import zoo
from zoo.components.mixers.dsa import IndexKeys, LightningIndexer, Selections
from zoo.core.context import ForwardContext
from zoo.core.spec import ModelSpec, SpecError
from zoo.testing import one_of_each

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402

D_MODEL, Q_RANK, H, HD, ROPE = 24, 16, 2, 12, 4


def hf_config(topk, **kw):
    cfg = dict(vocab_size=64, hidden_size=D_MODEL, q_lora_rank=Q_RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=4,
               v_head_dim=4, kv_lora_rank=8, num_attention_heads=2, num_key_value_heads=2, index_n_heads=H,
               index_head_dim=HD, index_topk=topk, num_hidden_layers=1, intermediate_size=32,
               moe_intermediate_size=8, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    cfg.update(kw)
    return transformers.DeepseekV32Config(**cfg)


@contextlib.contextmanager
def captured_topk_input():
    """Record the tensor transformers' indexer takes its top-k of: its index scores after masking."""
    seen, topk = [], torch.Tensor.topk

    def spy(self, *a, **kw):
        seen.append(self.detach().clone())
        return topk(self, *a, **kw)

    torch.Tensor.topk = spy
    try:
        yield seen
    finally:
        torch.Tensor.topk = topk


def selection_mask(idx, T):
    return torch.zeros(*idx.shape[:-1], T, dtype=torch.bool).scatter_(-1, idx.long(), True)


def assert_same_selection(a, b, scores, k, allowed, atol=1e-5):
    """``a`` and ``b`` (B, Tq, Tk) each select ``min(k, visible)`` allowed keys per query; a key
    scoring clearly above the k-th visible score is in both, one clearly below in neither; keys
    within ``atol`` of the k-th score are ties and may go either way. Returns the number of rows
    whose cut fell in a tie."""
    s = scores.masked_fill(~allowed, float("-inf"))
    kth = s.topk(min(k, s.shape[-1]), dim=-1).values[..., -1:]
    a, b = a & allowed, b & allowed
    n = allowed.sum(-1).clamp(max=k)
    assert torch.equal(a.sum(-1), n) and torch.equal(b.sum(-1), n)
    above, near = s > kth + atol, (s - kth).abs() <= atol
    assert torch.equal(a & above, above) and torch.equal(b & above, above), "a key above the cut is missing"
    assert not ((a | b) & ~above & ~near).any(), "a key below the cut was selected"
    return int(((near & allowed).sum(-1) > 1).logical_and(allowed.sum(-1) > k).sum())


def hf_rope(config, T):
    rotary = hf_v32.DeepseekV32RotaryEmbedding(config)
    x = torch.zeros(1, T, D_MODEL)
    return rotary(x, torch.arange(T)[None])


def indexers(topk, seed=0, **kw):
    torch.manual_seed(seed)
    config = hf_config(topk, **kw)
    ref = hf_v32.DeepseekV32Indexer(config, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    ours = LightningIndexer(d_model=D_MODEL, q_dim=Q_RANK, n_heads=H, head_dim=HD, rope_dim=ROPE, topk=topk)
    ours.load_state_dict(ref.state_dict())
    return config, ref, ours


@pytest.mark.parametrize("rope", [{}, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 8, "mscale": 1.0,
                                                           "mscale_all_dim": 0.5}}])
@pytest.mark.parametrize("T,topk", [(9, 4), (16, 5), (16, 16)])
def test_indexer_scores_and_selection_match_transformers(T, topk, rope):
    config, ref, ours = indexers(topk, **rope)
    B = 2
    x, q_lat = torch.randn(B, T, D_MODEL), torch.randn(B, T, Q_RANK)
    cos, sin = hf_rope(config, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal[None].expand(B, T, T).clone()
    mask[1, :, :2] = False  # left padding in the second row
    mask[1, :2, :2] = True
    with captured_topk_input() as seen, torch.no_grad():
        idx = ref(x, q_lat, (cos, sin), mask, None)
    hf_scores = seen[0]
    half = ROPE // 2
    cos_p, sin_p = cos[..., :half].expand(B, T, half), sin[..., :half].expand(B, T, half)
    with torch.no_grad():
        keys = ours.keys(x, cos_p, sin_p)
        scores = ours.scores(x, q_lat, keys, cos_p, sin_p)
    torch.testing.assert_close(scores.masked_fill(~mask, float("-inf")), hf_scores, atol=1e-5, rtol=1e-5)
    assert (scores[mask] == 0).any(), "no exact zero among the scores: the ties this test is about are not reached"
    ours_sel = ours.select(scores, mask)
    ref_sel = selection_mask(idx, T) & mask
    assert_same_selection(ours_sel, ref_sel, scores, topk, mask)


def test_ties_at_the_cut_are_reached_and_accepted():
    """With many exact zeros the cut falls in a tie; our selection and transformers' may then pick
    different keys of the tie, and the comparison accepts exactly that (and nothing else)."""
    T, topk = 24, 6
    config, ref, ours = indexers(topk, seed=3)
    with torch.no_grad():
        ref.weights_proj.weight.abs_()  # positive head weights: a score is 0 exactly when every head's ReLU is
        ours.weights_proj.weight.abs_()
    x, q_lat = torch.randn(1, T, D_MODEL), torch.randn(1, T, Q_RANK)
    cos, sin = hf_rope(config, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    with captured_topk_input(), torch.no_grad():
        idx = ref(x, q_lat, (cos, sin), mask, None)
        cos_p, sin_p = cos[..., : ROPE // 2], sin[..., : ROPE // 2]
        scores = ours.scores(x, q_lat, ours.keys(x, cos_p, sin_p), cos_p, sin_p)
    tied_rows = assert_same_selection(ours.select(scores, mask), selection_mask(idx, T) & mask, scores, topk, mask)
    assert tied_rows > 0, "no row has a tie at the cut; pick a seed that reaches one"


def test_selection_takes_every_visible_key_when_topk_covers_them():
    _, _, ours = indexers(8)
    scores = torch.randn(1, 6, 6)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    assert torch.equal(ours.select(scores, allowed), allowed)


def test_index_keys_state_grows_and_goes_static():
    state = IndexKeys()
    k = torch.randn(2, 5, HD)
    assert torch.equal(state.update(k[:, :3], torch.arange(3)), k[:, :3])
    assert torch.equal(state.update(k[:, 3:4], torch.tensor([3])), k[:, :4])
    static = state.to_static(6)
    out = static.update(k[:, 4:5], torch.tensor([4]))
    assert out.shape == (2, 6, HD) and torch.equal(out[:, :5], k)
    assert static.nbytes() == 2 * 6 * HD * 4


@pytest.mark.parametrize("topk", [0, -3])
def test_nonpositive_topk_is_refused_by_name(topk):
    with pytest.raises(SpecError, match="index_topk"):
        LightningIndexer(d_model=D_MODEL, q_dim=Q_RANK, n_heads=H, head_dim=HD, rope_dim=ROPE, topk=topk)


# ------------------------------------------------------------------------- the mixer: MLA + selection
import zoo.testing as zt  # noqa: E402
from zoo.core.context import ForwardContext  # noqa: E402
from zoo.core.kinds import PositionState
from zoo.core.state import DecodeState  # noqa: E402

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

MIXER = {"name": "dsa", "n_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": ROPE,
         "v_head_dim": 4, "q_lora_rank": Q_RANK, "index_n_heads": 6, "index_head_dim": HD}
YARN = ({"name": "rope", "theta": 10000.0, "layout": "pairs_to_half",
         "scaling": {"name": "yarn", "factor": 4.0, "original_max_seq_len": 8, "mscale": 1.0, "mscale_all_dim": 0.5,
                     "beta_fast": 32.0, "beta_slow": 1.0}},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
         "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0})
PLAIN = ({"name": "rope", "theta": 10000.0, "layout": "pairs_to_half"}, {"rope_type": "default", "rope_theta": 10000.0})
HF_NAMES = {"q_a_layernorm": "q_a_norm", "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm"}


def mixer_pair(topk, rope, seed=0):
    """transformers' DeepseekV32Attention (eager: its dense scores with the selection as a mask) and
    zoo's dsa mixer with the same random weights."""
    torch.manual_seed(seed)
    config = hf_config(topk, rope_parameters=rope[1], index_n_heads=MIXER["index_n_heads"])
    config._attn_implementation = "eager"
    ref = hf_v32.DeepseekV32Attention(config, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.4)
    spec = zt.tiny_spec({"d_model": D_MODEL, "layers.default.mixer": {**MIXER, "index_topk": topk}, "position": rope[0]})
    ours = spec.layer(0).mixer.build(d_model=D_MODEL, layer=spec.layer(0), spec=spec, index=0).eval()
    state = {".".join(HF_NAMES.get(p, p) for p in k.split(".")): v for k, v in ref.state_dict().items()}
    ours.load_state_dict(state)
    return config, ref, spec, ours


def zoo_inputs(spec, T, key_mask=None):
    pos_module = spec.position_for(0).build(spec=spec, layer=spec.layer(0))
    position_ids = torch.arange(T).expand(2, T) if key_mask is None else (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    return ForwardContext(position_ids, torch.arange(T), key_mask), PositionState(pos_module, pos_module.prepare(position_ids, torch.float32))


def no_tie_at_the_cut(mixer, x, ctx, pos, topk):
    """The k-th and (k+1)-th index scores differ in every row with more than k visible keys (so the
    selection is one set whatever the tie rule)."""
    cos, sin = (t[:, 0] for t in pos.pairs())
    with torch.no_grad():
        q_latent = mixer.q_a_norm(mixer.q_a_proj(x))
        s = mixer.indexer.scores(x, q_latent, mixer.indexer.keys(x, cos, sin), cos, sin)
    T = x.shape[1]
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    if ctx.key_mask is not None:
        visible = visible & ctx.key_mask[:, None, :]
    top = s.masked_fill(~visible, float("-inf")).sort(-1, descending=True).values
    rows = visible.expand_as(s).sum(-1) > topk
    return bool((top[..., topk - 1] != top[..., topk])[rows].all())


@pytest.mark.parametrize("rope", [PLAIN, YARN], ids=["rope", "yarn"])
def test_sparse_attention_equals_transformers_dense_masked_attention(rope):
    """index_topk < T: zoo attends to the selected keys; transformers computes every score and masks
    the unselected ones. Same output, with left padding in one row."""
    T, topk = 14, 5
    config, ref, spec, ours = mixer_pair(topk, rope)
    x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(1))
    key_mask = torch.ones(2, T, dtype=torch.bool)
    key_mask[1, :3] = False
    ctx, pos = zoo_inputs(spec, T, key_mask)
    assert no_tie_at_the_cut(ours, x, ctx, pos, topk), "a tie at the cut: choose another seed"
    cos, sin = hf_v32.DeepseekV32RotaryEmbedding(config)(x, ctx.position_ids)
    mask = (torch.ones(T, T, dtype=torch.bool).tril()[None] & key_mask[:, None, :])[:, None]
    mask = mask | ~mask.any(-1, keepdim=True)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # eager adds its mask
    with torch.no_grad():
        want, _ = ref(x, (cos, sin), additive)
        got = ours(x, ctx, pos)
    torch.testing.assert_close(got[key_mask], want[key_mask], atol=1e-5, rtol=1e-5)


def test_decoding_keeps_the_indexer_keys_and_selects_as_the_full_forward(monkeypatch):
    """Whenever a query has more than index_topk keys, its top-k latents are gathered and attended
    alone: in the full forward, a prefill, several tokens and single tokens, all equal."""
    T, topk = 12, 4
    _, _, spec, ours = mixer_pair(topk, PLAIN)
    gathered, attend_selected = [], type(ours).attend_selected
    monkeypatch.setattr(type(ours), "attend_selected", lambda self, *a: gathered.append(a[-2].shape) or attend_selected(self, *a))
    x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(2))
    ctx, pos = zoo_inputs(spec, T)
    with torch.no_grad():
        full = ours(x, ctx, pos)
        state = DecodeState([ours.new_state(2, T)])
        steps = []
        for a, b in [(0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 12)]:
            c = ForwardContext(ctx.position_ids[:, a:b], torch.arange(a, b), None, state)
            p = PositionState(pos.module, pos.module.prepare(ctx.position_ids[:, a:b], torch.float32))
            steps.append(ours(x[:, a:b], c, p))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert gathered == [(2, T, topk), (2, 5, topk), (2, 1, topk), (2, 3, topk)] + [(2, 1, topk)] * 3
    layer = state.layers[0]
    assert layer.keys.k.shape == (2, T, HD)  # one index_head_dim key per token, beside MLA's latent
    assert state.nbytes() == 2 * T * (8 + ROPE + HD) * 4


def test_the_adaptation_example_runs_in_miniature():
    """examples/dsa_adaptation.py end to end on its miniature setting: dense MLA, indexer warm-up
    with the model frozen, sparse training; every stage reports a finite loss, the DSA stages the
    indexer's KL, and the frozen warm-up leaves the dense model's loss as it was."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "dsa_adaptation.py"
    module = importlib.util.spec_from_file_location("dsa_adaptation", path)
    example = importlib.util.module_from_spec(module)
    module.loader.exec_module(example)
    rows = example.main(["--tiny"])
    assert [r[0].split()[0] for r in rows] == ["1.", "+", "2.", "then", "3."]
    assert all(torch.isfinite(torch.tensor(r[1])) for r in rows)
    assert rows[0][2] is None and all(r[2] is not None and r[2] >= 0 for r in rows[1:])
    assert abs(rows[2][1] - rows[0][1]) < 1e-5  # top-k covers the sequence and only the indexer moved


def _shared_spec(pattern):
    """DeepSeek-V3.2's tiny dense layers, with a second layer kind whose indexer is shared, in ``pattern``."""
    data = one_of_each("deepseek-v3.2-exp", vocab_size=256).to_dict()
    data["layers"].pop("moe", None)
    kind = next(iter(data["layers"]))
    data["layers"]["shared"] = copy.deepcopy(data["layers"][kind])
    data["layers"]["shared"]["mixer"]["indexer"] = "shared"
    data.update(n_layers=len(pattern), layer_pattern=[kind if p == "F" else "shared" for p in pattern], mtp=None)
    return data


def test_a_shared_indexer_finds_its_source_layer_by_index_resolved_when_the_spec_is_checked():
    spec = ModelSpec.from_dict(_shared_spec("FSSFS"))
    assert spec.sources == (None, 0, 0, None, 3)  # through the chain of shared layers to the full one
    model = zoo.build_model(spec)
    assert [m.mixer.source for m in model.layers] == list(spec.sources)
    assert [m.mixer.shares for m in model.layers] == [True, False, False, True, False]
    with pytest.raises(SpecError, match=r"layers\.shared\.mixer\.indexer.*'shared' at layer 0"):
        ModelSpec.from_dict(_shared_spec("SF"))


def test_the_selection_a_shared_layer_reads_is_the_one_its_source_left_in_the_forward_context():
    spec = ModelSpec.from_dict(_shared_spec("FS"))
    model = zoo.build_model(spec, seed=0).eval()
    seen = []
    full = model.layers[0].mixer
    plain = full.indexer.top
    full.indexer.top = lambda scores, allowed: seen.append(plain(scores, allowed)) or seen[-1]
    model(torch.randint(0, 256, (1, 12)))
    assert len(seen) == 1  # one selection, made by layer 0 and read by layer 1
    ctx = ForwardContext(torch.zeros(1, 3, dtype=torch.long), torch.arange(3))
    with pytest.raises(RuntimeError, match="DSA layer 1 shares layer 0's top-k selection, which this forward has not made"):
        model.layers[1].mixer(torch.zeros(1, 3, spec.d_model), ctx, None)
    ctx.slot(Selections).by_layer[0] = None  # every visible key selected
    assert model.layers[1].mixer(torch.zeros(1, 3, spec.d_model), ctx, None).shape == (1, 3, spec.d_model)
