"""``zoo build NAME``: build presets on the meta device and print what they are."""

import fnmatch
import json
import time


def add_parser(sub):
    p = sub.add_parser("build", help="build presets on the meta device (allocating nothing) and summarise them")
    p.add_argument("names", nargs="*", default=["*"], help="preset names, shell patterns or recipe files (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a spec field, e.g. --set n_layers=2 --set layers.local.mixer.window=64")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def parse_sets(items):
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects PATH=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def run(args):
    from zoo.model.recipes import build, list_models

    names = []
    for n in args.names:
        if any(c in n for c in "*?[") and not n.endswith((".toml", ".json")):
            names += list_models(n)
        else:
            names.append(n)
    rows = []
    for name in names:
        t = time.perf_counter()
        model = build(name, device="meta", overrides=parse_sets(args.set))
        spec = model.spec
        rows.append({
            "name": name,
            "params": model.num_parameters(),
            "non_embedding_params": model.num_parameters(exclude_embeddings=True),
            "layers": spec.n_layers,
            "d_model": spec.d_model,
            "layer_pattern": list(spec.layer_pattern),
            "vocab": spec.vocab_size,
            "build_ms": round(1000 * (time.perf_counter() - t), 1),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<20} {'params':>17} {'non-embedding':>17} {'layers':>6} {'d_model':>7} {'vocab':>7}  build")
    for r in rows:
        print(f"{r['name']:<20} {r['params']:>17,} {r['non_embedding_params']:>17,} {r['layers']:>6} "
              f"{r['d_model']:>7} {r['vocab']:>7}  {r['build_ms']:.0f} ms")
    return 0
