"""Every fast kernel against its plain PyTorch reference, on the CPU under Triton's interpreter, in
fp32: outputs and gradients, on shapes that are not multiples of the kernels' block sizes.

Tolerances: the kernels compute in fp32 like the references but round and reduce in a different
order, so results agree to a few ulps. Elementwise 1e-5 relative, and for elements that cancel to
near 0 an absolute 1e-6 of the tensor's largest magnitude (an fp32 ulp is 6e-8 of it): any wrong
term (a missing ``1 +``, a dropped soft-cap derivative, a wrong pair) is off by orders of magnitude.
"""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: they then run on CPU tensors

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import zoo  # noqa: E402
from zoo.core import kernels  # noqa: E402
from zoo.model.loss import lm_loss  # noqa: E402
from kernel_refs import assert_compiles_as_eager  # noqa: E402

def close(a, b, rtol=1e-5, scale=1e-6, **kw):
    torch.testing.assert_close(a, b, rtol=rtol, atol=scale * max(1.0, float(b.detach().abs().max())), **kw)


def run_both(module, setting, make_inputs, call=None):
    """Outputs and input/parameter gradients of ``module`` with ``setting`` forced and switched off."""
    results, made = [], make_inputs()
    for s in (setting, "off"):
        module.zero_grad()
        # same strides as made (the clone of a transposed view stays transposed)
        inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in made]
        torch.manual_seed(1)
        with kernels.using(s):
            out = (call or module)(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(2)
        sum(o.mul(torch.randn(o.shape)).sum() for o in outs).backward()
        grads = [t.grad for t in inputs if t.requires_grad] + [p.grad.clone() for p in module.parameters()]
        results.append((outs, grads))
    return results


def check(module, setting, make_inputs, call=None, **tol):
    (fast_out, fast_grad), (ref_out, ref_grad) = run_both(module, setting, make_inputs, call)
    for a, b in zip(fast_out, ref_out):
        close(a, b, **tol)
    assert len(fast_grad) == len(ref_grad)
    for a, b in zip(fast_grad, ref_grad):
        close(a, b, **tol)


def randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


@pytest.mark.parametrize("unit_offset,scale_in_fp32", [(False, False), (True, True), (True, False), (False, True)])
def test_rmsnorm_matches_reference(unit_offset, scale_in_fp32):
    norm = randomise(zoo.get("norm", "rmsnorm")(zoo.get("norm", "rmsnorm").Config(
        unit_offset=unit_offset, scale_in_fp32=scale_in_fp32), dim=45))
    check(norm, "rmsnorm:triton", lambda: [torch.randn(3, 7, 45) * 3])


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_reference(bias):
    cls = zoo.get("norm", "layernorm")
    norm = randomise(cls(cls.Config(bias=bias), dim=130))
    check(norm, "layernorm:triton", lambda: [torch.randn(21, 130) + 2])


def test_norm_backward_leaves_the_incoming_gradient_alone():
    """Gemma 2's sandwich norms sit on the residual: the incoming gradient is reused by the skip
    connection, so the backward must write its own output, never into ``dy``."""
    from zoo.components.kernels.norms import rms_norm

    x = torch.randn(5, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    y = rms_norm(x, w, 1e-6, unit_offset=True, scale_in_fp32=True)
    dy = torch.randn_like(y)
    kept = dy.clone()
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dy, kept)
    assert dx.data_ptr() != dy.data_ptr()
    # and through a residual h = x + norm(x), as in the block:
    x.grad = None
    ref_x = x.detach().clone().requires_grad_()
    (x + rms_norm(x, w, 1e-6, unit_offset=True, scale_in_fp32=True)).backward(dy)
    h = ref_x.float() * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.detach())
    (ref_x + h).backward(dy)
    close(x.grad, ref_x.grad)


def rope_module(layout, fraction, head_dim=24):
    cls = zoo.get("position", "rope")
    rope = cls.__new__(cls)
    torch.nn.Module.__init__(rope)
    rope.cfg = cls.Config(layout=layout, rotary_fraction=fraction)
    rope.head_dim, rope.dim = head_dim, cls.rotary_dim_for(rope.cfg, head_dim)
    rope.scaling = None
    rope._static = rope._frequencies(None)
    return rope


