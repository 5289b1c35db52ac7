"""zoo's fast kernels against eager PyTorch and torch.compile, side by side in one process.

For each kernel: median time of forward + backward (and of the forward alone) and peak memory above the inputs, for the
eager reference, the reference under ``torch.compile``, and zoo's fast path, after several
warm-ups; long-context attention with its masks looked up or rebuilt every step, as training
does; then a training step (forward, backward, AdamW) of a Llama-3-8B-shaped model in zoo's
training setup (fp32 weights under autocast, backward outside it) with the fast paths off and on.
Outputs and gradients of the fast paths are compared with the reference first, and a mismatch
stops the run. Ratios are what to read; absolute times depend on the machine.

    python benchmarks/gpu_kernels.py                 # on a CUDA device (an H200 for the targets)
    python benchmarks/gpu_kernels.py --dry-run       # tiny sizes on the CPU, Triton interpreter

Targets on an H200: RMSNorm >= 3x eager; fused loss <= 0.25x eager's peak memory at a 128k
vocabulary; training step >= 1.2x eager's tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on the CPU under TRITON_INTERPRET=1, without torch.compile: checks that the script runs")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--tokens", type=int, default=8192, help="tokens per kernel call and per training step (default 8192)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary of the loss and the model (default Llama 3's 128256)")
    p.add_argument("--layers", type=int, default=8,
                   help="layers of the Llama-3-8B-shaped model in the training step (default 8 of 32, to fit one GPU with AdamW)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length of the training step (default 4096)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per measurement, median reported (default 20; 2 in a dry run)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement (compilation, autotuning, caches; default 3)")
    p.add_argument("--long", type=int, default=16384,
                   help="tokens of the long-context attention cases (default 16384: the eager reference must fit)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    p.add_argument("--only", default=None, help="comma-separated subset: rmsnorm,layernorm,rope,swiglu,loss,attention,scalar_decay,gated_delta,train")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the results as a markdown table (for the README)")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
        args.no_compile = True
    args.repeats = args.repeats or (2 if args.dry_run else 20)
    return args


ARGS = parse_args() if __name__ == "__main__" else None

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers beside this script
from timing import write_results  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zoo  # noqa: E402
from zoo.core import kernels  # noqa: E402
from zoo.model.loss import lm_loss  # noqa: E402


class Bench:
    def __init__(self, device, repeats, warmup):
        self.device, self.repeats, self.warmup = torch.device(device), repeats, warmup
        self.cuda = self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn):
        """Median seconds of ``fn()`` and its peak memory above what was allocated before (bytes;
        None off CUDA)."""
        for _ in range(self.warmup):  # compilation, autotuning, caches: more than one call settles them
            fn()
        getattr(fn, "reset", lambda: None)()  # the warm-up's gradients are not part of the baseline
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.repeats):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() - base if self.cuda else None
        return statistics.median(times), peak


def fwd_bwd(fn, inputs):
    """A closure running ``fn(*inputs)`` forward and backward (fresh gradients each time)."""

    def reset():
        for t in inputs:
            t.grad = None

    def run():
        reset()
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        outs = [o.sum() for o in outs if o.requires_grad]
        if outs:
            torch.autograd.backward(outs)

    run.reset = reset
    return run


def with_setting(setting, fn):
    def call(*a):
        with kernels.using(setting):
            return fn(*a)

    return call


def compare(name, fast, ref, inputs, tol):
    """Max relative error of the fast path's outputs and input gradients against the reference."""
    results = []
    for fn in (fast, ref):
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator(device=outs[0].device).manual_seed(12345)  # not the inputs' seed: equal draws would cancel
        diff = [o for o in outs if o.requires_grad]
        if diff:
            torch.autograd.backward(diff, [torch.randn(o.shape, generator=g, device=o.device, dtype=o.dtype) for o in diff])
        results.append([o.detach().float() for o in outs] + [x.grad.float() for x in xs if x.grad is not None])
    err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(*results))
    status = "ok" if err <= tol else "MISMATCH"
    print(f"  check {name:<24} max error / max |ref| = {err:.2e}  ({status}, tolerance {tol:g})")
    if err > tol:
        raise SystemExit(f"{name}: the fast path disagrees with the reference (max error / max |ref| {err:.2e} > {tol:g}); "
                         "nothing was timed. Fix the kernel before measuring it.")
    return err


