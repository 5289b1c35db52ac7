"""``zoo data prepare SOURCES --out DIR``: tokenise text, JSONL, Parquet, Arrow and Hugging Face dataset
directories once into memory-mapped token shards that ``zoo train --data DIR`` reads (see
:mod:`zoo.training.shards`). ``zoo data info DIR`` prints a prepared corpus's manifest."""

import json


def add_parser(sub):
    p = sub.add_parser("data", help="prepare training data: tokenised, memory-mapped shards", description=__doc__)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    prep = verbs.add_parser("prepare", help="tokenise sources into shards (resumable)")
    prep.add_argument("sources", nargs="+", help="text files, .jsonl, .parquet, .arrow files or saved dataset directories")
    prep.add_argument("--out", required=True, help="the directory to write the shards and manifest.json to")
    prep.add_argument("--tokenizer", default=None,
                      help="a tokenizer.json, a checkpoint directory or a GGUF file (the model's); default: bytes")
    prep.add_argument("--workers", type=int, default=2, help="tokenising processes (default 2)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard (default 2^26)")
    prep.add_argument("--max-tokens", type=int, default=None,
                      help="leave out records longer than this many tokens (counted as dropped)")
    prep.add_argument("--text-field", default="text", help="the JSONL/table field holding a text (default: text)")
    prep.add_argument("--messages-field", default="messages", help="the field holding a chat (default: messages)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    info = verbs.add_parser("info", help="a prepared corpus's manifest")
    info.add_argument("path")
    return p


def run(args):
    if args.verb == "info":
        from zoo.training.shards import Prepared

        m = Prepared(args.path).manifest
        print(json.dumps({k: m[k] for k in ("tokenizer", "dtype", "masked", "documents", "tokens", "dropped",
                                            "sources")}, indent=2))
        return 0
    from zoo.training.shards import prepare

    m = prepare(args.sources, args.out, args.tokenizer, workers=args.workers, shard_tokens=args.shard_tokens,
                max_tokens=args.max_tokens, text_field=args.text_field, messages_field=args.messages_field,
                progress=not args.no_progress)
    size = sum(sh["tokens"] for sh in m["shards"]) * (2 if m["dtype"] == "uint16" else 4)
    print(f"{args.out}: {m['documents']:,} documents, {m['tokens']:,} tokens in {len(m['shards'])} shard(s) "
          f"({m['dtype']}, {size:,} bytes)" + (f"; {m['dropped']} record(s) left out (longer than --max-tokens)"
                                                if m["dropped"] else "") + (", with a loss mask" if m["masked"] else ""))
    return 0
