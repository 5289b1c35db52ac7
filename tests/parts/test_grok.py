"""Grok-1 (``zoo/families/grok.toml``): no transformers implementation exists, so the recipe is checked
against the released JAX code (github.com/xai-org/grok-1, run.py and model.py): its sizes and
parameter count, and a tiny model's forward against an independent reference of the same
equations written here in plain torch (no zoo part is called)."""

import math

import pytest
import torch
import torch.nn.functional as F

import zoo
import zoo.testing as zt
from hf_pairs import assert_within_reference_error
from zoo.tools.accounting import account

pytestmark = pytest.mark.usefixtures("one_thread")

# run.py's LanguageModelConfig / TransformerConfig for Grok-1.
RELEASED = dict(vocab_size=128 * 1024, sequence_len=8192, emb_size=48 * 128, widening_factor=8, key_size=128,
                num_q_heads=48, num_kv_heads=8, num_layers=64, num_experts=8, num_selected_experts=2,
                embedding_multiplier_scale=78.38367176906169, output_multiplier_scale=0.5773502691896257,
                attn_output_multiplier=0.08838834764831845)


def ffn_size(emb_size, widening_factor):
    """model.py's expert width: two thirds of the widened size, rounded up to a multiple of 8."""
    size = int(widening_factor * emb_size) * 2 // 3
    return size + (8 - size) % 8


def released_count():
    """The parameters model.py creates (the tensors of the released checkpoint): per layer q, k, v
    and the output projection (no biases), four RMSNorm scales, the router and the experts' three
    matrices; the embedding (shared with the output) and the final RMSNorm."""
    r = RELEASED
    d, hd, f = r["emb_size"], r["key_size"], ffn_size(r["emb_size"], r["widening_factor"])
    attention = d * r["num_q_heads"] * hd * 2 + d * r["num_kv_heads"] * hd * 2
    layer = attention + 4 * d + d * r["num_experts"] + r["num_experts"] * 3 * d * f
    return r["num_layers"] * layer + r["vocab_size"] * d + d


def test_the_preset_has_the_released_sizes_and_count():
    spec = zoo.get_spec("grok-1")
    layer, r = spec.layer(0), RELEASED
    assert (spec.vocab_size, spec.d_model, spec.n_layers, spec.max_seq_len) == (
        r["vocab_size"], r["emb_size"], r["num_layers"], r["sequence_len"])
    att, moe = layer.mixer, layer.ffn
    assert (att.n_heads, att.n_kv_heads, att.head_dim, att.softcap) == (48, 8, 128, 30.0)
    assert att.head_dim ** -0.5 == pytest.approx(r["attn_output_multiplier"], rel=1e-15)  # the score scale
    assert (moe.n_experts, moe.top_k, moe.d_ff) == (8, 2, ffn_size(6144, 8)) == (8, 2, 32768)
    assert moe.router.name == "softmax_topk" and not moe.norm_topk_prob
    assert spec.embedding.scale == r["embedding_multiplier_scale"] == pytest.approx(math.sqrt(6144), rel=1e-15)
    assert spec.head.scale == r["output_multiplier_scale"] == pytest.approx(3 ** -0.5, rel=1e-15)
    assert spec.head.tied and layer.block.norm_position == "sandwich"
    model = zoo.build("grok-1", device="meta")
    assert model.num_parameters() == released_count() == 315_684_820_992 == zoo.published_params("grok-1")
    assert zoo.get_spec("xai-org/grok-1") == spec


def test_active_parameters_under_the_three_conventions():
    """Two of eight experts per token; the tied embedding matrix is the input embedding and the head."""
    a = account("grok-1")
    c = a["params"]["active_conventions"]
    d, f, L, V = 6144, 32768, 64, 131072
    idle = L * 6 * 3 * d * f
    assert a["params"]["total"] - a["params"]["active"] == idle
    assert c["with_embeddings_and_head"] == 315_684_820_992 - idle == 83_756_587_008
    assert c["without_input_embedding"] == c["with_embeddings_and_head"]  # tied: the one matrix is the head
    assert c["without_embeddings_and_head"] == c["with_embeddings_and_head"] - V * d == 82_951_280_640


# ------------------------------------------------------------------------------- the equations

TINY = {"vocab_size": 128, "d_model": 64, "n_layers": 2, "max_seq_len": 64,
        "embedding.scale": 8.0,  # sqrt(d_model), as 78.38 is sqrt(6144)
        "layers.default.mixer.n_heads": 4, "layers.default.mixer.n_kv_heads": 2, "layers.default.mixer.head_dim": 16,
        "layers.default.mixer.softcap": 1.0,  # reached by the tiny model's scores (30 is not, at this size)
        "layers.default.ffn.n_experts": 4, "layers.default.ffn.d_ff": 48}


