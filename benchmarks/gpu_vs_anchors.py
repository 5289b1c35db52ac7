"""zoo's kernels beside the libraries they are measured against, at the same shapes, in one run:
flash-linear-attention's ``chunk_gated_delta_rule`` (Qwen3-Next's Gated DeltaNet heads), and
Liger-Kernel's RMSNorm and fused linear cross-entropy (Llama-3-8B's widths and vocabulary), each
with eager PyTorch too. Forward + backward in bf16, median time from ``triton.testing.do_bench``
and peak memory above the inputs; the largest difference of zoo's outputs and gradients from the
anchor's, relative to the anchor's largest element, is printed beside (a check, not a target).

The lent GPU machine has no network: the anchors travel as wheels (pure Python, about 2 MB) in
``.whl/``, an ignored folder, fetched beforehand where PyPI is reachable::

    echo /.whl/ >> .git/info/exclude
    pip download --no-deps -d .whl fla-core liger-kernel     # fla-core: flash-linear-attention's kernels
    # there: pip install --no-index --no-deps --target /tmp/anchors .whl/*.whl  (gpu_check.sh does it)

    python3 benchmarks/gpu_vs_anchors.py --json anchors.json --markdown anchors.md
    python3 benchmarks/gpu_vs_anchors.py --dry-run      # CPU, tiny shapes, interpreter: the script runs

An anchor that is not installed is reported as missing, and the others still run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--only", default=None, help="comma-separated subset of: gated_delta,rmsnorm,loss")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per call (default 8192)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--markdown", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    return args


ARGS = parse_args() if __name__ == "__main__" else None

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers beside this script
from timing import write_results  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def anchor(module, name):
    """``module.name``, or None with the reason when the anchor is not installed."""
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name), None
    except Exception as e:  # not installed, or not importable with this torch/Triton
        return None, f"{module}.{name}: {type(e).__name__}: {str(e)[:160]}"


def cases(tokens, dev, dtype):
    """``(name, shape, make_inputs, {label: fn})``: each fn takes the inputs and returns the tensors
    whose sum of products with fixed random weights is differentiated."""
    from zoo.components.kernels import cross_entropy, gated_deltanet, norms
    from zoo.components.mixers import gated_deltanet as gdn

    small = dev == "cpu"
    # Qwen3-Next: 16 key heads, 32 value heads, 128 wide, chunks of 64
    B, Hk, H, D, T = (1, 2, 4, 16, 40) if small else (1, 16, 32, 128, tokens)

    def gdn_inputs():
        g = torch.Generator(device=dev).manual_seed(0)
        q = F.normalize(torch.randn(B, T, Hk, D, device=dev, generator=g), dim=-1)
        k = F.normalize(torch.randn(B, T, Hk, D, device=dev, generator=g), dim=-1)
        v = torch.randn(B, T, H, D, device=dev, generator=g)
        ga = F.logsigmoid(torch.randn(B, T, H, device=dev, generator=g)) / 8
        beta = torch.rand(B, T, H, device=dev, generator=g)
        return [x.to(dtype).requires_grad_() for x in (q, k, v)] + [x.float().requires_grad_() for x in (ga, beta)]

    def heads_first(q, k, v, ga, beta):  # zoo's layout: (B, heads, T, ...), q scaled beforehand
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(q) * D ** -0.5, t(k), t(v), t(ga), t(beta)

    fla, why = anchor("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    gd = {
        "zoo": lambda *xs: gated_deltanet.chunk_gated_delta_rule(*heads_first(*xs), None, 64)[0].transpose(1, 2),
        "eager (zoo's PyTorch form)": lambda *xs: gdn.chunk_gated_delta_rule(*heads_first(*xs), None, 64)[0].transpose(1, 2),
        "fla": (lambda q, k, v, ga, beta: fla(q, k, v, ga, beta, scale=D ** -0.5)[0]) if fla else why,
    }
    yield "gated_delta", f"B={B} T={T} key heads {Hk} value heads {H} dim {D}", gdn_inputs, gd

    n, d, V = (24, 32, 300) if small else (tokens, 4096, 128256)

    def norm_inputs():
        g = torch.Generator(device=dev).manual_seed(1)
        return [torch.randn(n, d, device=dev, generator=g).to(dtype).requires_grad_(),
                (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(dtype).requires_grad_()]

    def eager_rms(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    liger_rms, why = anchor("liger_kernel.transformers.functional", "liger_rms_norm")
    yield "rmsnorm", f"{n} x {d}", norm_inputs, {
        "zoo": lambda x, w: norms.rms_norm(x, w, 1e-6),
        "eager": eager_rms,
        "liger": (lambda x, w: liger_rms(x, w, 1e-6, in_place=False)) if liger_rms else why,
    }

    def loss_inputs():
        g = torch.Generator(device=dev).manual_seed(2)
        h = torch.randn(n, d, device=dev, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(V, d, device=dev, generator=g) * d ** -0.5).to(dtype).requires_grad_()
        labels = torch.randint(0, V, (n,), device=dev, generator=g)
        labels[::7] = -100
        return [h, w, labels]

    liger_ce, why = anchor("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
    yield "loss", f"{n} tokens x {d} -> {V}", loss_inputs, {
        "zoo": lambda h, w, labels: cross_entropy.fused_linear_cross_entropy(h, w, labels)[0],
        "eager": lambda h, w, labels: F.cross_entropy((h @ w.t()).float(), labels),
        "liger": (lambda h, w, labels: liger_ce(h, w, labels)) if liger_ce else why,
    }


def run(fn, inputs, dy):
    """Forward and backward; returns the outputs and the gradients of the differentiable inputs."""
    out = fn(*inputs)
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(out, wrt, dy if out.dim() else None)
    return [out.detach(), *grads]


def timed(fn, inputs, dy, dev):
    """Median milliseconds of forward + backward, and peak memory above the inputs (GiB)."""
    if dev == "cpu":
        start = time.perf_counter()
        run(fn, inputs, dy)
        return 1e3 * (time.perf_counter() - start), None
    import triton.testing

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(fn, inputs, dy)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    ms = triton.testing.do_bench(lambda: run(fn, inputs, dy), warmup=5, rep=40, return_mode="median")
    return ms, peak


def difference(a, b):
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)) for x, y in zip(a, b))


def main(a):
    if a.dry_run:
        dev, dtype = "cpu", torch.float32  # the interpreter has no bf16 products
    elif not torch.cuda.is_available():
        sys.exit("gpu_vs_anchors.py needs a CUDA device (or --dry-run to exercise it on the CPU)")
    else:
        dev, dtype = "cuda", torch.bfloat16
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run: Triton interpreter, numbers mean nothing)"
    result = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "dtype": str(dtype), "rows": [], "missing": []}
    print(f"device: {name}; torch {torch.__version__}")
    only = set(a.only.split(",")) if a.only else None

    def write():  # after each measurement too
        write_results(result, a.json, a.markdown, markdown)

    for kernel, shape, make, fns in cases(a.tokens, dev, dtype):
        if only and kernel not in only:
            continue
        inputs = make()
        probe = fns["zoo"](*inputs)
        g = torch.Generator(device=dev).manual_seed(3)
        dy = torch.randn(probe.shape, device=dev, generator=g).to(probe.dtype) if probe.dim() else None
        del probe
        zoo_out = run(fns["zoo"], inputs, dy)
        for label, fn in fns.items():
            if isinstance(fn, str):  # the anchor is missing: why
                print(f"{kernel:<12} {label:<28} missing: {fn}")
                result["missing"].append({"kernel": kernel, "anchor": label, "why": fn})
                write()
                continue
            try:
                diff = 0.0 if label == "zoo" else difference(zoo_out, run(fn, inputs, dy))
                ms, peak = timed(fn, inputs, dy, dev)
            except Exception as e:  # one failing implementation must not hide the others' numbers
                print(f"{kernel:<12} {label:<28} FAILED: {type(e).__name__}: {str(e)[:300]}")
                result["missing"].append({"kernel": kernel, "anchor": label, "why": f"{type(e).__name__}: {str(e)[:300]}"})
                write()
                continue
            row = {"kernel": kernel, "shape": shape, "impl": label, "ms": ms, "peak_gib": peak, "zoo_vs_this": diff}
            result["rows"].append(row)
            print(f"{kernel:<12} {label:<28} {ms:9.3f} ms  peak {'-' if peak is None else f'{peak:.2f} GiB'}"
                  f"  zoo's max difference {diff:.1e}")
            write()
        del inputs, zoo_out
    write()
    return result


def markdown(result):
    lines = [f"{result['device']}, torch {result['torch']}, {result['date']}, {result['dtype']}", "",
             "| kernel | shape | implementation | fwd+bwd ms | zoo's time / this | peak GiB | zoo's max difference |",
             "|---|---|---|---:|---:|---:|---:|"]
    zoo_ms = {r["kernel"]: r["ms"] for r in result["rows"] if r["impl"] == "zoo"}
    for r in result["rows"]:
        ratio = zoo_ms.get(r["kernel"], float("nan")) / r["ms"]
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['ms']:.3f} | {ratio:.2f} | {peak} | {r['zoo_vs_this']:.1e} |")
    for m in result["missing"]:
        lines.append(f"| {m['kernel']} | | {m['anchor']} | missing | | | {m['why'][:80]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(ARGS)
