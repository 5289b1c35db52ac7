"""Conformance of every registered part: the kind contracts of zoo.testing (run on every part in
the registry, built-in or plugin), and the numeric properties the lecture notes give each
built-in part. A built-in part without a property test here fails ``test_every_builtin_part_is_covered``."""

import math

import pytest
import torch
import torch.nn.functional as F

import zoo
import zoo.testing as zt
from zoo.core.registry import BUILTIN_PLUGINS

# The configs each part's contract runs with (default config when a part is not listed).
CONFIGS = {
    ("norm", "layernorm"): [{}, {"bias": False}],
    ("norm", "rmsnorm"): [{}, {"unit_offset": True, "scale_in_fp32": True}],
    ("activation", "gelu"): [{}, {"approximate": "tanh"}],
    ("ffn", "mlp"): [{}, {"d_ff_rule": "8/3", "multiple_of": 16, "bias": False}],
    ("position", "rope"): [{}, {"layout": "interleaved"}, {"layout": "pairs_to_half", "rotary_fraction": 0.5}, {"rotary_fraction": 0.5},
                           {"theta": 500.0, "scaling": {"name": "linear", "factor": 2.0}}],
    ("rope_scaling", "linear"): [{"factor": 4.0}],
    ("rope_scaling", "ntk"): [{"factor": 4.0}],
    ("rope_scaling", "dynamic_ntk"): [{"factor": 4.0}],
    ("rope_scaling", "yarn"): [{"factor": 4.0, "original_max_seq_len": 32}],
    ("rope_scaling", "llama3"): [{"factor": 8.0, "original_max_seq_len": 64}],
    ("attention", "attention"): [
        {"n_heads": 4},
        {"n_heads": 4, "n_kv_heads": 1},
        {"n_heads": 4, "n_kv_heads": 2, "window": 4},
        {"n_heads": 4, "n_kv_heads": 2, "softcap": 5.0, "qk_norm": "head"},
        {"n_heads": 4, "n_kv_heads": 2, "qk_norm": "proj", "head_dim": 16, "scale_dim": 12.0, "bias": True, "out_bias": True},
    ],
    ("block", "serial"): [{"norm_position": p} for p in ("pre", "post", "sandwich", "output")],
    ("block", "parallel"): [{"shared_norm": True}, {"shared_norm": False}],
    ("stability", "softcap"): [{"cap": 5.0}],
    ("ffn", "moe"): [{}, {"top_k": 3, "norm_topk_prob": True, "routed_scaling": 2.0, "shared_d_ff": 16,
                          "shared_gate": True, "expert": "geglu"},
                     {"expert": {"name": "mlp", "bias": False}, "switch_loss": 0.01, "z_loss": 0.001}],
    ("mixer", "mla"): [
        {"n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6},
        {"n_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 8, "v_head_dim": 8,
         "q_lora_rank": 12, "decode": "plain", "bias": True},
    ],
    ("mixer", "dsa"): [
        {"n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
         "q_lora_rank": 12, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4},
        {"n_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 8, "v_head_dim": 8,
         "q_lora_rank": 12, "index_n_heads": 3, "index_head_dim": 8, "index_topk": 64, "decode": "plain"},
    ],
    ("router", "sigmoid_group"): [{"n_groups": 4, "topk_group": 2}],
    ("router", "greedy_group"): [{"n_groups": 4, "topk_group": 2}],
    ("mixer", "mamba2"): [{"n_heads": 4, "head_dim": 8, "state_size": 8, "chunk_size": 4},
                          {"n_heads": 4, "head_dim": 8, "state_size": 8, "n_groups": 2, "chunk_size": 3, "bias": True,
                           "conv_bias": False, "dt_limit_max": 0.2}],
    # A multimodal gemma3 checkpoint: its text model under text_config.
    ("checkpoint_format", "gemma3"): [{"text_config": zoo.get("checkpoint_format", "gemma3_text").tiny}],
}
# Kinds whose contract is itself the numeric check (families: published parameter counts;
# checkpoint formats: save and load give back the same logits, parity is tests/formats/test_parity.py;
# kernels: each against its reference path in tests/kernels/test_kernels.py).
CONTRACT_ONLY_KINDS = {"family", "checkpoint_format", "kernel"}

COVERED: set[tuple[str, str]] = set()


def covers(*parts):
    COVERED.update(parts)
    return lambda fn: fn


def _registered():
    m = zoo.manager()
    m.ensure_loaded()  # plugins may add kinds
    return [e for kind in list(m.registries) for e in m.registry(kind).entries()]


def _contract_cases():
    for e in _registered():
        for cfg in CONFIGS.get((e.kind, e.name), [None]):
            yield pytest.param(e.kind, e.name, cfg, id=f"{e.kind}-{e.name}-{cfg or 'default'}")


@pytest.mark.parametrize("kind,name,config", list(_contract_cases()))
def test_contract(kind, name, config):
    zt.check(kind, name, config)


def test_every_builtin_part_is_covered():
    builtin = {(e.kind, e.name) for e in _registered() if e.provider in BUILTIN_PLUGINS}
    assert ("norm", "rmsnorm") in builtin and len(builtin) > 20  # the registry really was read
    missing = sorted(p for p in builtin - COVERED if p[0] not in CONTRACT_ONLY_KINDS)
    assert not missing, f"built-in parts without a numeric property test: {missing}"
    kinds = {e.kind for e in _registered()}
    assert kinds <= set(zt.CONTRACTS), f"kinds without a conformance contract: {kinds - set(zt.CONTRACTS)}"


def test_the_contract_fails_a_part_whose_parameter_nothing_initialises():
    from dataclasses import dataclass

    from torch import nn

    class Uninitialised(zoo.core.kinds.FFN):  # a scale made with torch.empty, no reset_parameters
        @dataclass(frozen=True)
        class Config:
            pass

        def __init__(self, cfg, *, d_model):
            super().__init__()
            self.proj = nn.Linear(d_model, d_model)
            self.scale = nn.Parameter(torch.empty(d_model))

        def forward(self, x, ctx=None):
            return self.proj(x) * self.scale

    zoo.register("ffn", "test_uninitialised")(Uninitialised)
    ffns = zoo.manager().registry("ffn")
    try:
        with pytest.raises(AssertionError, match=r"parameter layers\.0\.ffn\.scale is not initialised"):
            zt.check("ffn", "test_uninitialised")
    finally:  # the suite's other tests see the registry as zoo ships it
        ffns.remove("test_uninitialised", ffns.entry("test_uninitialised").provider)
    assert not torch.are_deterministic_algorithms_enabled()  # the check leaves torch as it found it


def test_an_uncovered_kind_fails_the_contract_check():
    with pytest.raises(AssertionError, match="no conformance contract for kind 'widget'"):
        zt.check("widget", "anything")


@covers(*[("expert", n) for n in ("swiglu", "glu", "geglu", "reglu", "mlp")])
@pytest.mark.parametrize("name", ["swiglu", "glu", "geglu", "reglu", "mlp"])
def test_each_stacked_expert_is_the_dense_ffn_of_its_name(name):
    """Expert e of a stack computes what the dense FFN of the same kind and settings computes with
    expert e's matrices (and biases)."""
    cfg = {"bias": True}
    experts = zt.part("expert", name, cfg).build(n_experts=3, d_model=16, d_ff=8, dispatch="loop")
    dense = zt.part("ffn", name, {**cfg, "d_ff": 8}).build(d_model=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
        e = 1
        for zoo_name, dense_name in (("gate", "gate"), ("up", "up"), ("down", "down")):
            w = getattr(experts, f"w_{zoo_name}")
            if w is None:
                continue
            getattr(dense, dense_name).weight.copy_(w[e])
            getattr(dense, dense_name).bias.copy_(getattr(experts, f"b_{zoo_name}")[e])
        x = torch.randn(5, 16)
        got = experts(x, torch.tensor([0, 5, 0]))
    torch.testing.assert_close(got, dense(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------- norms

def _norm(name, dim=64, **cfg):
    return zt.part("norm", name, cfg).build(dim=dim)


@covers(("norm", "rmsnorm"))
@pytest.mark.parametrize("w", [1.0, 2.5, -0.5])
def test_rmsnorm_output_rms_is_weight(w):
    norm = _norm("rmsnorm", eps=1e-8)
    torch.nn.init.constant_(norm.weight, w)
    y = norm(torch.randn(8, 64) * 7 + 3)
    torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.full((8,), abs(w)), rtol=1e-5, atol=1e-5)


def test_rmsnorm_unit_offset_scales_by_one_plus_w_in_fp32():
    norm = _norm("rmsnorm", eps=1e-6, unit_offset=True, scale_in_fp32=True).to(torch.bfloat16)
    assert torch.all(norm.weight == 0)  # Gemma initialises w at 0: the scale starts at 1
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(4, 64) * 3).to(torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (h * (1.0 + norm.weight.float())).to(torch.bfloat16)  # one rounding, at the end
    assert torch.equal(norm(x), expected)
    rounded_early = (h.to(torch.bfloat16) * (1.0 + norm.weight))  # Llama's order rounds twice
    assert not torch.equal(rounded_early, expected)


@covers(("norm", "layernorm"))
def test_layernorm_zero_mean_unit_variance():
    norm = _norm("layernorm", eps=1e-8)
    y = norm(torch.randn(8, 64) * 5 + 2)
    torch.testing.assert_close(y.mean(-1), torch.zeros(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(8), atol=1e-4, rtol=0)
    with torch.no_grad():
        norm.weight.fill_(3.0), norm.bias.fill_(-1.0)
    y = norm(torch.randn(8, 64))
    torch.testing.assert_close(y.mean(-1), torch.full((8,), -1.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(y.std(-1, unbiased=False), torch.full((8,), 3.0), atol=1e-4, rtol=0)
    assert _norm("layernorm", bias=False).bias is None


# --------------------------------------------------------------------------------- activations

@covers(("activation", "relu"), ("activation", "relu2"), ("activation", "gelu"), ("activation", "silu"))
def test_activation_formulas():
    x = torch.linspace(-6, 6, 101)
    act = lambda name, **cfg: zt.part("activation", name, cfg).build()  # noqa: E731
    torch.testing.assert_close(act("relu")(x), torch.where(x > 0, x, torch.zeros_like(x)))
    torch.testing.assert_close(act("relu2")(x), torch.where(x > 0, x * x, torch.zeros_like(x)))
    torch.testing.assert_close(act("gelu")(x), x * 0.5 * (1 + torch.erf(x / math.sqrt(2))))
    tanh = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(act("gelu", approximate="tanh")(x), tanh)
    assert 0 < (act("gelu")(x) - tanh).abs().max() < 1e-2  # the approximation is close, not equal
    torch.testing.assert_close(act("silu")(x), x / (1 + torch.exp(-x)))


# ----------------------------------------------------------------------------------------- ffns

def _ffn(name, d_model=48, **cfg):
    return zt.part("ffn", name, cfg).build(d_model=d_model)


@covers(("ffn", "mlp"), ("ffn", "glu"), ("ffn", "swiglu"), ("ffn", "geglu"), ("ffn", "reglu"))
@pytest.mark.parametrize("name,act", [
    ("mlp", lambda x: F.gelu(x)), ("glu", F.silu), ("swiglu", F.silu), ("geglu", F.gelu), ("reglu", F.relu),
])
def test_ffn_formulas(name, act):
    ffn = _ffn(name)
    x = torch.randn(2, 5, 48)
    if name == "mlp":
        expected = ffn.down(act(ffn.up(x)))
        assert ffn.up.bias is not None  # the original MLP has biases
    else:
        expected = F.linear(act(F.linear(x, ffn.gate.weight)) * F.linear(x, ffn.up.weight), ffn.down.weight)
        assert ffn.up.bias is None and ffn.gate.bias is None  # GLUs default to no bias
    torch.testing.assert_close(ffn(x), expected)


@pytest.mark.parametrize("d_model,cfg,d_ff", [
    (48, {}, 4 * 48),  # mlp: 4x
    (96, {"d_ff_rule": "8/3"}, 256),  # 8/3 * 96
    (100, {"d_ff_rule": "8/3", "multiple_of": 64}, 320),  # 266.7 rounded up to a multiple of 64
    (4096, {"d_ff_rule": "8/3_scaled", "multiple_of": 256}, 11008),  # Llama-2-7B
    (4096, {"d_ff_rule": "8/3_scaled", "multiple_of": 1024, "ffn_dim_multiplier": 1.3}, 14336),  # Llama-3-8B
    (8192, {"d_ff_rule": "8/3_scaled", "multiple_of": 4096, "ffn_dim_multiplier": 1.3}, 28672),  # Llama-3-70B
    (64, {"d_ff": 100}, 100),  # given
])
def test_d_ff_rules(d_model, cfg, d_ff):
    name = "swiglu" if cfg.get("d_ff_rule") == "8/3_scaled" else "mlp"
    with torch.device("meta"):
        ffn = _ffn(name, d_model=d_model, **cfg)
    assert ffn.up.weight.shape == (d_ff, d_model)
    assert ffn.down.weight.shape == (d_model, d_ff)


def test_glu_defaults_to_eight_thirds():
    assert _ffn("swiglu", d_model=96).up.weight.shape == (256, 96)


# ------------------------------------------------------------------------------------ positions

def _pos(name, d_model=32, head_dim=16, **cfg):
    spec = zt.tiny_spec({"position": {"name": name, **cfg}, "d_model": d_model,
                         "layers.default.mixer.head_dim": head_dim})
    return spec.position.build(spec=spec, layer=spec.layer(0))


@covers(("position", "rope"))
@pytest.mark.parametrize("cfg", [{"layout": "half"}, {"layout": "interleaved"}, {"rotary_fraction": 0.5},
                                 {"layout": "interleaved", "rotary_dim": 4}])
def test_rope_scores_depend_only_on_relative_position(cfg):
    rope = _pos("rope", **cfg)
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    ref = zt.qk_scores(rope, q, k, 7, 3)
    for shift in (1, 10, 100):
        torch.testing.assert_close(zt.qk_scores(rope, q, k, 7 + shift, 3 + shift), ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(zt.qk_scores(rope, q, k, 7, 2), ref)  # but the distance matters
    qr, kr = rope.rotate(q, k, rope.prepare(torch.tensor([[5]]), torch.float32))
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    rd = rope.dim
    torch.testing.assert_close(qr[..., rd:], q[..., rd:], rtol=0, atol=0)  # partial: the rest untouched


@pytest.mark.parametrize("layout,partner", [("half", 8), ("interleaved", 1)])
def test_rope_pair_layouts(layout, partner):
    """The first dimension rotates with dimension 8 (half split) or 1 (interleaved pairs)."""
    rope = _pos("rope", layout=layout, theta=10000.0)
    q = torch.zeros(1, 1, 1, 16)
    q[..., 0] = 1.0
    m = 3
    qr, _ = rope.rotate(q, q, rope.prepare(torch.tensor([[m]]), torch.float32))
    expected = torch.zeros(16)
    expected[0], expected[partner] = math.cos(m), math.sin(m)  # frequency 1 for the first pair
    torch.testing.assert_close(qr.flatten(), expected, atol=1e-6, rtol=0)


@covers(("position", "sinusoidal"))
def test_sinusoidal_formula():
    pe = _pos("sinusoidal", d_model=32).embed(torch.arange(50)[None], torch.float32)[0]
    p = torch.arange(50).float()[:, None]
    i = torch.arange(16).float()[None, :]
    torch.testing.assert_close(pe[:, 0::2], torch.sin(p / 10000 ** (2 * i / 32)), atol=1e-5, rtol=0)
    torch.testing.assert_close(pe[:, 1::2], torch.cos(p / 10000 ** (2 * i / 32)), atol=1e-5, rtol=0)


@covers(("position", "learned"))
def test_learned_positions_are_rows_of_a_table():
    pos = _pos("learned")
    with torch.no_grad():
        pos.table.weight.normal_()
    ids = torch.tensor([[0, 5, 2]])
    torch.testing.assert_close(pos.embed(ids, torch.float32)[0], pos.table.weight[[0, 5, 2]])
    assert pos.table.weight.shape == (64, 32)  # max_seq_len x d_model


@covers(("position", "nope"))
def test_nope_one_layer_is_blind_to_order():
    """With no position encoding a single causal layer's last output is a function of the set of
    earlier tokens: permuting them changes nothing (RoPE, by contrast, sees the order)."""
    ids = torch.randint(0, 64, (1, 9))
    perm = torch.cat([torch.randperm(8), torch.tensor([8])])
    for name, blind in (("nope", True), ("rope", False)):
        model = zt.tiny_model({"position": {"name": name}, "n_layers": 1})
        with torch.no_grad():
            a, b = model(ids)[0, -1], model(ids[:, perm])[0, -1]
        assert torch.allclose(a, b, atol=1e-5) == blind, name


# --------------------------------------------------------------------------------- rope scaling

def _freqs(name, dim=32, theta=10000.0, seq_len=None, **cfg):
    return zt.part("rope_scaling", name, cfg).build(dim=dim, theta=theta).frequencies(seq_len)


def _base(dim=32, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)


@covers(("rope_scaling", "linear"))
def test_linear_scaling_divides_positions_by_factor():
    rope = _pos("rope", scaling={"name": "linear", "factor": 4.0})
    plain = _pos("rope")
    cos, sin = rope.prepare(torch.arange(0, 40, 4)[None], torch.float32)
    cos0, sin0 = plain.prepare(torch.arange(0, 10)[None], torch.float32)  # positions / 4
    torch.testing.assert_close((cos, sin), (cos0, sin0), atol=1e-5, rtol=0)


@covers(("rope_scaling", "llama3"))
def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    dim, theta, factor, orig = 128, 500000.0, 8.0, 8192
    inv, attn = _freqs("llama3", dim=dim, theta=theta, factor=factor, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_seq_len=orig)
    base = _base(dim, theta)
    wavelen = 2 * math.pi / base
    high, low = wavelen < orig / 4.0, wavelen > orig / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(inv[high], base[high])
    torch.testing.assert_close(inv[low], base[low] / factor)
    mid = ~high & ~low
    assert ((inv[mid] < base[mid]) & (inv[mid] > base[mid] / factor)).all()
    assert attn == 1.0


@covers(("rope_scaling", "ntk"))
def test_ntk_keeps_the_highest_and_divides_the_lowest_frequency():
    inv, _ = _freqs("ntk", factor=4.0)
    base = _base()
    torch.testing.assert_close(inv[0], base[0])
    torch.testing.assert_close(inv[-1], base[-1] / 4.0)
    assert (inv[1:] < base[1:]).all() and (inv[1:] > base[1:] / 4.0 - 1e-9).all()


@covers(("rope_scaling", "dynamic_ntk"))
def test_dynamic_ntk_scales_only_past_the_original_length():
    cfg = dict(factor=4.0, original_max_seq_len=1024)
    torch.testing.assert_close(_freqs("dynamic_ntk", seq_len=1024, **cfg)[0], _base())
    longer, longest = _freqs("dynamic_ntk", seq_len=2048, **cfg)[0], _freqs("dynamic_ntk", seq_len=8192, **cfg)[0]
    assert (longer[1:] < _base()[1:]).all() and (longest[1:] < longer[1:]).all()
    # At length L the base grows as NTK's with factor (f L / L0 - (f - 1)).
    torch.testing.assert_close(longer, _freqs("ntk", factor=4.0 * 2 - 3.0)[0])


@covers(("rope_scaling", "yarn"))
def test_yarn_keeps_fast_dims_interpolates_slow_ones_and_scales_attention():
    factor, orig, dim = 8.0, 4096, 64
    inv, attn = _freqs("yarn", dim=dim, factor=factor, original_max_seq_len=orig)
    base = _base(dim)
    rotations = orig * base / (2 * math.pi)  # turns each pair makes over the original context
    fast, slow = rotations > 32, rotations < 1  # beta_fast and beta_slow
    assert fast.any() and slow.any()
    torch.testing.assert_close(inv[fast], base[fast])
    torch.testing.assert_close(inv[slow], base[slow] / factor)
    assert attn == pytest.approx(0.1 * math.log(factor) + 1)
    rope = _pos("rope", scaling={"name": "yarn", "factor": factor, "original_max_seq_len": orig})
    cos, sin = rope.prepare(torch.zeros(1, 1, dtype=torch.long), torch.float32)
    torch.testing.assert_close(cos, torch.full_like(cos, attn))  # cos and sin carry the temperature


# ------------------------------------------------------------------------------------ attention

def _attention(**cfg):
    spec = zt.tiny_spec({"layers.default.mixer": {"name": "attention", **cfg}})
    layer = spec.layer(0)
    attn = layer.mixer.build(d_model=spec.d_model, layer=layer, spec=spec, index=0)
    return attn, spec


@covers(("mixer", "attention"))
@pytest.mark.parametrize("heads,kv,head_dim", [(4, 4, 8), (4, 2, 8), (4, 1, 8), (4, 2, 24)])
def test_mha_gqa_mqa_shapes(heads, kv, head_dim):
    attn, spec = _attention(n_heads=heads, n_kv_heads=kv, head_dim=head_dim)
    assert attn.q_proj.weight.shape == (heads * head_dim, 32)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (kv * head_dim, 32)
    assert attn.o_proj.weight.shape == (32, heads * head_dim)
    x, ctx, rot = zt.attention_inputs(spec)
    assert attn(x, ctx, rot).shape == x.shape


def test_head_dim_independent_of_d_model():
    """GPT-3 XL as printed: 24 heads of 128 with d_model 2048."""
    spec = zt.tiny_spec({"d_model": 2048, "layers.default.mixer": {"name": "attention", "n_heads": 24, "head_dim": 128}})
    with torch.device("meta"):
        attn = spec.layer(0).mixer.build(d_model=2048, layer=spec.layer(0), spec=spec, index=0)
    assert attn.q_proj.weight.shape == (24 * 128, 2048)


@pytest.mark.parametrize("cfg", [{"n_heads": 4, "n_kv_heads": 2}, {"n_heads": 4, "n_kv_heads": 1, "window": 3},
                                 {"n_heads": 4, "qk_norm": "head", "scale_dim": 5.0}])
def test_sdpa_equals_eager(cfg):
    attn, spec = _attention(**cfg)
    x, ctx, rot = zt.attention_inputs(spec, T=11)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :4] = False  # left padding in the second row
    ctx.key_mask = mask
    outs = {}
    for backend in ("sdpa", "eager"):
        attn.backend = backend
        outs[backend] = attn(x, ctx, rot)
    torch.testing.assert_close(outs["sdpa"], outs["eager"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_sliding_window_hides_what_lies_beyond(backend):
    window, t = 4, 9  # query 9 sees keys 6..9
    attn, spec = _attention(n_heads=4, n_kv_heads=2, window=window)
    attn.backend = backend
    x, ctx, rot = zt.attention_inputs(spec, T=10)
    y = attn(x, ctx, rot)
    for j, visible in ((5, False), (2, False), (6, True), (8, True)):
        x2 = x.clone()
        x2[:, j] += 3.0
        changed = not torch.allclose(attn(x2, ctx, rot)[:, t], y[:, t], atol=1e-6)
        assert changed == visible, f"key {j} seen by query {t} with window {window}: {changed}"


def test_softcap_bounds_reached_scores():
    cap = 2.0
    attn, spec = _attention(n_heads=4, n_kv_heads=4, softcap=cap)
    with torch.no_grad():
        attn.q_proj.weight.mul_(20)  # scores far beyond the cap
    x, ctx, rot = zt.attention_inputs(spec, B=1, T=8)
    q = attn.q_proj(x).view(1, 8, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(1, 8, 4, 8).transpose(1, 2)
    v = attn.v_proj(x).view(1, 8, 4, 8).transpose(1, 2)
    q, k = rot.rotate(q, k)
    raw = q @ k.transpose(-1, -2) / math.sqrt(8)
    assert raw.abs().max() > 10 * cap  # the cap is reached
    capped = cap * torch.tanh(raw / cap)
    assert capped.abs().max() <= cap
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    probs = capped.masked_fill(~causal, float("-inf")).softmax(-1)
    expected = attn.o_proj((probs @ v).transpose(1, 2).reshape(1, 8, 32))
    torch.testing.assert_close(attn(x, ctx, rot), expected, atol=1e-5, rtol=1e-4)
    # Within a row, probabilities differ by at most exp(2 * cap).
    p_vis = probs[..., -1, :]
    assert (p_vis.max(-1).values / p_vis.min(-1).values).max() <= math.exp(2 * cap) * 1.001


@pytest.mark.parametrize("mode", ["head", "proj"])
def test_qk_norm_per_head_or_over_the_projection(mode):
    attn, spec = _attention(n_heads=4, n_kv_heads=2, qk_norm=mode)
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, o: seen.setdefault("q", o))
    x, ctx, rot = zt.attention_inputs(spec)
    attn(x, ctx, rot)
    q = seen["q"]
    if mode == "head":
        assert attn.q_norm.weight.shape == (8,) and q.shape == (2, 4, 10, 8)
        torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 4, 10), atol=1e-4, rtol=0)
    else:
        assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,) and q.shape == (2, 10, 32)
        torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 10), atol=1e-4, rtol=0)
        per_head = q.view(2, 10, 4, 8).pow(2).mean(-1)
        assert not torch.allclose(per_head, torch.ones_like(per_head), atol=1e-2)


def test_score_scale_is_scale_dim():
    a, spec = _attention(n_heads=4, scale_dim=2.0)
    b, _ = _attention(n_heads=4)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.q_proj.weight.mul_(math.sqrt(8 / 2.0))  # same scores through the default 1/sqrt(head_dim)
    x, ctx, rot = zt.attention_inputs(spec)
    torch.testing.assert_close(a(x, ctx, rot), b(x, ctx, rot), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [{"n_heads": 4}, {"n_heads": 4, "softcap": 3.0}, {"n_heads": 4, "window": 3}])
def test_attention_is_causal(cfg):
    attn, spec = _attention(**cfg)
    x, ctx, rot = zt.attention_inputs(spec)
    for t in (0, 4, 9):
        zt.assert_causal(lambda h: attn(h, ctx, rot), x, t, lambda h: h + (torch.arange(10) == t)[None, :, None], "attention")


# --------------------------------------------------------------------------------------- blocks

def _block(name, **cfg):
    spec = zt.tiny_spec({"layers.default.block": {"name": name, **cfg}})
    block = spec.layer(0).block.build(spec=spec, layer=spec.layer(0), index=0)
    with torch.no_grad():  # make every norm distinct, so swapping two would show
        for n, p in block.named_parameters():
            if "norm" in n:
                p.normal_()
    return block, spec


@covers(("block", "serial"))
@pytest.mark.parametrize("where", ["pre", "post", "sandwich", "output"])
def test_serial_block_equations(where):
    b, spec = _block("serial", norm_position=where)
    x, ctx, rot = zt.attention_inputs(spec)
    A = lambda h: b.mixer(h, ctx, rot)  # noqa: E731
    if where == "pre":
        h = x + A(b.attn_norm(x))
        y = h + b.ffn(b.ffn_norm(h))
    elif where == "post":
        h = b.attn_norm(x + A(x))
        y = b.ffn_norm(h + b.ffn(h))
    elif where == "sandwich":
        h = x + b.attn_out_norm(A(b.attn_norm(x)))
        y = h + b.ffn_out_norm(b.ffn(b.ffn_norm(h)))
    else:  # OLMo 2: norms on the outputs, none on the inputs
        assert not hasattr(b, "attn_norm") and not hasattr(b, "ffn_norm")
        h = x + b.attn_out_norm(A(x))
        y = h + b.ffn_out_norm(b.ffn(h))
    torch.testing.assert_close(b(x, ctx, rot), y)


@covers(("block", "parallel"))
@pytest.mark.parametrize("shared", [True, False])
def test_parallel_block_equation(shared):
    b, spec = _block("parallel", shared_norm=shared)
    x, ctx, rot = zt.attention_inputs(spec)
    n2 = b.attn_norm if shared else b.ffn_norm
    assert (b.ffn_norm is None) == shared
    y = x + b.mixer(b.attn_norm(x), ctx, rot) + b.ffn(n2(x))
    torch.testing.assert_close(b(x, ctx, rot), y)


# ------------------------------------------------------------------------------------ stability

@covers(("stability", "softcap"))
def test_softcap_bounded_odd_identity_near_zero():
    softcap = zoo.get("stability", "softcap")
    cap = 30.0
    x = torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64)
    y = softcap(x, cap)
    assert y.abs().max() <= cap and y.abs().max() > cap * 0.999  # bounded, and the bound is reached
    torch.testing.assert_close(softcap(-x, cap), -y)  # odd
    small = torch.linspace(-1, 1, 101, dtype=torch.float64)
    assert ((softcap(small, cap) - small).abs() <= small.abs() ** 3 / (3 * cap**2) + 1e-12).all()
    assert (y[1:] >= y[:-1]).all()  # monotone: order of logits kept


def test_z_loss_is_mean_squared_logsumexp():
    logits = torch.randn(3, 5, 17) * 4
    expected = torch.stack([torch.log(torch.exp(row.double()).sum()) ** 2 for row in logits.reshape(-1, 17)]).mean()
    out = zoo.lm_loss(logits, torch.randint(0, 17, (3, 5)), z_loss=1e-2)
    torch.testing.assert_close(out.loss, out.ce + 1e-2 * out.z)
    torch.testing.assert_close(out.z.double(), expected, rtol=1e-5, atol=1e-6)

# ----------------------------------------------------------------------- mixture of experts
# (balancing, dispatch and checkpoints: tests/parts/test_moe.py)

D_MOE, E = 32, 8


def router(name, k=2, **cfg):
    torch.manual_seed(0)
    r = zt.part("router", name, cfg).build(d_model=D_MOE, n_experts=E, top_k=k)
    with torch.no_grad():
        r.weight.normal_(0, 1.0)
    return r


def moe(**cfg):
    torch.manual_seed(0)
    m = zt.part("ffn", "moe", {"n_experts": E, "top_k": 2, "d_ff": 16, **cfg}).build(d_model=D_MOE)
    with torch.no_grad():
        m.router.weight.normal_(0, 1.0)
    return m


@covers(("router", "softmax_topk"), ("router", "topk_softmax"))
def test_softmax_topk_and_topk_softmax():
    x = torch.randn(10, D_MOE)
    r = router("softmax_topk", k=3)(x)
    p = (x @ r_weight("softmax_topk", 3).t()).softmax(-1)
    top = p.topk(3, dim=-1)
    assert torch.equal(r.indices, top.indices)
    torch.testing.assert_close(r.weights, top.values)
    r = router("topk_softmax", k=3)(x)
    logits = x @ r_weight("topk_softmax", 3).t()
    top = logits.topk(3, dim=-1)
    assert torch.equal(r.indices, top.indices)
    torch.testing.assert_close(r.weights, top.values.softmax(-1))  # sums to one without renormalising
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(10))


def r_weight(name, k, **cfg):
    return router(name, k, **cfg).weight.detach()


@covers(("router", "sigmoid_group"))
def test_sigmoid_group_routes_with_the_bias_and_weights_without_it():
    """DeepSeek-V3: groups scored by the sum of their two best biased scores, top-k within the best
    groups; the weights are the unbiased sigmoid scores."""
    r = router("sigmoid_group", k=2, n_groups=4, topk_group=2)
    with torch.no_grad():
        r.bias.copy_(torch.randn(E))
    x = torch.randn(12, D_MOE)
    out = r(x)
    s = torch.sigmoid(x @ r.weight.detach().t())
    b = s + r.bias
    for n in range(12):
        groups = b[n].view(4, 2).topk(2, dim=-1).values.sum(-1).topk(2).indices
        allowed = torch.cat([torch.arange(2 * g, 2 * g + 2) for g in groups.tolist()])
        masked = torch.full((E,), float("-inf"))
        masked[allowed] = b[n, allowed]
        assert set(out.indices[n].tolist()) == set(masked.topk(2).indices.tolist())
        torch.testing.assert_close(out.weights[n], s[n, out.indices[n]])


@covers(("router", "greedy_group"))
def test_greedy_group_limits_choices_to_the_best_groups():
    x = torch.randn(12, D_MOE)
    r = router("greedy_group", k=3, n_groups=4, topk_group=2)
    out = r(x)
    p = (x @ r.weight.detach().t()).softmax(-1)
    groups = p.view(12, 4, 2).max(-1).values.topk(2, dim=-1).indices
    for n in range(12):
        allowed = set(sum(([2 * g, 2 * g + 1] for g in groups[n].tolist()), []))
        assert set(out.indices[n].tolist()) <= allowed
        torch.testing.assert_close(out.weights[n], p[n, out.indices[n]])


@covers(("ffn", "moe"))
def test_moe_equals_the_sum_of_chosen_experts_by_hand():
    m = moe(top_k=3, norm_topk_prob=True, routed_scaling=2.5, shared_d_ff=16, shared_gate=True)
    x = torch.randn(2, 5, D_MOE)
    flat = x.reshape(-1, D_MOE)
    p = (flat @ m.router.weight.detach().t()).softmax(-1)
    top = p.topk(3, dim=-1)
    w = top.values / top.values.sum(-1, keepdim=True) * 2.5
    expected = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for j, e in enumerate(top.indices[n].tolist()):
            h = F.silu(m.experts.w_gate[e] @ flat[n]) * (m.experts.w_up[e] @ flat[n])
            expected[n] += w[n, j] * (m.experts.w_down[e] @ h)
    s = m.shared
    expected += torch.sigmoid(m.shared_gate(flat)) * s.down(F.silu(s.gate(flat)) * s.up(flat))
    torch.testing.assert_close(m(x).reshape(-1, D_MOE), expected.detach(), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------- MLA

@covers(("mixer", "mla"))
def test_mla_caches_only_the_latent_and_the_shared_rotated_key():
    """What MLA is for: its decode state grows by kv_lora_rank + qk_rope_head_dim values per token,
    whatever the number of heads (tests/parts/test_mla.py has the rest)."""
    sizes = []
    for heads in (2, 8):
        spec = zt.tiny_spec({"layers.default.mixer": {"name": "mla", "n_heads": heads, "kv_lora_rank": 16,
                                                      "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}})
        model = zt.tiny_model(spec)
        state = model.new_state(1, 7)
        with torch.no_grad():
            model(torch.zeros(1, 7, dtype=torch.long), state=state)
        sizes.append(state.nbytes())
    assert sizes[0] == sizes[1] == 2 * 7 * (16 + 4) * 4


@covers(("mixer", "dsa"))
def test_dsa_attends_only_to_the_keys_its_indexer_picks():
    """With index_topk at least the sequence length DSA is MLA (same weights); with index_topk = 1
    each query's output is the value of the one key its indexer ranks first."""
    mla = {"n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
           "q_lora_rank": 12}
    T = 9

    def mixer(name, **extra):
        spec = zt.tiny_spec({"layers.default.mixer": {"name": name, **mla, **extra}})
        return spec.layer(0).mixer.build(d_model=spec.d_model, layer=spec.layer(0), spec=spec, index=0).eval(), spec

    dense, spec = mixer("mla")
    x, ctx, pos = zt.attention_inputs(spec, T=T)
    for topk, check_dense in ((T, True), (1, False)):
        dsa, _ = mixer("dsa", index_n_heads=2, index_head_dim=8, index_topk=topk)
        dsa.load_state_dict({**dense.state_dict(), **{k: v for k, v in dsa.state_dict().items() if "indexer" in k}})
        with torch.no_grad():
            out = dsa(x, ctx, pos)
            if check_dense:
                torch.testing.assert_close(out, dense(x, ctx, pos), atol=1e-5, rtol=1e-5)
                continue
            cos, sin = (t[:, 0] for t in pos.pairs())
            q_latent = dsa.q_a_norm(dsa.q_a_proj(x))
            scores = dsa.indexer.scores(x, q_latent, dsa.indexer.keys(x, cos, sin), cos, sin)
            first = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).argmax(-1)
            c, _ = dsa.latents(x)
            _, w_uv = dsa.up_weights()
            values = torch.einsum("btc,hvc->bthv", c[:, 0], w_uv)  # (B, T, H, v) each key's values
            picked = values[torch.arange(2)[:, None], first]  # (B, T, H, v)
            torch.testing.assert_close(out, dsa.o_proj(picked.flatten(2)), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------- Mamba-2

@covers(("mixer", "mamba2"))
def test_mamba2_is_its_quadratic_ssd_form_by_hand():
    """The SSD duality: y = (C B^T * L) (x dt) + D x with L[t, s] = exp(A * (dt_{s+1} + ... + dt_t)) for
    s <= t, after a causal depthwise convolution (F.conv1d here), before the gated group RMSNorm."""
    cfg = {"n_heads": 4, "head_dim": 8, "state_size": 8, "n_groups": 2, "chunk_size": 3, "bias": True}
    spec = zt.tiny_spec_with("mixer", "mamba2", cfg)
    m = spec.layer(0).mixer.build(d_model=32, layer=spec.layer(0), spec=spec, index=0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(2, 10, 32)
    ctx = zt.ForwardContext(position_ids=torch.arange(10).expand(2, 10), slots=torch.arange(10))
    with torch.no_grad():
        H, P, N, G, T = 4, 8, 8, 2, 10
        z, xBC, dt = m.in_proj(x).split([H * P, H * P + 2 * G * N, H], -1)
        xBC = F.silu(F.conv1d(xBC.transpose(1, 2), m.conv1d.weight, m.conv1d.bias, padding=3, groups=xBC.shape[-1])[..., :T])
        u, Bm, Cm = xBC.transpose(1, 2).split([H * P, G * N, G * N], -1)
        dt = F.softplus(dt + m.dt_bias)
        A = -torch.exp(m.A_log)
        u, Bm, Cm = u.view(2, T, H, P), Bm.view(2, T, G, N), Cm.view(2, T, G, N)
        y = torch.zeros(2, T, H, P)
        for h in range(H):
            g = h // (H // G)
            cum = torch.cumsum(dt[..., h] * A[h], -1)  # (2, T)
            L = torch.exp(cum[:, :, None] - cum[:, None, :]).tril()
            scores = (Cm[:, :, g] @ Bm[:, :, g].transpose(1, 2)) * L
            y[:, :, h] = scores @ (u[:, :, h] * dt[..., h, None]) + m.D[h] * u[:, :, h]
        y = y.reshape(2, T, H * P) * F.silu(z)
        y = y.view(2, T, G, -1)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).view(2, T, -1) * m.norm.weight
        torch.testing.assert_close(m(x, ctx, None), m.out_proj(y), atol=1e-5, rtol=1e-5)


@covers(("block", "mixer_only"))
def test_mixer_only_block_adds_the_mixer_of_the_normed_input_and_nothing_else():
    spec = zt.tiny_spec_with("block", "mixer_only")
    block = spec.layer(0).block.build(spec=spec, layer=spec.layer(0), index=0)
    assert not any(n.startswith("ffn") for n, _ in block.named_parameters())
    x, ctx, pos = zt.attention_inputs(spec)
    with torch.no_grad():
        torch.testing.assert_close(block(x, ctx, pos), x + block.mixer(block.attn_norm(x), ctx, pos))
        block.mixer.o_proj.weight.zero_()
        torch.testing.assert_close(block(x, ctx, pos), x)


@covers(("block", "ffn_only"))
def test_ffn_only_block_adds_the_ffn_of_the_normed_input_and_keeps_no_state():
    spec = zt.tiny_spec_with("block", "ffn_only")
    block = spec.layer(0).block.build(spec=spec, layer=spec.layer(0), index=0)
    assert not any(n.startswith("attention") for n, _ in block.named_parameters())
    x, ctx, pos = zt.attention_inputs(spec)
    with torch.no_grad():
        torch.testing.assert_close(block(x, ctx, pos), x + block.ffn(block.ffn_norm(x)))
        block.ffn.down.weight.zero_()
        torch.testing.assert_close(block(x, ctx, pos), x)
    assert block.mixer.new_state(2, None, dtype=torch.float32, device="cpu").nbytes() == 0


@covers(("mixer", "none"))
def test_mixer_none_mixes_nothing_and_holds_no_state():
    """An MLP-only layer (Nemotron-H's): mixer none in an ffn_only block, beside attention; the model decodes."""
    spec = zt.hybrid_spec("none", **{"layers.part.block": "ffn_only"})
    model = zt.tiny_model(spec)
    mixer = model.layers[0].mixer
    x, ctx, pos = zt.attention_inputs(spec)
    assert not list(mixer.parameters()) and not mixer(x, ctx, pos).any()
    assert mixer.new_state(2, None, dtype=torch.float32, device="cpu").nbytes() == 0
    assert mixer.cost(1024).flops == 0 and mixer.cost(1024).state_fixed == 0
    zt.check_decoding(model, torch.randint(0, spec.vocab_size, (2, 12)))


# ----------------------------------------------------------------- recurrent mixers (linear attention)

def _mixer(name, **cfg):
    spec = zt.hybrid_spec(name, cfg)
    mixer = spec.layer(0).mixer.build(d_model=spec.d_model, layer=spec.layer(0), spec=spec, index=0)
    return mixer, spec


@covers(("mixer", "linear_attention"))
@pytest.mark.parametrize("decay", [None, "retnet"])
def test_linear_attention_is_the_quadratic_form(decay):
    """The notes' duality: ``Q (K^T V)`` carried as a state equals ``(Q K^T * D) V`` with the causal
    decay mask ``D[t, s] = gamma^(t - s)`` (1 without decay; RetNet's gamma_h = 1 - 2^(-5 - h))."""
    m, spec = _mixer("linear_attention", n_heads=4, head_dim=8, feature_map="elu1", decay=decay, chunk=3)
    x, ctx, _ = zt.attention_inputs(spec, T=11)
    B, T, _ = x.shape
    q, k, v = (p(x).view(B, T, 4, 8).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    q, k = F.elu(q) + 1, F.elu(k) + 1
    gamma = torch.ones(4) if decay is None else 1 - 2.0 ** (-5 - torch.arange(4.0))
    t = torch.arange(T)
    dist = (t[:, None] - t[None, :]).float()
    D = torch.where(dist >= 0, gamma[:, None, None] ** dist.clamp(min=0), torch.zeros(()))
    y = ((q @ k.transpose(-1, -2)) * D) @ v
    expected = m.o_proj(y.transpose(1, 2).reshape(B, T, 32))
    torch.testing.assert_close(m(x, ctx, None), expected, atol=1e-5, rtol=1e-5)


@covers(("mixer", "lightning_attention"))
def test_lightning_attention_is_gated_normed_decayed_linear_attention():
    """MiniMax's lightning attention: ``silu`` of one fused projection gives q, k, v per head; the
    quadratic form with decay ``exp(-slope_h (t - s))``; RMSNorm over all heads; a sigmoid gate of
    the input; the output projection. Slopes ``2^(-8 (h + 1) / H)`` times ``1 - i / (n - 1)`` (+1e-5)."""
    m, spec = _mixer("lightning_attention", n_heads=4, head_dim=8, chunk=4)
    assert spec.n_layers == 2
    torch.testing.assert_close(m.slope, 2.0 ** (-8 * (torch.arange(4.0) + 1) / 4) * (1 + 1e-5))
    x, ctx, _ = zt.attention_inputs(spec, T=11)
    B, T, _ = x.shape
    qkv = F.silu(m.qkv_proj(x)).view(B, T, 4, 24).transpose(1, 2)
    q, k, v = qkv[..., :8], qkv[..., 8:16], qkv[..., 16:]
    t = torch.arange(T)
    dist = (t[:, None] - t[None, :]).float()
    D = torch.where(dist >= 0, torch.exp(-m.slope[:, None, None] * dist.clamp(min=0)), torch.zeros(()))
    y = (((q @ k.transpose(-1, -2)) * D) @ v).transpose(1, 2).reshape(B, T, 32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * m.norm.weight
    expected = m.out_proj(torch.sigmoid(m.output_gate(x)) * y)
    torch.testing.assert_close(m(x, ctx, None), expected, atol=1e-5, rtol=1e-5)


@covers(("block", "scaled_residual"))
def test_scaled_residual_block_takes_the_residual_after_the_norm():
    """``h = a_1 N1(x) + b_1 Mixer(N1(x))``, ``y = a_2 N2(h) + b_2 FFN(N2(h))``: the stream is re-normed
    at every block, so scaling the input changes nothing."""
    b, spec = _block("scaled_residual", attn_alpha=1.7, attn_beta=0.6, ffn_alpha=2.2, ffn_beta=0.4)
    x, ctx, rot = zt.attention_inputs(spec)
    a = b.attn_norm(x)
    h = 1.7 * a + 0.6 * b.mixer(a, ctx, rot)
    n = b.ffn_norm(h)
    torch.testing.assert_close(b(x, ctx, rot), 2.2 * n + 0.4 * b.ffn(n))
    torch.testing.assert_close(b(100 * x, ctx, rot), b(x, ctx, rot), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ Gated DeltaNet

@covers(("mixer", "gated_deltanet"))
def test_gated_deltanet_writes_by_the_delta_rule():
    """With no decay and beta = 1, writing v under a unit key replaces what that key read: reading
    with the key gives v back exactly, whatever was stored before, in both forms. With beta = 0 the
    mixer writes nothing, so every output is zero."""
    from zoo.components.mixers.gated_deltanet import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    k = l2norm(torch.randn(1, 2, 5, 8, generator=gen))
    v = torch.randn(1, 2, 5, 6, generator=gen)
    g, beta = torch.zeros(1, 2, 5), torch.ones(1, 2, 5)
    S0 = torch.randn(1, 2, 8, 6, generator=gen)
    for form in (recurrent_gated_delta_rule, lambda *a: chunk_gated_delta_rule(*a, chunk_size=2)):
        y, S = form(k, k, v, g, beta, S0)  # read with the key just written
        torch.testing.assert_close(y, v, atol=1e-5, rtol=0)
        torch.testing.assert_close(k[:, :, -1:] @ S, v[:, :, -1:], atol=1e-5, rtol=0)
    mixer = zt.part("mixer", "gated_deltanet", {"n_heads": 4, "n_key_heads": 2, "key_dim": 8, "value_dim": 8}).build(
        d_model=32, layer=None, spec=None)
    with torch.no_grad():
        mixer.in_proj_ba.weight[:4].zero_()  # b = 0 ...
        mixer.in_proj_ba.weight[:4, 0] = -1e4  # ... then very negative on the first feature: beta = 0
    x, ctx, _ = zt.attention_inputs(zt.tiny_spec(), B=1, T=6)
    x[..., 0] = 1.0
    with torch.no_grad():
        assert mixer(x, ctx, None).abs().max() == 0
