"""Attention's score hook (``Attention.scores() -> Scores``): every path (eager, SDPA with a mask,
FlexAttention) against a float64 reference written from the equations one query row at a time,
with GQA and left padding; gradients of a learned sink; decoding through the hook equals the full
forward; the soft-cap and window run through it.

Tolerances: the paths compute in float32 and the reference in float64; 1e-5 of the outputs'
scale is two orders above float32's rounding of a softmax over 11 keys and far below any wrong
term (a sink left in, a chunk off by one, a mask on the wrong head).
"""

import math

import pytest
import torch

import zoo
from zoo.components.mixers import scores as sc
from zoo.components.mixers.attention import Attention
from zoo.core import kernels
from zoo.testing import check_decoding, tiny_spec

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, HKV, T, D = 2, 4, 2, 11, 8


def attention(**cfg):
    spec = tiny_spec({"layers.default.mixer.n_heads": H, "layers.default.mixer.n_kv_heads": HKV,
                      "layers.default.mixer.head_dim": D, **{f"layers.default.mixer.{k}": v for k, v in cfg.items()}})
    layer = spec.layer(0)
    return Attention(layer.mixer.config, d_model=spec.d_model, layer=layer, spec=spec, index=0)


def reference(q, k, v, q_idx, k_idx, key_mask, scale, s):
    """float64, one (row, head, query) at a time, from the rules as Scores states them."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    G = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        real = [j for j in range(len(k_idx)) if key_mask is None or bool(key_mask[b, j])]
        first = min(int(k_idx[j]) for j in real) if real else 0
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                qs = int(q_idx[i])
                seen, logits = [], []
                for j in range(len(k_idx)):
                    ks = int(k_idx[j])
                    ok = ks <= qs and (s.window is None or qs - ks < s.window)
                    ok = ok and (s.chunk is None or (qs - first) // s.chunk == (ks - first) // s.chunk)
                    ok = ok and (s.mask_mod is None or bool(s.mask_mod(*map(torch.tensor, (b, h, qs, ks)))))
                    ok = ok and (key_mask is None or bool(key_mask[b, j]))
                    seen.append(ok)
                if not any(seen):
                    seen = [True] * len(k_idx)
                for j in range(len(k_idx)):
                    x = float(q[b, h, i] @ k[b, h // G, j]) * scale
                    if s.score_mod is not None:
                        x = float(s.score_mod(torch.tensor(x, dtype=torch.float64), *map(torch.tensor, (b, h, qs, int(k_idx[j])))))
                    logits.append(x)
                m = max(x for x, ok in zip(logits, seen) if ok)
                sink = float(s.sink[h]) if s.sink is not None else None
                if sink is not None:
                    m = max(m, sink)
                w = [math.exp(x - m) if ok else 0.0 for x, ok in zip(logits, seen)]
                z = sum(w) + (math.exp(sink - m) if sink is not None else 0.0)
                out[b, h, i] = sum(wj / z * v[b, h // G, j] for j, wj in enumerate(w))
    return out


def every_two(b, h, q, k):  # head-dependent: odd heads see every second key back (their own included)
    return (h % 2 == 0) | ((q - k) % 2 == 0)


torch.manual_seed(0)
SINK = torch.randn(H) * 2
VARIANTS = {
    "softcap+window": lambda s: s,
    "sink": lambda s: s.but(sink=SINK),
    "sink+softcap+window": lambda s: s.but(sink=SINK),
    "chunk": lambda s: s.but(chunk=4),
    "mask_mod+sink": lambda s: s.but(mask_mod=every_two, sink=SINK),
    "temperature": lambda s: s.then(lambda s, b, h, q, k: s / 0.7),
}
CONFIGS = {"softcap+window": {"softcap": 1.5, "window": 3}, "sink+softcap+window": {"softcap": 1.5, "window": 4}}


def inputs(padded):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, n, T, D, generator=g) * 2 for n in (H, HKV, HKV))
    idx = torch.arange(T)
    key_mask = None
    if padded:
        key_mask = torch.ones(B, T, dtype=torch.bool)
        key_mask[0, :3] = False
    return q, k, v, idx, key_mask


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "left padding"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_path_runs_the_hook_as_the_float64_reference(variant, padded):
    a = attention(**CONFIGS.get(variant, {}))
    a.scores = lambda: VARIANTS[variant](Attention.scores(a))  # this instance's hook
    s = a.scores()
    q, k, v, idx, key_mask = inputs(padded)
    ref = reference(q, k, v, idx, idx, key_mask, a.scale, s).float()
    real = slice(None) if key_mask is None else key_mask[:, None, :, None].expand_as(ref)
    paths = ["eager", "flex"] + (["sdpa"] if s.score_mod is None else [])
    for backend in paths:
        a.backend = backend
        with torch.no_grad():
            out = a.attend(q, k, v, idx, idx, key_mask)
        torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5, msg=lambda m: f"{backend}: {m}")


def test_sdpa_refuses_a_score_mod_and_flex_is_chosen_for_one_on_cuda_only():
    a = attention(softcap=2.0)
    a.backend = "sdpa"
    q, k, v, idx, _ = inputs(False)
    with pytest.raises(ValueError, match="sdpa backend cannot run a score_mod"):
        a.attend(q, k, v, idx, idx)
    assert a.reference_backend() == "eager"
    plain = attention()
    plain.scores = lambda: Attention.scores(plain).but(sink=SINK)
    assert plain.reference_backend() == "sdpa"  # a sink keeps SDPA (with a mask)
    assert plain.kernel_problem("flex", q) is None  # and sends CUDA to FlexAttention
    assert attention().kernel_problem("flex", q) is not None


def test_a_sinks_gradient_on_eager_and_sdpa_is_the_float64_reference_s():
    q, k, v, idx, key_mask = inputs(True)
    a = attention(window=5)
    grads = {}
    for backend in ("eager", "sdpa", "reference"):
        sink = SINK.clone().requires_grad_()
        s = Attention.scores(a).but(sink=sink)
        if backend == "reference":
            out = reference_autograd(q, k, v, idx, key_mask, a.scale, s)
        else:
            a.backend = backend
            a.scores = lambda: s
            out = a.attend(q, k, v, idx, idx, key_mask)
        (out.double() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = sink.grad.double()
    assert grads["reference"].abs().min() > 1e-4  # each head's sink does move the output
    for backend in ("eager", "sdpa"):
        torch.testing.assert_close(grads[backend], grads["reference"], rtol=1e-4, atol=1e-6)


def reference_autograd(q, k, v, idx, key_mask, scale, s):
    """The same rules in float64 tensors (the loop reference has no gradient): window, padding, sink."""
    q, k, v = q.double(), k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
    logits = q @ k.transpose(-1, -2) * scale
    seen = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < s.window)
    seen = seen[None, None] & key_mask[:, None, None, :]
    seen = seen | ~seen.any(-1, keepdim=True)
    logits = logits.masked_fill(~seen, float("-inf"))
    sink = s.sink.double().view(1, H, 1, 1).expand(B, H, T, 1)
    p = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    return p @ v


def test_a_query_scale_multiplies_each_query_by_its_positions_temperature():
    a = attention()
    temp = lambda pos: torch.log1p(torch.floor((pos.float() + 1) / 4)) * 0.5 + 1  # noqa: E731  (Llama 4's form)
    s = Attention.scores(a).but(query_scale=temp)
    q = torch.randn(B, H, T, D)
    pos = torch.arange(T)[None].expand(B, T)
    got = sc.scale_queries(q, s, pos)
    torch.testing.assert_close(got, q * temp(pos)[:, None, :, None])
    assert sc.scale_queries(q, Attention.scores(a), pos) is q


def test_the_soft_cap_and_window_are_the_hooks_defaults():
    a = attention(softcap=3.0, window=4)
    s = a.scores()
    assert s.window == 4 and s.score_mod is sc.softcapped(3.0)
    x = torch.linspace(-20, 20, 9)
    torch.testing.assert_close(s.score_mod(x, 0, 0, 0, 0), 3.0 * torch.tanh(x / 3.0))
    # An override of the hook is what the paths run: without the soft-cap the eager path is plain.
    q, k, v, idx, _ = inputs(False)
    a.backend = "eager"
    with torch.no_grad():
        capped = a.attend(q, k, v, idx, idx)
        a.scores = lambda: sc.Scores(window=4)
        plain = a.attend(q, k, v, idx, idx)
    assert (capped - plain).abs().max() > 1e-3
    torch.testing.assert_close(plain, reference(q, k, v, idx, idx, None, a.scale, sc.Scores(window=4)).float(),
                               rtol=1e-5, atol=1e-5)


def test_flex_block_mask_of_chunks_skips_blocks_in_earlier_chunks_and_matches_dense():
    from zoo.components.kernels import attention as flex

    Tn = 3 * flex.BLOCK
    idx = torch.arange(Tn)
    mask = flex.build_block_mask(idx, idx, None, chunk=flex.BLOCK)
    dense = mask.to_dense()[0, 0]  # (nQ, nK) blocks visited
    assert dense.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]  # chunks of one block: the diagonal only


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_decoding_through_the_hook_equals_the_full_forward(backend):
    model = zoo.build("llama3.2-1b", n_layers=2, d_model=32, vocab_size=64, seed=0,
                      overrides={"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2,
                                 "layers.*.mixer.head_dim": 8, "layers.*.ffn.d_ff": 48}).eval()
    temp = lambda pos: torch.log1p(torch.floor((pos.float() + 1) / 4)) * 0.5 + 1  # noqa: E731
    for i, layer in enumerate(model.layers):
        m = layer.mixer
        m.backend = backend
        hooks = [lambda m=m: Attention.scores(m).but(sink=SINK, chunk=4, query_scale=temp),
                 lambda m=m: Attention.scores(m).but(sink=-SINK, mask_mod=every_two, window=6)]
        m.scores = hooks[i]
    ids = torch.randint(0, 64, (2, 13))
    with kernels.using("off"):
        check_decoding(model, ids, what=f"sinks, chunks, a query scale and a mask_mod on {backend}")


def test_the_guides_sink_attention_runs_conforms_and_keeps_sdpa():
    import re
    from pathlib import Path

    import zoo.testing as zt

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "attention-variants.md").read_text()
    ns: dict = {}
    exec(compile(re.findall(r"```python\n(.*?)```", text, re.S)[0], "attention-variants.md", "exec"), ns)
    zoo.register("mixer", "docs_sink_attention")(ns["SinkAttention"])
    mixers = zoo.manager().registry("mixer")
    try:
        zt.check("mixer", "docs_sink_attention")  # the conformance suite: decoding, gradients, dtypes
        a = zt.part("mixer", "docs_sink_attention", {"n_heads": 4}).build(
            d_model=32, layer=tiny_spec().layer(0), spec=tiny_spec(), index=0)
        assert isinstance(a.scores().sink, torch.nn.Parameter) and a.reference_backend() == "sdpa"
    finally:  # the suite's other tests see the registry as zoo ships it
        mixers.remove("docs_sink_attention", mixers.entry("docs_sink_attention").provider)
