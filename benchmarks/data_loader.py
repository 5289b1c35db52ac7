"""The prepared-data path on this machine: loader throughput against what a training step consumes,
the loader's peak RSS as the corpus grows, and ``zoo data prepare``'s throughput against the
tokenizer's own batch encoding.

    python benchmarks/data_loader.py                        # all three, a 100 MB and a 5 GB corpus
    python benchmarks/data_loader.py --sizes 100e6 1e9      # other corpus sizes (bytes of tokens)
    python benchmarks/data_loader.py --only prepare --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf

- loader: shards of random uint16 tokens in documents of 50-2000 tokens are written directly (a
  manifest like prepare's), then a fresh process reads 200 batches of (4, 512) with packing =
  "documents" at random positions. Reported: samples/s of the loader, and the ratio to the samples/s
  one training step of a SmolLM2-135M-shaped model (d 576, 30 layers; batch 4 x 512) consumes on this machine, both
  measured here; the process's peak RSS for each corpus size (the loader memory-maps, so it should not
  grow with the corpus).
- prepare: the Python standard-library sources as JSONL documents, through prepare with 2 worker
  processes, against ``tokenizers``' own ``encode_batch`` of the same texts in this process (the
  bound); the ratio, and the bytes on disk per token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_corpus(out: Path, n_bytes: float, vocab: int = 49152, shard_tokens: int = 1 << 26, seed: int = 0) -> None:
    from zoo.training.shards import FORMAT

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    total, shards, n = int(n_bytes) // 2, [], 0
    while n < total:
        count = min(shard_tokens, total - n)
        name = f"shard-{len(shards):05d}"
        rng.integers(0, vocab, count, dtype=np.uint16).tofile(out / f"{name}.bin")
        lengths = rng.integers(50, 2000, count // 50 + 2)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        starts = np.concatenate([starts[starts < count], [count]])
        index = np.zeros((len(starts), 3), dtype=np.int64)
        index[:, 0] = starts
        np.save(out / f"{name}.idx.npy", index)
        shards.append({"bin": f"{name}.bin", "idx": f"{name}.idx.npy", "tokens": count, "documents": len(starts) - 1})
        n += count
    manifest = {"format": FORMAT, "tokenizer": {"kind": "synthetic", "fingerprint": "synthetic", "vocab_size": vocab,
                                                "bos": None, "eos": None},
                "sources": [{"path": "synthetic", "bytes": int(n_bytes), "hash": ""}], "dtype": "uint16",
                "masked": False, "documents": sum(s["documents"] for s in shards), "tokens": n, "dropped": 0,
                "shards": shards}
    (out / "manifest.json").write_text(json.dumps(manifest))


def read_batches(path: str, seq_len: int = 512, batch: int = 4, batches: int = 200) -> dict:
    """In a fresh process: the loader's samples/s and this process's peak RSS."""
    from zoo.training.loader import open_sources

    stream = open_sources([{"path": path}], None, seq_len, packing="documents", sft=False, seed=0)
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    for _ in range(batches):
        stream.batch(int(rng.integers(0, 10 * stream.n_samples)), batch)
    dt = time.perf_counter() - t0
    # VmHWM: this process image's peak (ru_maxrss would carry the parent's peak across fork and exec)
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return {"samples_per_s": batches * batch / dt, "peak_rss_mb": hwm / 1024}


def step_samples_per_s(seq_len: int = 512, batch: int = 4) -> float:
    """Samples/s one training step (forward, backward, AdamW) of a SmolLM2-135M-shaped model consumes here."""
    import torch

    import zoo
    from zoo.model.decoder import build_model
    from zoo.model.recipes import get_spec

    spec = get_spec("llama3-8b", {"n_layers": 30, "d_model": 576, "layers.*.mixer.n_heads": 9,
                                  "layers.*.mixer.n_kv_heads": 3, "layers.*.ffn.d_ff": 1536, "vocab_size": 49152,
                                  "max_seq_len": seq_len})
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 49152, (batch, seq_len))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    del zoo
    return batch / times[-1]


def prepare_ratio(tokenizer: str | None, workers: int = 2) -> dict:
    from zoo.training.data import STDLIB_MODULES, get_tokenizer
    from zoo.training.shards import prepare
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.py"))[:300]]
    tok = get_tokenizer(tokenizer)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        t0 = time.perf_counter()
        m = prepare([src], Path(d) / "out", tok, workers=workers, progress=False)
        ours = time.perf_counter() - t0
        on_disk = sum((Path(d) / "out" / s[k]).stat().st_size for s in m["shards"] for k in ("bin", "idx"))
    t0 = time.perf_counter()
    if hasattr(tok, "tok"):
        tok.tok.encode_batch(texts, add_special_tokens=False)
    else:
        [list(t.encode()) for t in texts]
    bound = time.perf_counter() - t0
    return {"documents": len(texts), "tokens": m["tokens"], "prepare_s": ours, "encode_batch_s": bound,
            "ratio_prepare_over_encode_batch": ours / bound, "bytes_on_disk_per_token": on_disk / m["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[100e6, 5e9])
    ap.add_argument("--only", choices=["loader", "prepare"])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--read", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.read:
        print(json.dumps(read_batches(args.read)))
        return
    if args.only != "prepare":
        step = step_samples_per_s()
        print(f"one training step (SmolLM2-135M shape, 4 x 512): {step:.2f} samples/s", flush=True)
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
            for size in args.sizes:
                path = Path(d) / f"c{int(size)}"
                write_corpus(path, size)
                out = subprocess.run([sys.executable, __file__, "--read", str(path)], capture_output=True, text=True,
                                     check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"corpus {size / 1e6:,.0f} MB: loader {r['samples_per_s']:,.0f} samples/s = "
                      f"{r['samples_per_s'] / step:,.0f}x a training step; peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
                for f in path.iterdir():
                    f.unlink()
    if args.only != "loader":
        r = prepare_ratio(args.tokenizer)
        print(f"prepare ({r['documents']} documents, {r['tokens']:,} tokens, 2 processes): {r['prepare_s']:.2f} s; "
              f"tokenizer encode_batch: {r['encode_batch_s']:.2f} s; ratio {r['ratio_prepare_over_encode_batch']:.2f}; "
              f"{r['bytes_on_disk_per_token']:.2f} bytes on disk per token")


if __name__ == "__main__":
    main()