def kernel_cases(a, dev, dtype):
    """(name, shape note, fast setting, reference fn, inputs) for each kernel."""
    n, tiny = a.tokens, a.dry_run
    d, d_ff, heads, kv, hd = (64, 160, 4, 2, 16) if tiny else (4096, 14336, 32, 8, 128)
    seq = 8 if tiny else 4096
    batch = max(1, n // seq)
    mk = dict(device=dev, dtype=dtype)
    llama = zoo.get_spec("llama3-8b", {"n_layers": 1, **({"d_model": d, "vocab_size": a.vocab,
                                        "layers.*.mixer.n_heads": heads, "layers.*.mixer.n_kv_heads": kv,
                                        "layers.*.ffn.d_ff": d_ff} if tiny else {})})
    cases = []

    rms = zoo.get("norm", "rmsnorm")(zoo.get("norm", "rmsnorm").Config(eps=1e-5), dim=d).to(**mk)
    cases.append(("rmsnorm", f"({n}, {d})", "rmsnorm:triton", rms, [torch.randn(n, d, **mk, requires_grad=True)]))
    gem = zoo.get("norm", "rmsnorm")(zoo.get("norm", "rmsnorm").Config(unit_offset=True, scale_in_fp32=True), dim=d).to(**mk)
    cases.append(("rmsnorm (Gemma 1+w)", f"({n}, {d})", "rmsnorm:triton", gem, [torch.randn(n, d, **mk, requires_grad=True)]))
    ln = zoo.get("norm", "layernorm")(zoo.get("norm", "layernorm").Config(), dim=d).to(**mk)
    cases.append(("layernorm", f"({n}, {d})", "layernorm:triton", ln, [torch.randn(n, d, **mk, requires_grad=True)]))

    rope = llama.position_for(0).build(spec=llama, layer=llama.layer(0)).to(dev)
    state = rope.prepare(torch.arange(seq, device=dev)[None].expand(batch, seq), dtype)
    q = torch.randn(batch, seq, heads, hd, **mk).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, kv, hd, **mk).transpose(1, 2).requires_grad_()
    cases.append(("rope (q and k)", f"q {tuple(q.shape)}", "rope:triton", lambda q, k: rope.rotate(q, k, state), [q, k]))

    ffn = llama.layer(0).ffn.build(d_model=d).to(**mk)
    cases.append(("swiglu product", f"({n}, {d_ff})", "glu:triton",
                  _glu_product(ffn), [torch.randn(n, d_ff, **mk, requires_grad=True) for _ in range(2)]))

    w = (torch.randn(a.vocab, d, **mk) * d ** -0.5).requires_grad_()
    h = torch.randn(n, d, **mk, requires_grad=True)
    labels = torch.randint(0, a.vocab, (n,), device=dev)
    cases.append(("loss (linear + CE)", f"({n}, {d}) x vocab {a.vocab}", "loss:triton", _loss(labels), [h, w]))

    gemma = zoo.get_spec("gemma2-9b", {"n_layers": 2, **({"d_model": d, "layers.*.mixer.head_dim": hd,
                                       "layers.*.mixer.n_heads": heads, "layers.*.mixer.n_kv_heads": kv,
                                       "layers.local.mixer.window": 3} if tiny else {})})
    attn = gemma.layer(0).mixer.build(d_model=gemma.d_model, layer=gemma.layer(0), spec=gemma).to(**mk)
    aseq = seq if tiny else 8192  # longer than Gemma 2's 4096 window
    idx = torch.arange(aseq, device=dev)
    qa = torch.randn(1, attn.n_heads, aseq, attn.head_dim, **mk, requires_grad=not tiny)
    ka = torch.randn(1, attn.n_kv_heads, aseq, attn.head_dim, **mk, requires_grad=not tiny)
    va = torch.randn(1, attn.n_kv_heads, aseq, attn.head_dim, **mk, requires_grad=not tiny)
    cases.append(("attention (softcap+window)", f"q {tuple(qa.shape)}, window {attn.window}", "attention:flex",
                  lambda q, k, v: attn.attend(q, k, v, idx, idx), [qa, ka, va]))

    # Long context as training runs it: every step has new slot tensors (and, with padding, a new
    # key mask), so the masks are looked up or rebuilt per step, not built once outside the timing.
    lseq = 2 * seq if tiny else a.long
    lq = torch.randn(1, attn.n_heads, lseq, attn.head_dim, **mk, requires_grad=not tiny)
    lk = torch.randn(1, attn.n_kv_heads, lseq, attn.head_dim, **mk, requires_grad=not tiny)
    lv = torch.randn(1, attn.n_kv_heads, lseq, attn.head_dim, **mk, requires_grad=not tiny)

    def per_step(padded):
        def run(q, k, v):
            slots = torch.arange(lseq, device=dev)
            key_mask = None
            if padded:
                key_mask = torch.ones(1, lseq, dtype=torch.bool, device=dev)
                key_mask[:, : lseq // 8] = False  # left padding
            return attn.attend(q, k, v, slots, slots, key_mask)
        return run

    for padded in (False, True):
        cases.append((f"attention long{' padded' if padded else ''} (masks per step)",
                      f"q {tuple(lq.shape)}, window {attn.window}", "attention:flex", per_step(padded), [lq, lk, lv]))

    # The chunked scalar-decay recurrence of linear / lightning attention (and Mamba-2's SSD core):
    # MiniMax-Text-01's head width 128, a 4k sequence, data-dependent log-decays.
    rheads = heads if tiny else 16
    shape = (batch, rheads, seq, hd)
    rq, rk, rv = (torch.randn(*shape, **mk).mul(hd ** -0.5).requires_grad_() for _ in range(3))
    ra = (-torch.rand(batch, rheads, seq, device=dev) * 0.1).requires_grad_()
    cases.append(("scalar_decay (chunked recurrence)", f"q {shape}", "scalar_decay:triton", _scalar_decay(),
                  [rq, rk, rv, ra]))

    # The chunked gated delta rule of Gated DeltaNet at Qwen3-Next's head widths (Dk = Dv = 128, two
    # value heads per key head), a 4k sequence, against the PyTorch chunked form (in fp32, as the
    # mixer runs it; the kernel takes the inputs in the benchmark's dtype: TF32 products for 16-bit).
    from zoo.components.mixers.gated_deltanet import l2norm
    for gb, gh in ((1, 4) if tiny else (1, 16), (2, 8) if tiny else (4, 32)):
        gd = hd if tiny else 128
        unit = lambda *s: l2norm(torch.randn(*s, device=dev)).to(dtype)  # noqa: E731
        gq = (unit(gb, gh // 2, seq, gd) * gd ** -0.5).requires_grad_()
        gk = unit(gb, gh // 2, seq, gd).requires_grad_()
        gv = torch.randn(gb, gh, seq, gd, **mk, requires_grad=True)
        gg = (-torch.rand(gb, gh, seq, device=dev) * 0.5).to(dtype).requires_grad_()
        gbeta = torch.rand(gb, gh, seq, **mk).requires_grad_()
        cases.append((f"gated_delta (chunked, B={gb} H={gh})", f"v {tuple(gv.shape)}, {gh // 2} key heads",
                      "gated_delta:triton", _gated_delta(), [gq, gk, gv, gg, gbeta]))
    return cases


def _gated_delta():
    from zoo.components.mixers import gated_deltanet as gdn
    from zoo.components.kernels import gated_deltanet as fast

    def run(q, k, v, g, beta):
        if kernels.setting_for("gated_delta") == "triton":
            return fast.chunk_gated_delta_rule(q, k, v, g, beta)
        return gdn.chunk_gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)))

    return run


def _scalar_decay():
    from zoo.components.mixers import _recurrent as recurrent
    from zoo.components.kernels import recurrent as fast

    def run(q, k, v, a):
        if kernels.setting_for("scalar_decay") == "triton":
            return fast.chunked(q, k, v, a)
        return recurrent.chunked(q, k, v, a)

    return run


def _glu_product(ffn):
    from zoo.components.kernels.glu import gated_product

    def product(g, u):
        if kernels.setting_for("glu") == "triton":
            return gated_product(g, u, ffn.act.fused_name)
        return ffn.act(g) * u

    return product


def _loss(labels):
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    def loss(h, w):
        if kernels.setting_for("loss") == "triton":
            return fused_linear_cross_entropy(h, w, labels)[0]
        return lm_loss(F.linear(h, w), labels).loss

    return loss


def run_kernels(a, bench, dtype, only, rows=None):
    rows = [] if rows is None else rows
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for name, shape, setting, ref, inputs in kernel_cases(a, bench.device, dtype):
        key = name.split()[0]
        if only and key not in only:
            continue
        print(f"{name}  {shape}")
        fast = with_setting(setting, ref)
        eager = with_setting("off", ref)
        err = compare(name, fast, eager, inputs, tol)
        row = {"kernel": name, "shape": shape, "max_rel_error": err}
        variants = [("eager", eager), ("zoo", fast)]
        if not a.no_compile:
            variants.insert(1, ("compile", torch.compile(ref)))
        for label, fn in variants:
            t, peak = bench.measure(fwd_bwd(fn, inputs))
            row[f"{label}_ms"], row[f"{label}_peak_mb"] = t * 1e3, None if peak is None else peak / 2**20
            with torch.no_grad():
                row[f"{label}_fwd_ms"] = bench.measure(lambda: fn(*inputs))[0] * 1e3
        row["speedup_vs_eager"] = row["eager_ms"] / row["zoo_ms"]
        row["fwd_speedup_vs_eager"] = row["eager_fwd_ms"] / row["zoo_fwd_ms"]
        if "compile_ms" in row:
            row["speedup_vs_compile"] = row["compile_ms"] / row["zoo_ms"]
        if row["zoo_peak_mb"] is not None:
            row["memory_vs_eager"] = row["zoo_peak_mb"] / max(row["eager_peak_mb"], 1e-9)
        rows.append(row)
        print("  " + "  ".join(f"{k}={v:.3g}" for k, v in row.items() if isinstance(v, float)))
        torch.cuda.empty_cache() if bench.cuda else None
    return rows


def run_training(a, bench, dtype):
    """Tokens/s of forward + backward + AdamW on a Llama-3-8B-shaped model, fast paths off and on."""
    dev = bench.device
    over = {"n_layers": a.layers, "vocab_size": a.vocab}
    if a.dry_run:
        over.update({"d_model": 64, "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2,
                     "layers.*.ffn.d_ff": 160})
    model = zoo.build("llama3-8b", device=dev, dtype=torch.float32, seed=0, **over)  # fp32 master weights
    seq = min(a.seq, 8) if a.dry_run else a.seq
    batch = max(1, a.tokens // seq)
    ids = torch.randint(0, a.vocab, (batch, seq), device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if bench.cuda else {}))
    mixed = dtype != torch.float32
    print(f"training step: llama3-8b shape, {a.layers} layers, {model.num_parameters():,} parameters, "
          f"batch {batch} x {seq}, fp32 weights" + (f" under {dtype} autocast" if mixed else ""))
    print(kernels.format_table(kernels.backend_table(model, dtype=dtype)))

    def forward(setting, loss_fn=None):
        with kernels.using(setting), torch.autocast(dev.type, dtype=dtype, enabled=mixed):
            return (loss_fn or (lambda: model.loss(ids).loss))()

    fast_setting = "triton" if a.dry_run else None  # auto picks the fast paths on CUDA; the CPU has to force them
    with torch.no_grad():
        ref, fast = forward("off"), forward(fast_setting)
    err = float((fast - ref).abs() / ref.abs())
    tol = 2e-5 if not mixed else 2e-2
    print(f"  check training loss             relative error {err:.2e}  (tolerance {tol:g})")
    if not err <= tol:
        raise SystemExit(f"training step: the fast paths' loss {float(fast):.6g} disagrees with the reference's "
                         f"{float(ref):.6g}; nothing was timed.")

    def step_with(setting, loss_fn=None):
        def step():
            loss = forward(setting, loss_fn)
            loss.backward()  # outside autocast, as in zoo.train
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    variants = [("eager", step_with("off")), ("zoo", step_with(fast_setting))]
    if not a.no_compile:  # the reference compiled, and compiled with the fast paths that stay on there (the loss)
        compiled = torch.compile(lambda: model.loss(ids).loss)
        compiled_fast = torch.compile(lambda: model.loss(ids).loss)
        variants[1:1] = [("compile", step_with("off", compiled)), ("compile_zoo", step_with(fast_setting, compiled_fast))]
    row = {"model": f"llama3-8b x{a.layers} layers", "tokens_per_step": batch * seq}
    for label, step in variants:
        t, peak = bench.measure(step)
        row[f"{label}_tokens_per_s"] = batch * seq / t
        row[f"{label}_peak_gb"] = None if peak is None else peak / 2**30
    row["speedup_vs_eager"] = row["zoo_tokens_per_s"] / row["eager_tokens_per_s"]
    print("  " + "  ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))
    return row


def targets(rows, train, dry_run=False):
    by = {r["kernel"]: r for r in rows}
    out = []
    if "rmsnorm" in by:
        out.append(("RMSNorm speed-up vs eager", by["rmsnorm"]["speedup_vs_eager"], ">=", 3.0))
    loss = by.get("loss (linear + CE)")
    if loss and loss.get("memory_vs_eager") is not None:
        out.append(("fused loss peak memory / eager", loss["memory_vs_eager"], "<=", 0.25))
    if train:
        out.append(("training step tokens/s vs eager", train["speedup_vs_eager"], ">=", 1.2))
    print("\ntargets (H200):")
    for name, value, op, goal in out:
        ok = value >= goal if op == ">=" else value <= goal
        verdict = "dry run: not a measurement" if dry_run else ("met" if ok else "NOT met")
        print(f"  {name:<34} {value:6.3f}  (target {op} {goal})  {verdict}")
    return [{"target": n, "value": v, "goal": f"{o} {g}"} for n, v, o, g in out]


def main(a):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.dry_run:
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        dev, dtype, a.tokens, a.vocab = "cpu", torch.float32, 16, 300  # the interpreter has no bf16
        a.layers = min(a.layers, 2)
    elif not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA device (or --dry-run to exercise it on the CPU)")
    else:
        dev = "cuda"
    bench = Bench(dev, a.repeats, max(a.warmup, 2))
    name = torch.cuda.get_device_name() if bench.cuda else "cpu (dry run: Triton interpreter, numbers mean nothing)"
    print(f"device: {name}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"kernels: {kernels.available()}")
    only = set(a.only.split(",")) if a.only else None
    result = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "dtype": str(dtype), "kernels": [], "train": None, "targets": []}

    def write():  # after each measurement too
        write_results(result, a.json, a.markdown, markdown)

    class Rows(list):
        def append(self, row):
            super().append(row)
            write()

    result["kernels"] = rows = Rows()
    run_kernels(a, bench, dtype, only, rows)
    result["train"] = run_training(a, bench, dtype) if not only or "train" in only else None
    result["targets"] = targets(rows, result["train"], a.dry_run)
    write()
    return result


def markdown(result):
    """The results as markdown: one row per kernel (ratios to eager), the training step, the targets."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"{result['device']}, torch {result['torch']}, {result['date']}, {result['dtype']}", "",
             "| kernel | shape | max error / max ref | speed-up vs eager (fwd+bwd) | fwd | vs compile | peak memory / eager |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["kernels"]:
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['max_rel_error']:.1e} | {num(r['speedup_vs_eager'], '.2f')} | "
                     f"{num(r['fwd_speedup_vs_eager'], '.2f')} | {num(r.get('speedup_vs_compile'), '.2f')} | "
                     f"{num(r.get('memory_vs_eager'), '.2f')} |")
    if result["train"]:
        t = result["train"]
        lines += ["", f"Training step ({t['model']}, {t['tokens_per_step']} tokens): {t['speedup_vs_eager']:.2f}x eager's tokens/s"]
        if "compile_zoo_tokens_per_s" in t:
            lines[-1] += (f"; compiled {t['compile_tokens_per_s'] / t['eager_tokens_per_s']:.2f}x eager, "
                          f"{num(t['compile_peak_gb'], '.1f')} GB; compiled with the fused loss "
                          f"{t['compile_zoo_tokens_per_s'] / t['eager_tokens_per_s']:.2f}x eager, "
                          f"{num(t['compile_zoo_peak_gb'], '.1f')} GB")
    if result["targets"]:
        lines += ["", "| target | value | goal |", "|---|---:|---|"]
        lines += [f"| {t['target']} | {t['value']:.3f} | {t['goal']} |" for t in result["targets"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(ARGS)