@pytest.mark.parametrize("layout,fraction", [("half", 1.0), ("interleaved", 1.0), ("half", 0.5), ("interleaved", 0.25)])
def test_rope_matches_reference(layout, fraction):
    rope = rope_module(layout, fraction)
    # per-sequence positions (as with left padding); q and k as the attention makes them:
    # transposed views, fewer key heads (GQA); 11 positions (not a multiple of the block)
    positions = torch.stack([torch.arange(11), torch.arange(11).clamp(min=3) - 3])
    state = rope.prepare(positions, torch.float32)

    def inputs():
        return [torch.randn(2, 11, 3, 24).transpose(1, 2), torch.randn(2, 11, 1, 24).transpose(1, 2)]

    check(rope, "rope:triton", inputs, call=lambda q, k: rope.rotate(q, k, state))


@pytest.mark.parametrize("ffn,activation", [("swiglu", None), ("geglu", "gelu"), ("geglu", "gelu_tanh"), ("reglu", None)])
def test_gated_product_matches_reference(ffn, activation):
    cls = zoo.get("ffn", ffn)
    cfg = cls.Config(d_ff=37)
    if activation:
        cfg = cls.Config(d_ff=37, activation=zoo.Part("activation", "gelu", zoo.get("activation", "gelu").Config(
            approximate="tanh" if activation == "gelu_tanh" else "none")))
    module = randomise(cls(cfg, d_model=24))
    check(module, "glu:triton", lambda: [torch.randn(3, 29, 24)])


