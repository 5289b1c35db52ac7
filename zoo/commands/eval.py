"""``zoo eval MODEL --text FILE``: perplexity and bits per byte on text, with a sliding window;
``zoo eval MODEL --data DIR``: the loss on a prepared corpus (``zoo data prepare``)."""

import argparse
import glob
import json
import sys
from pathlib import Path

from zoo.commands import add_device, device_of


def add_parser(sub):
    p = sub.add_parser(
        "eval", help="perplexity and bits per byte of a model on text files (sliding window)",
        description="Tokenize each text file with the checkpoint's tokenizer, score it in windows of --window tokens "
                    "that advance by --stride (Hugging Face's strided-perplexity recipe: each token is scored once, "
                    "with at least window - stride tokens of context once the text is longer than a window), and "
                    "report perplexity and bits per UTF-8 byte per file and over all files.")
    p.add_argument("checkpoint", help="checkpoint directory, hub repo id or GGUF file")
    p.add_argument("--text", action="append", metavar="FILE_OR_GLOB",
                   help="a text file or a glob of them (may repeat)")
    p.add_argument("--data", metavar="PREPARED_DIR",
                   help="a prepared corpus (zoo data prepare, with this model's tokenizer): the mean next-token "
                        "cross-entropy and perplexity over its sequences of --window tokens, documents packed with "
                        "their own positions and attention")
    p.add_argument("--batch", type=int, default=4, help="sequences per forward with --data (default 4)")
    p.add_argument("--max-sequences", type=int, default=None, help="with --data: score at most this many sequences")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: min(1024, max_seq_len))")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens a window advances (default: the window, so each token is computed once, as "
                        "lm-eval's rolling perplexity does; a smaller stride gives later windows more context "
                        "at window/stride times the work)")
    p.add_argument("--dtype", default=None, help="load weights as this dtype (default as stored; GGUF: float32)")
    add_device(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar on stderr with tokens/s and the time left (default: on)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def read_text(path: Path) -> str:
    """A text file's text; an empty or non-UTF-8 (binary) one is a ValueError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                         "is it a binary file?") from None
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


def run(args):
    import torch

    from zoo.checkpoints import from_pretrained, open_source
    from zoo.tools.evaluation import perplexity
    from zoo.inference.tokenizer import Tokenizer

    if bool(args.text) == bool(args.data):
        raise ValueError("zoo eval: give --text FILES or --data PREPARED_DIR (one of them)")
    if args.data:
        return _run_prepared(args)
    files = []
    for pattern in args.text:
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not found:
            raise FileNotFoundError(f"--text {pattern!r} matches no file")
        files += [Path(f) for f in found]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"--text {f}: no such file")
    for name, value in (("window", args.window), ("stride", args.stride)):
        if value is not None and value < (2 if name == "window" else 1):
            raise ValueError(f"--{name} must be at least {2 if name == 'window' else 1}, got {value}")
    texts = {f: read_text(f) for f in files}
    source = open_source(args.checkpoint)
    tokenizer = Tokenizer(source)
    model = from_pretrained(source, dtype=args.dtype, device=device_of(args.device), progress=False)
    window = args.window or min(1024, model.spec.max_seq_len)
    stride = args.stride or window
    if stride > window:
        raise ValueError(f"--stride {stride} is longer than the window {window}")
    encoded = {}
    for f, text in texts.items():
        encoded[f] = tokenizer.encode(text)
        if len(encoded[f]) < 2:
            raise ValueError(f"--text {f}: the text is {len(encoded[f])} token(s) long; perplexity needs at least two")
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(len(ids) for ids in encoded.values()), unit="tok", unit_scale=True, desc="eval",
               disable=not args.progress, dynamic_ncols=True, file=sys.stderr)
    rows, nll, n_bytes = [], [], 0
    with bar:
        for f, ids in encoded.items():
            r = perplexity(model, ids, window=window, stride=stride, progress=bar.update)
            size = len(texts[f].encode("utf-8"))
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


def _run_prepared(args):
    import math

    import torch
    from tqdm.auto import tqdm

    from zoo.checkpoints import from_pretrained, resolve
    from zoo.checkpoints.files import gguf
    from zoo.inference.tokenizer import Tokenizer
    from zoo.training.loader import Ordered, Source
    from zoo.training.shards import Prepared

    source = args.checkpoint if gguf.is_gguf(args.checkpoint) else resolve(args.checkpoint)
    tokenizer = Tokenizer(source)
    corpus = Prepared(args.data, tokenizer)
    model = from_pretrained(source, dtype=args.dtype, progress=False).eval()
    window = args.window or min(1024, model.spec.max_seq_len)
    documents = all(layer.mixer.documents for layer in model.layers) and model.mtp is None
    data = Ordered([Source(corpus, window, packing="documents" if documents else "plain", sft=False)])
    n = data.n_samples if args.max_sequences is None else min(data.n_samples, args.max_sequences)
    total, count = 0.0, 0
    with torch.no_grad(), tqdm(total=n, desc="eval", unit="seq", dynamic_ncols=True) as bar:
        for a in range(0, n, args.batch):
            b = data.batch(a, min(args.batch, n - a))
            out = model(b.ids, labels=b.labels, **({"document_ids": b.documents} if b.documents is not None else {}))
            counted = int((b.labels[:, 1:] != -100).sum())
            total += float(out.ce) * counted
            count += counted
            bar.update(len(b.ids))
            bar.set_postfix(loss=f"{total / max(count, 1):.4f}")
    ce = total / max(count, 1)
    summary = {"data": str(args.data), "sequences": n, "tokens": count, "loss": ce, "perplexity": math.exp(ce),
               "window": window, "packing": "documents" if documents else "plain"}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{args.data}: loss {ce:.4f}, perplexity {math.exp(ce):.4f} over {count:,} tokens "
              f"({n} sequences of {window})")
    return 0
