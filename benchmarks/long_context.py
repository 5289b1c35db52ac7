"""Peak memory and time of one forward at long context, FlexAttention masks before and after.

A Gemma-2-shaped model at tiny widths (a local layer with the real 4096-token window and a
global layer, soft-capped scores, so FlexAttention runs both) does one forward of one sequence
at 4k, 16k and 32k tokens on the CPU, with the compiled FlexAttention kernel (so the attention
itself never holds T x T scores and what differs is the masks):

- before: the block mask as it was built up to this change, by eager ``create_block_mask`` over
  the whole T x T mask, rebuilt on every forward (its cache was keyed on the slot tensor, new
  each forward);
- after: zoo's block mask built from per-block slot bounds and cached per shape.

Each (path, length) runs in its own process after a warm-up forward of the same length (kernel
compilation, the first mask build); the peak resident memory of the measured forward above the
memory before it (VmHWM reset through /proc/self/clear_refs; Linux) and its time are reported,
and after/before as ratios. Absolute times on a shared machine are noise; read the ratios.

    python benchmarks/long_context.py                    # 4096,16384,32768
    python benchmarks/long_context.py --lengths 4096 --padding
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time, warnings
import torch
warnings.filterwarnings("ignore")
import zoo
from zoo.core import kernels
from zoo.components.kernels import attention as flex

path, T, padding = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
torch.manual_seed(0)
model = zoo.build("gemma2-2b", n_layers=2, d_model=64, vocab_size=256, seed=0, overrides={
    "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.mixer.head_dim": 16,
    "layers.*.ffn.d_ff": 128}).eval()
flex._kernel = lambda device: flex._flex()  # the fused kernel on the CPU too (forward only)


def old_flex_attend(module, q, k, v, q_idx, k_idx, key_mask=None, bias=None):
    # The path up to this change: a dense (B, 1, Tq, Tk) mask with padding, and create_block_mask
    # over T x T, cached on the identity of the slot tensors (new every forward).
    from torch.nn.attention.flex_attention import create_block_mask
    from zoo.components.mixers._masks import causal_mask
    window, cap = module.window, module.cfg.softcap
    flex.builds += 1
    if key_mask is not None:
        allowed = causal_mask(q_idx, k_idx, window, key_mask)
        mask = create_block_mask(lambda b, h, qi, ki: allowed[b, 0, qi, ki], q.shape[0], None, len(q_idx), len(k_idx))
    else:
        def mask_mod(b, h, qi, ki):
            qq, kk = q_idx[qi], k_idx[ki]
            ok = kk <= qq
            return ok & (qq - kk < window) if window is not None else ok
        mask = create_block_mask(mask_mod, None, None, len(q_idx), len(k_idx), device=q.device)
    score_mod = (lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)) if cap is not None else None
    return flex._kernel(q.device)(q, k, v, score_mod=score_mod, block_mask=mask, scale=module.scale,
                                  enable_gqa=module.n_kv_heads != module.n_heads)


if path == "before":
    flex.flex_attend = old_flex_attend
    kernels.refresh()
B = 2 if padding else 1
ids = torch.randint(0, 256, (B, T))
mask = torch.ones(B, T, dtype=torch.long)
if padding:
    mask[0, : T // 4] = 0  # left padding


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


with torch.no_grad(), kernels.using("attention:flex"):
    model(ids, attention_mask=mask if padding else None)  # warm-up: compilation, the first build
    builds = flex.builds
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    t = time.perf_counter()
    model(ids, attention_mask=mask if padding else None)
    seconds = time.perf_counter() - t
print(json.dumps({"peak_bytes": status("VmHWM") - before, "seconds": seconds, "rebuilds": flex.builds - builds}))
"""


def available_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run(path: str, T: int, padding: bool) -> dict | None:
    done = subprocess.run([sys.executable, "-c", CHILD, path, str(T), "1" if padding else "0"],
                          capture_output=True, text=True)
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384,32768")
    p.add_argument("--padding", action="store_true", help="a batch of 2 with left padding (data-dependent masks)")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    rows = []
    print(f"{'tokens':>7} {'path':<7} {'peak MiB':>9} {'seconds':>8} {'rebuilds':>8}")
    for T in map(int, a.lengths.split(",")):
        row = {"tokens": T, "padding": a.padding}
        need = 12 * T * T * (2 if a.padding else 1)  # the old path's T x T build, about 10 bytes a pair
        for path in ("before", "after"):
            if path == "before" and need > available_bytes() - 8 * 2**30:
                print(f"{T:>7} {path:<7} skipped: needs about {need / 2**30:.0f} GiB and would leave under 8 GiB free")
                continue
            r = run(path, T, a.padding)
            if r is None:
                print(f"{T:>7} {path:<7} failed (see above)")
                continue
            row[path] = r
            print(f"{T:>7} {path:<7} {r['peak_bytes'] / 2**20:>9.0f} {r['seconds']:>8.2f} {r['rebuilds']:>8}")
        if "before" in row and "after" in row:
            b, f = row["before"], row["after"]
            row["memory_after_over_before"] = f["peak_bytes"] / max(b["peak_bytes"], 1)
            row["time_after_over_before"] = f["seconds"] / b["seconds"]
            print(f"{T:>7} after/before: peak memory {row['memory_after_over_before']:.3f}, "
                  f"time {row['time_after_over_before']:.3f}")
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return {"rows": rows}


if __name__ == "__main__":
    main()