@pytest.mark.parametrize("softcap,z_loss,bias", [(None, 0.0, False), (5.0, 1e-2, True), (None, 1e-2, True)])
def test_fused_linear_cross_entropy_matches_reference(softcap, z_loss, bias):
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(13, 16, requires_grad=True)
    w = torch.randn(1500, 16, requires_grad=True)  # 1500: two vocabulary blocks, the last partial
    b = torch.randn(1500, requires_grad=True) if bias else None
    labels = torch.randint(0, 1500, (13,))
    labels[[3, 7]] = -100
    params = [t for t in (h, w, b) if t is not None]

    loss, ce, z = fused_linear_cross_entropy(h, w, labels, bias=b, softcap=softcap, z_loss=z_loss)
    fast = torch.autograd.grad(loss, params)
    logits = F.linear(h, w, b)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    ref = lm_loss(logits, labels, z_loss=z_loss)
    close(loss, ref.loss)
    close(ce, ref.ce)
    close(z, ref.z)
    for a, r in zip(fast, torch.autograd.grad(ref.loss, params)):
        close(a, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("two_passes", [False, True], ids=["one pass", "two passes"])
def test_fused_loss_gradients_against_float64(monkeypatch, dtype, two_passes):
    """Soft-cap, z-loss and a bias, in 24 token chunks (and, in two passes, three vocabulary blocks of
    the backward, the last partial): each gradient's relative error against float64 from the same
    inputs is within 1.5x of the unfused loss's own error in ``dtype``."""
    from zoo.components.kernels import cross_entropy as ce

    torch.manual_seed(0)
    v = 3000
    if two_passes:
        monkeypatch.setattr(ce, "FORWARD_SUM_BYTES", -1)
        n, d = 96, 24
        assert -(-v // ce._vocab_cols(v, d)) == 3 and n // ce._chunk_rows(n, d, ce._vocab_cols(v, d)) == 24
    else:  # chunks of 4 rows (one-row products are matrix-vector ones, summed in another order)
        n, d = 96, 96
        assert n // ce._chunk_rows(n, d, v) == 24
    h = torch.randn(n, d).to(dtype).requires_grad_()
    w = (torch.randn(v, d) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(v).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[[1, 5]] = -100
    params = [h, w, b]
    p64 = [t.detach().double().requires_grad_() for t in params]

    def unfused(ps):
        logits = F.linear(*ps)
        return lm_loss(5.0 * torch.tanh(logits / 5.0), labels, z_loss=1e-2).loss

    want = torch.autograd.grad(unfused(p64), p64)
    own = torch.autograd.grad(unfused(params), params)
    got = torch.autograd.grad(ce.fused_linear_cross_entropy(h, w, labels, bias=b, softcap=5.0, z_loss=1e-2)[0], params)
    for name, g, o, r in zip("hwb", got, own, want):
        assert g.dtype == dtype
        err, own_err = (float((x.double() - r).norm() / r.norm()) for x in (g, o))
        assert err <= 1.5 * own_err, (name, err, own_err)


@pytest.mark.parametrize("two_passes", [False, True], ids=["one pass", "two passes"])
def test_fused_loss_gives_ignored_rows_zero_gradient_whatever_their_logits(monkeypatch, two_passes):
    """Padding rows are ignored: a logit of 200 there (exp overflows float32 past about 88.7) must
    change no gradient, as if the row were left out, rather than turn them all into NaN."""
    from zoo.components.kernels import cross_entropy as ce

    if two_passes:
        monkeypatch.setattr(ce, "FORWARD_SUM_BYTES", -1)
    torch.manual_seed(0)
    h = torch.randn(6, 8)
    w = torch.randn(50, 8)
    h[2] = 0.0
    h[2, 0] = 200.0
    w[:, 0] = 0.0
    w[7, 0] = 1.0  # row 2's logit 7 is 200, the others 0
    labels = torch.tensor([1, 2, -100, 3, 4, -100])
    params = [h.requires_grad_(), w.requires_grad_()]
    got = torch.autograd.grad(ce.fused_linear_cross_entropy(h, w, labels)[0], params)
    keep = labels != -100
    want = torch.autograd.grad(F.cross_entropy(h[keep] @ w.T, labels[keep]), params)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        close(a, b)


def test_fused_loss_scales_with_the_incoming_gradient_and_skips_work_without_grad():
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    labels = torch.randint(0, 50, (6,))
    (g1,) = torch.autograd.grad(fused_linear_cross_entropy(h, w, labels)[0], h)
    (g3,) = torch.autograd.grad(3 * fused_linear_cross_entropy(h, w, labels)[0], h)
    close(g3, 3 * g1)
    with torch.no_grad():
        loss, ce, _ = fused_linear_cross_entropy(h, w, labels)
    close(loss, F.cross_entropy(h.detach() @ w.detach().T, labels))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_loss_compiles_in_one_graph_and_equals_eager(backend):
    """The loss is a pair of custom operators: torch.compile calls them as they are, with no graph
    break (Dynamo would otherwise trace into the Triton launches)."""
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    torch.manual_seed(0)
    labels = torch.randint(0, 70, (13,))
    labels[3] = -100
    assert_compiles_as_eager(
        lambda h, w, b, labels: fused_linear_cross_entropy(h, w, labels, bias=b, softcap=5.0, z_loss=1e-2)[0],
        torch.randn(13, 16, requires_grad=True), torch.randn(70, 16, requires_grad=True),
        torch.randn(70, requires_grad=True), labels, backend=backend)


def test_fused_loss_applies_the_head_logit_scale():
    """Grok-1's output multiplier scales the logits before the loss: the fused loss (which never
    forms them) takes it too, in the loss and in every gradient."""
    from zoo.components.kernels.cross_entropy import decoder_loss

    model = tiny("grok-1", **{"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.n_experts": 4})
    assert model.spec.head.scale == 3 ** -0.5
    h = torch.randn(2, 7, 32, requires_grad=True)
    labels = torch.randint(0, 150, (2, 7))
    fast = decoder_loss(model, h, labels, z_loss=1e-3)[0]
    ref = lm_loss(model.logits_from_hidden(h), labels, z_loss=1e-3).loss
    close(fast, ref)
    w = model.embed.weight
    for a, b in zip(torch.autograd.grad(fast, [h, w]), torch.autograd.grad(ref, [h, w])):
        close(a, b)


def tiny(name, **over):
    """A two-layer model of preset ``name``; an override given as None drops one of the base ones."""
    base = {"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 72}
    overrides = {k: v for k, v in {**base, **over}.items() if v is not None}
    return zoo.build(name, n_layers=2, d_model=32, vocab_size=150, seed=0, overrides=overrides)


def spy_on_fast_paths(monkeypatch):
    ran = []
    real = kernels.implementation

    def recording(component, backend):
        ran.append(component)
        return real(component, backend)

    monkeypatch.setattr(kernels, "implementation", recording)
    return ran


@pytest.mark.parametrize("name,over", [
    # Gemma 2: 1 + w norms in fp32, sandwich blocks, GeGLU (tanh), tied head, final soft-cap 30
    ("gemma2-2b", {"layers.local.mixer.window": 4}),
    # Llama 3: GQA, SwiGLU, untied head, llama3 RoPE scaling; z-loss on
    ("llama3-8b", {"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "z_loss": 1e-3}),
    # DeepSeek-V3: MLA, and a multi-token-prediction module whose loss (z-loss 0) takes the fused
    # kernel too: its gradient must reach the MTP module as it does on the reference path
    ("deepseek-v3", {"layers.*.mixer.head_dim": None}),
])
def test_model_loss_and_gradients_with_every_fast_path(monkeypatch, name, over):
    model = tiny(name, **over)
    ids = torch.randint(0, 150, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0  # left padding: ignored labels, per-sequence positions
    with kernels.using("off"):
        ref = model.loss(ids, attention_mask=mask)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    ran = spy_on_fast_paths(monkeypatch)
    with kernels.using("triton"):
        out = model.loss(ids, attention_mask=mask)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert {"rmsnorm", "rope", "glu", "loss"} <= set(ran)
    close(out.loss, ref.loss)
    close(out.ce, ref.ce)
    close(out.z, ref.z)
    for (n, _), a, r in zip(model.named_parameters(), grads, ref_grads):
        close(a, r, msg=lambda m, n=n: f"{n}: {m}")


def test_fused_loss_with_a_padded_vocabulary():
    model = tiny("llama3-8b", **{"embedding.padded_vocab_size": 160})
    ids = torch.randint(0, 150, (2, 7))
    with kernels.using("off"):
        ref = model.loss(ids)
    with kernels.using("loss:triton"):
        out = model.loss(ids)
    close(out.loss, ref.loss)
    w = model.lm_head.weight
    (g_ref,) = torch.autograd.grad(ref.loss, w)
    (g,) = torch.autograd.grad(out.loss, w)
    close(g, g_ref)
    assert g[150:].abs().max() == 0


def test_flex_attention_forward_matches_eager_with_softcap_window_gqa_and_padding():
    # FlexAttention has no backward on the CPU: its gradients are checked on CUDA by the benchmark.
    model = tiny("gemma2-2b", **{"layers.local.mixer.window": 3, "layers.*.mixer.n_heads": 4,
                                 "layers.*.mixer.n_kv_heads": 2}).eval()
    ids = torch.randint(0, 150, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        for m in (None, mask):
            with kernels.using("off"):
                ref = model(ids, attention_mask=m)
            with kernels.using("attention:flex"):
                out = model(ids, attention_mask=m)
            keep = slice(None) if m is None else m.bool()
            close(out[keep], ref[keep])


def _gpu_benchmark(name="gpu_kernels"):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_benchmark_dry_run_exercises_the_script(tmp_path):
    """benchmarks/gpu_kernels.py needs a GPU to measure; its dry run checks it runs end to end and
    writes its JSON and markdown table."""
    bench = _gpu_benchmark()
    out = tmp_path / "gpu.json"
    result = bench.main(bench.parse_args(["--dry-run", "--only", "rmsnorm,loss,train", "--layers", "1", "--repeats", "1",
                                          "--json", str(out), "--markdown", str(tmp_path / "gpu.md")]))
    assert [r["kernel"] for r in result["kernels"]] == ["rmsnorm", "rmsnorm (Gemma 1+w)", "loss (linear + CE)"]
    assert all(r["max_rel_error"] < 2e-5 for r in result["kernels"]), result["kernels"]
    assert result["train"]["tokens_per_step"] == 16
    assert json.loads(out.read_text())["kernels"][0]["kernel"] == "rmsnorm"
    table = (tmp_path / "gpu.md").read_text().splitlines()
    assert table[0].startswith("cpu (dry run") and table[2].startswith("| kernel |")
    assert [line.split(" | ")[0] for line in table[4:7]] == ["| rmsnorm", "| rmsnorm (Gemma 1+w)", "| loss (linear + CE)"]
    assert any(line.startswith("Training step (llama3-8b x1 layers, 16 tokens)") for line in table)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check would run for minutes")
def test_gpu_check_script_stops_without_a_gpu(tmp_path):
    """benchmarks/gpu_check.sh runs as written: without a GPU it stops before anything else, saying why."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"
    done = subprocess.run(["sh", str(script), str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode != 0 and "no CUDA device" in done.stderr
    assert (tmp_path / "out").is_dir() and not (tmp_path / "out" / "pytest.txt").exists()


GPU_CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "gpu_check.sh")


def test_gpu_check_script_parses_and_refuses_bad_options():
    import subprocess

    assert subprocess.run(["sh", "-n", GPU_CHECK]).returncode == 0
    done = subprocess.run(["sh", GPU_CHECK, "--part", "3"], capture_output=True, text=True)
    assert done.returncode == 2 and "--part is 1 or 2, not 3" in done.stderr


@pytest.mark.slow  # builds zoo and pip-installs it (offline) into a throwaway folder
def test_gpu_check_dry_run_installs_offline_and_finds_its_files(tmp_path):
    """What the lent machine does first, on the CPU: the environment printed, zoo built and installed
    with no index and no build isolation into a throwaway folder and imported from outside the
    checkout, the CUDA tests collected, the anchors' benchmark run at tiny shapes."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["sh", GPU_CHECK, "--dry-run", str(tmp_path)], capture_output=True, text=True, env=env)
    log = (tmp_path / "check.log").read_text()
    assert done.returncode == 0, log[-4000:] + done.stderr[-2000:]
    assert log.index("torch ") < log.index("== install")  # the environment first
    assert "== import: done" in log
    assert "/site/zoo/__init__.py" in log  # the installed copy, not the checkout
    assert "== collect: done" in log and "== anchors: done" in log
    assert json.loads((tmp_path / "anchors.json").read_text())["rows"]


def test_gpu_vs_anchors_dry_run_measures_zoo_and_names_missing_anchors(tmp_path, monkeypatch):
    bench = _gpu_benchmark("gpu_vs_anchors")
    monkeypatch.setattr(bench, "anchor", lambda module, name: (None, f"{module}.{name}: not installed"))
    out = bench.main(bench.parse_args(["--dry-run", "--only", "loss,rmsnorm", "--json", str(tmp_path / "a.json"),
                                       "--markdown", str(tmp_path / "a.md")]))
    assert [(r["kernel"], r["impl"]) for r in out["rows"]] == [("rmsnorm", "zoo"), ("rmsnorm", "eager"),
                                                                ("loss", "zoo"), ("loss", "eager")]
    assert all(r["zoo_vs_this"] < 1e-4 for r in out["rows"])  # fp32: zoo agrees with eager
    assert [m["anchor"] for m in out["missing"]] == ["liger", "liger"]
    assert json.loads((tmp_path / "a.json").read_text()) == out
    assert "| loss | | liger | missing |" in (tmp_path / "a.md").read_text()


def test_gpu_benchmark_without_a_gpu_says_so(monkeypatch):
    bench = _gpu_benchmark()
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(bench.parse_args(["--only", "rmsnorm"]))


def test_fused_loss_and_rope_follow_autocast_like_the_reference():
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    h = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(200, 16, requires_grad=True)
    labels = torch.randint(0, 200, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = fused_linear_cross_entropy(h, w, labels)[0]
        ref = lm_loss(F.linear(h, w), labels).loss
        rope = rope_module("half", 1.0)
        state = rope.prepare(torch.arange(5)[None], torch.float32)
        q = torch.randn(1, 2, 5, 24, dtype=torch.bfloat16)
        with kernels.using("rope:triton"):
            rotated = rope.rotate(q, q, state)[0]
    assert rotated.dtype == rope._rotate(q, *state).dtype == torch.float32
    close(fast, ref, rtol=1e-3)  # both from the same bf16 logits; only the summation order differs
    close(torch.autograd.grad(fast, w)[0], torch.autograd.grad(ref, w)[0], rtol=1e-2, scale=1e-2)


def test_fused_loss_adds_the_auxiliary_losses_as_the_reference_does(monkeypatch):
    """A part's auxiliary loss (the toy MoE's balance term) is in the total on the fused path too."""
    assert zoo.load_plugin("toy_plugin").error is None
    import toy_plugin

    model = zoo.build(toy_plugin.SPEC, seed=0)
    ids = torch.randint(0, 64, (2, 9))
    with kernels.using("off"):
        ref = model.loss(ids)
    ran = spy_on_fast_paths(monkeypatch)
    with kernels.using("loss:triton"):
        out = model.loss(ids)
    assert "loss" in ran and set(out.aux) == {"moe_balance"}
    close(out.aux["moe_balance"], ref.aux["moe_balance"])
    close(out.loss, ref.loss)
    close(out.loss, out.ce + 0.01 * out.aux["moe_balance"])
    router = model.layers[1].ffn.router.weight
    close(torch.autograd.grad(out.loss, router)[0], torch.autograd.grad(ref.loss, router)[0])
