"""``zoo eval MODEL --text FILE``: perplexity and bits per byte on text, with a sliding window."""

import glob
import json
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser(
        "eval", help="perplexity and bits per byte of a model on text files (sliding window)",
        description="Tokenize each text file with the checkpoint's tokenizer, score it in windows of --window tokens "
                    "that advance by --stride (Hugging Face's strided-perplexity recipe: each token is scored once, "
                    "with at least window - stride tokens of context once the text is longer than a window), and "
                    "report perplexity and bits per UTF-8 byte per file and over all files.")
    p.add_argument("checkpoint", help="checkpoint directory, hub repo id or GGUF file")
    p.add_argument("--text", required=True, action="append", metavar="FILE_OR_GLOB",
                   help="a text file or a glob of them (may repeat)")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: min(1024, max_seq_len))")
    p.add_argument("--stride", type=int, default=None, help="tokens a window advances (default: half the window)")
    p.add_argument("--dtype", default=None, help="load weights as this dtype (default as stored; GGUF: float32)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def run(args):
    import torch

    from zoo.checkpoints import from_pretrained, open_source
    from zoo.tools.evaluation import perplexity
    from zoo.inference.tokenizer import Tokenizer

    files = []
    for pattern in args.text:
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not found:
            raise FileNotFoundError(f"--text {pattern!r} matches no file")
        files += [Path(f) for f in found]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"--text {f}: no such file")
    source = open_source(args.checkpoint)
    tokenizer = Tokenizer(source)
    model = from_pretrained(source, dtype=args.dtype, progress=False)
    window = args.window or min(1024, model.spec.max_seq_len)
    stride = args.stride or max(1, window // 2)
    rows, nll, n_bytes = [], [], 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        r = perplexity(model, tokenizer.encode(text), window=window, stride=stride)
        size = len(text.encode("utf-8"))
        rows.append({"file": str(f), "tokens": r.tokens, "bytes": size, "perplexity": r.perplexity,
                     "bits_per_byte": r.bits_per_byte(size)})
        nll.append(r.nll)
        n_bytes += size
    total = torch.cat(nll)
    summary = {"tokens": int(total.numel()), "bytes": n_bytes, "perplexity": float(total.mean().exp()),
               "bits_per_byte": float(total.sum()) / 0.6931471805599453 / n_bytes, "window": window, "stride": stride}
    if args.json:
        print(json.dumps({"files": rows, "total": summary}, indent=2))
        return 0
    width = max(len(r["file"]) for r in rows)
    print(f"{'file':<{width}} {'tokens':>8} {'perplexity':>11} {'bits/byte':>10}")
    for r in rows:
        print(f"{r['file']:<{width}} {r['tokens']:>8} {r['perplexity']:>11.4f} {r['bits_per_byte']:>10.4f}")
    if len(rows) > 1:
        print(f"{'all':<{width}} {summary['tokens']:>8} {summary['perplexity']:>11.4f} {summary['bits_per_byte']:>10.4f}")
    print(f"(window {window}, stride {stride})")
    return 0
