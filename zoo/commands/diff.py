"""``zoo diff A B``: two models' components side by side, differences marked."""

import json

from zoo.commands.build import parse_sets


def add_parser(sub):
    p = sub.add_parser(
        "diff",
        help="two models' components side by side, differences marked",
        description="Line up the components of two models and mark the rows that differ with '*'. "
                    "`zoo diff transformer-2017 llama2-7b` is the original Transformer against a modern LLM.",
    )
    p.add_argument("a", help="first model (preset name, HF repo id or recipe file)")
    p.add_argument("b", help="second model")
    p.add_argument("--all", action="store_true", help="also print the rows that are the same")
    p.add_argument("--json", action="store_true", help="print JSON: a list of {row, a, b, differs}")
    return p


def diff_rows(a, b):
    """Rows present in either model, in a's order then b's extra rows: (row, value_a, value_b)."""
    da, db = dict(a), dict(b)
    names = [k for k, _ in a] + [k for k, _ in b if k not in da]
    return [(k, da.get(k, "-"), db.get(k, "-")) for k in names]


def run(args):
    from zoo.tools.accounting import account, components

    rows = diff_rows(components(args.a), components(args.b))
    fig_a, fig_b = account(args.a, context=None), account(args.b, context=None)
    rows += [
        ("parameters", f"{fig_a['params']['total']:,}", f"{fig_b['params']['total']:,}"),
        ("aspect ratio", f"{fig_a['shape']['aspect_ratio']:.1f}", f"{fig_b['shape']['aspect_ratio']:.1f}"),
        ("KV cache/token (bf16)", f"{fig_a['decode_state']['bytes_per_token']:,} B", f"{fig_b['decode_state']['bytes_per_token']:,} B"),
    ]
    if args.json:
        print(json.dumps([{"row": k, "a": va, "b": vb, "differs": va != vb} for k, va, vb in rows], indent=2))
        return 0
    shown = [r for r in rows if args.all or r[1] != r[2]]
    wk = max([len(r[0]) for r in shown] + [3])
    wa = min(max([len(r[1]) for r in shown] + [len(args.a)]), 60)
    print(f"  {'':<{wk}}  {args.a:<{wa}}  {args.b}")
    for k, va, vb in shown:
        mark = "*" if va != vb else " "
        print(f"{mark} {k:<{wk}}  {va:<{wa}}  {vb}")
    same = len(rows) - sum(r[1] != r[2] for r in rows)
    if not args.all and same:
        print(f"  ({same} identical rows hidden; --all shows them)")
    return 0
