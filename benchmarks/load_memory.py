"""Peak memory of loading a checkpoint: zoo.from_pretrained beside transformers' from_pretrained.

Each loader runs in its own subprocess, so each peak RSS is clean (Linux: the peak is reset after
imports through /proc/self/clear_refs and read from VmHWM). The growth of peak RSS over the
process's state after imports (every weight touched once, as a first forward would) is reported
as a multiple of the checkpoint's size on disk. zoo builds on the meta device and
reads each tensor into its own buffer, so it should stay near 1x.

    python benchmarks/load_memory.py                 # makes a ~400 MB llama-shaped checkpoint
    python benchmarks/load_memory.py PATH [--dtype bfloat16]
    python benchmarks/load_memory.py --fp8 --dtype bfloat16   # the same, its projections block-scaled fp8
    python benchmarks/load_memory.py --moe --fp8 --dtype bfloat16   # a qwen3_moe whose routed experts dominate

With ``--fp8`` the made checkpoint is quantised as DeepSeek-V3 ships (float8_e4m3fn projections with
a float32 scale per 128 x 128 block, everything else bf16), and both loaders dequantise it on load;
a third row loads it with ``fp8="keep"`` (the projections, routed experts included, stay FP8 beside
their scales). ``--moe`` makes a ~440 MB qwen3_moe instead (4 layers of 32 experts, 1024 x 512:
the experts are 94% of its weights), as in DeepSeek-V3, where the routed experts are nearly all of them.
The extra column gives the peak growth beyond the loaded parameters, beside the largest tensor:
dequantising tensor by tensor, zoo should need about one model in the target dtype plus one tensor.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import gc, json, sys, torch
dtype = getattr(torch, sys.argv[3]) if sys.argv[3] != "auto" else None
# Each loader first builds the model on the meta device once, so the modules it imports on the
# way (the modeling code, kernels) are not counted as weight memory.
if sys.argv[1].startswith("zoo"):
    import zoo
    from zoo.checkpoints import config_to_spec, read_config
    zoo.build_model(config_to_spec(read_config(sys.argv[2])), device="meta")
    fp8 = "keep" if sys.argv[1] == "zoo-fp8-keep" else "dequantize"
    load = lambda p: zoo.from_pretrained(p, dtype=dtype, fp8=fp8)
else:
    import transformers
    transformers.utils.logging.disable_progress_bar()
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(sys.argv[2]))
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=dtype or "auto")
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
peak = lambda: status("VmHWM")
model = load(sys.argv[2])
# Memory-mapped weights are paged in on first use: touch every one, as a first forward would.
with torch.no_grad():
    for p in model.parameters():
        (p.view(torch.uint8).max() if p.element_size() == 1 else p.sum())  # float8 has no sum; max makes no wider copy
n = sum(p.numel() * p.element_size() for p in model.parameters())
largest = max(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "after": peak(), "param_bytes": n, "largest": largest}))
"""


LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
         "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
MOE = {"model_type": "qwen3_moe", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048,
       "moe_intermediate_size": 512, "num_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 2048,
       "tie_word_embeddings": False}


def make_checkpoint(directory: Path, config: dict) -> None:
    import zoo
    from zoo.checkpoints import config_to_spec

    model = zoo.build_model(config_to_spec(config), seed=0)
    zoo.save_pretrained(model, directory, model_type=config["model_type"], max_shard_size="150MB")


def quantize_fp8(src: Path, dst: Path, block: int = 128) -> None:
    """``src`` with every layer projection block-scaled fp8 (scale = amax / 448 per block) and the rest bf16."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(src / file).items():
            if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
                out[name] = t.to(torch.bfloat16)
                continue
            rows, cols = t.shape  # multiples of the block here
            blocks = t.reshape(rows // block, block, cols // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            out[name] = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
            out[name + "_scale_inv"] = scale
            index["weight_map"][name + "_scale_inv"] = file
        save_file(out, str(dst / file), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def measure(loader: str, path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, loader, str(path), dtype], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{loader} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", help="checkpoint directory (default: make one)")
    ap.add_argument("--dtype", default="auto", help="dtype to load in (default: as stored)")
    ap.add_argument("--fp8", action="store_true", help="quantise the made checkpoint to block-scaled fp8")
    ap.add_argument("--moe", action="store_true", help="make a qwen3_moe checkpoint (routed experts) instead of a llama")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.path) if args.path else Path(tmp) / "ckpt"
        if not args.path:
            make_checkpoint(path, MOE if args.moe else LLAMA)
        if args.fp8 and not args.path:
            quantize_fp8(path, Path(tmp) / "fp8")
            path = Path(tmp) / "fp8"
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        print(f"checkpoint {path}: {size / 2**20:.0f} MiB of safetensors; loading in {args.dtype}")
        loaders = ("zoo", "transformers") + (("zoo-fp8-keep",) if args.fp8 else ())
        rows = {name: measure(name, path, args.dtype) for name in loaders}
    print(f"{'loader':<14} {'peak RSS growth':>16} {'x checkpoint':>13} {'x loaded params':>16} "
          f"{'beyond params':>14} {'largest tensor':>15}")
    for name, r in rows.items():
        grow = r["after"] - r["before"]
        print(f"{name:<14} {grow / 2**20:>12.0f} MiB {grow / size:>13.2f} {grow / r['param_bytes']:>16.2f} "
              f"{(grow - r['param_bytes']) / 2**20:>10.0f} MiB {r['largest'] / 2**20:>11.0f} MiB")
    z, t = (rows[n]["after"] - rows[n]["before"] for n in ("zoo", "transformers"))
    print(f"zoo / transformers peak growth: {z / t:.2f}")


if __name__ == "__main__":
    main()
