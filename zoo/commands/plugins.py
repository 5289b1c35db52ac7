"""``zoo plugins``: what was loaded, from which distribution and version, and what each registered."""

import json
from itertools import groupby


def add_parser(sub):
    p = sub.add_parser(
        "plugins",
        help="list loaded plugins: name, distribution, version, and what each registered",
        description="Load the built-in parts and every plugin of the 'zoo.plugins' entry-point group (unless "
                    "ZOO_DISABLE_PLUGIN_AUTOLOAD=1; ZOO_PLUGINS=a,b loads named ones), then list each plugin with "
                    "its distribution, version and registrations, or the error that made zoo skip it.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def summary(registered):
    """[("norm", "dyt"), ("position", "alibi")] -> 'norm: dyt; position: alibi'."""
    return "; ".join(f"{kind}: {', '.join(n for _, n in names)}" for kind, names in groupby(sorted(registered), key=lambda r: r[0]))


def run(args):
    from zoo.core.registry import manager

    m = manager()
    m.ensure_loaded()
    infos = list(m.plugins.values())
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return 0
    print(f"{'plugin':<26} {'distribution':<18} {'version':<9} registered")
    for i in infos:
        what = f"FAILED: {i.error}" if i.error else summary(i.registered) or "nothing"
        print(f"{i.name:<26} {i.distribution or '-':<18} {i.version or '-':<9} {what}")
    failed = [i.name for i in infos if i.error]
    if failed:
        print(f"\n{len(failed)} plugin(s) failed to load and were skipped: {', '.join(failed)} "
              "(ZOO_STRICT_PLUGINS=1 makes this an error)")
    return 0