@pytest.fixture(scope="module")
def tiny():
    model = zoo.build("grok-1", overrides=TINY, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm scales and every matrix away from their initial values
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.08))
    return model


def rms(x, w, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, base=10000.0):
    """model.py's RotaryEmbedding: rotate_half pairs (i, i + D/2), inv_freq = base^(-2j/D)."""
    D = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    phase = pos[:, None].double() * inv[None]
    phase = torch.cat([phase, phase], -1).to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * phase.cos() + torch.cat([-x2, x1], -1) * phase.sin()


def reference(model, ids, cap, emb_mult, out_mult, dtype=torch.float64):
    """Grok-1's forward (model.py) for one unpadded batch, from the model's weights by name."""
    W = {k: v.to(dtype) for k, v in model.state_dict().items()}
    att, moe = model.spec.layer(0).mixer, model.spec.layer(0).ffn
    H, Hkv, D, E, k = att.n_heads, att.n_kv_heads, att.head_dim, moe.n_experts, moe.top_k
    B, T = ids.shape
    pos = torch.arange(T)
    h = W["embed.weight"][ids] * emb_mult
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    reached = 0.0
    for i in range(model.spec.n_layers):
        p = f"layers.{i}."
        x = rms(h, W[p + "attn_norm.weight"])
        q = (x @ W[p + "mixer.q_proj.weight"].T).view(B, T, H, D)
        kk = (x @ W[p + "mixer.k_proj.weight"].T).view(B, T, Hkv, D)
        v = (x @ W[p + "mixer.v_proj.weight"].T).view(B, T, Hkv, D)
        q, kk = rotate(q.transpose(1, 2), pos), rotate(kk.transpose(1, 2), pos)
        kk, v = kk.repeat_interleave(H // Hkv, 1), v.transpose(1, 2).repeat_interleave(H // Hkv, 1)
        logits = q @ kk.transpose(-1, -2) * D ** -0.5
        reached = max(reached, logits.masked_fill(~causal, 0).abs().max().item())
        logits = cap * torch.tanh(logits / cap)
        probs = logits.masked_fill(~causal, -1e30).softmax(-1)
        o = (probs @ v).transpose(1, 2).reshape(B, T, H * D) @ W[p + "mixer.o_proj.weight"].T
        h = h + rms(o, W[p + "attn_out_norm.weight"])
        x = rms(h, W[p + "ffn_norm.weight"])
        router = (x @ W[p + "ffn.router.weight"].T).softmax(-1)
        gate, index = router.topk(k, -1)
        y = torch.zeros_like(x)
        for e in range(E):
            out = (F.gelu(x @ W[p + "ffn.experts.w_gate"][e].T, approximate="tanh") * (x @ W[p + "ffn.experts.w_up"][e].T)) \
                @ W[p + "ffn.experts.w_down"][e].T
            y = y + (gate * (index == e)).sum(-1, keepdim=True) * out
        h = h + rms(y, W[p + "ffn_out_norm.weight"])
    h = rms(h, W["final_norm.weight"])
    return (h @ W["embed.weight"].T) * out_mult, reached


def test_the_forward_is_grok_1s_equations(tiny):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    spec = tiny.spec
    args = (1.0, spec.embedding.scale, spec.head.scale)
    exact, reached = reference(tiny, ids, *args)
    assert reached > 1.5 * 1.0  # the soft-cap bends the scores (tanh(1.5) = 0.91)
    ref32, _ = reference(tiny, ids, *args, dtype=torch.float32)
    with torch.no_grad():
        got = tiny(ids)
    assert exact.abs().max() > 1.0
    assert_within_reference_error(got, ref32, exact)
    # Each twist is load-bearing: without it the forward is another function. (Renormalising the two
    # routing weights is not: it scales the MoE's output per token, which the norm after it undoes.)
    for changed in ({"layers.default.mixer.softcap": None}, {"head.scale": None}, {"embedding.scale": "none"},
                    {"layers.default.block.norm_position": "pre"}):
        other = zoo.build_model(spec.with_overrides(changed))
        other.load_state_dict(tiny.state_dict(), strict=False)
        with torch.no_grad():
            assert (other.eval()(ids) - got).abs().max() > 1e-2, changed


def test_decoding_continues_the_full_forward(tiny):
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    zt.check_decoding(tiny, ids, what="grok-1", atol=1e-5)


def test_a_logit_scale_must_be_positive():
    with pytest.raises(zoo.core.spec.SpecError, match="head.scale"):
        zoo.get_spec("grok-1", {"head.scale": 0.0})
