"""``zoo list [KIND] [PATTERN]``: registered parts and model presets, with the plugin that provided each.
``zoo list KIND NAME`` (a name, not a pattern) also shows that part's settings: name, type, default."""

import fnmatch
import json


def add_parser(sub):
    p = sub.add_parser(
        "list",
        help="list registered parts (or model presets) and which plugin provided each",
        description="KIND is a registry kind (norm, attention, family, checkpoint_format, ...) or 'model' for the "
                    "presets zoo.build accepts; PATTERN is a shell-style pattern ('gemma*'). Without KIND: every "
                    "kind of part. `zoo list KIND NAME` with an exact name also shows the part's settings (the fields "
                    "of its Config, with their types and defaults) and its description.",
    )
    p.add_argument("kind", nargs="?", default=None, help="a registry kind, or 'model' (default: every kind of part)")
    p.add_argument("pattern", nargs="?", default="*", help="shell-style name pattern (default '*')")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def settings(obj):
    """The fields of a part's ``Config``: [{name, type, default}] (the default ``None`` when required)."""
    import dataclasses
    import typing

    config = getattr(obj, "Config", None)
    if not dataclasses.is_dataclass(config):
        return []
    hints = typing.get_type_hints(config)
    out = []
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        from zoo.core.spec import to_dict

        tp = hints[f.name]
        name = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
        if "kind" in f.metadata:  # a part of another kind, by name or as a table
            name = name.replace("zoo.core.spec.Part", f"{f.metadata['kind']} part").replace("Part", f"{f.metadata['kind']} part")
        out.append({"name": f.name, "type": name, "default": to_dict(default)})
    return out


def describe(obj):
    """The part's own docstring (not one it inherits, such as nn.Module's)."""
    doc = (obj if isinstance(obj, type) else type(obj)).__dict__.get("__doc__") or ""
    return " ".join(doc.split())


def rows(kind, pattern):
    from zoo.core import kinds as _kinds
    from zoo.core.registry import manager

    m = manager()
    m.ensure_loaded()

    def provenance(provider):
        info = m.plugins.get(provider)
        return {"provider": provider, "distribution": info.distribution if info else None,
                "version": info.version if info else None}

    if kind in ("model", "models"):
        out = []
        for family in m.registry("family").entries():
            for preset in family.obj.presets:
                if fnmatch.fnmatchcase(preset, pattern):
                    out.append({"kind": "model", "name": preset, "family": family.name, **provenance(family.provider)})
        return sorted(out, key=lambda r: r["name"])
    kinds = [kind] if kind else list(m.registries)
    out = []
    for k in kinds:
        for e in m.registry(k).entries():
            if fnmatch.fnmatchcase(e.name, pattern):
                row = {"kind": k, "name": e.name, **provenance(e.provider)}
                if e.replaced is not None:
                    row["overrides"] = e.replaced.provider
                also = m.registry(k).shadowed(e.name)
                if also:  # zoo and a plugin both have the name: the bare one means zoo's
                    row["qualified"] = f"zoo:{e.name}"
                if k == "family":
                    row["presets"] = sorted(e.obj.presets)
                if kind and e.name == pattern:  # one part asked for by name: its settings too
                    row["description"] = describe(e.obj)
                    row["settings"] = settings(e.obj)
                    if _kinds.BASES.get(k) is not None:  # the hooks of its kind's base that it implements itself
                        row["hooks"] = _kinds.overrides(e.obj, _kinds.BASES[k])
                out.append(row)
                out += [{"kind": k, "name": q, "qualified": q, "shadowed_by": e.provider, **provenance(other.provider)}
                        for q, other in also]
    return out


def run(args):
    found = rows(args.kind, args.pattern)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for r in found:
        where = r["provider"] + (f" ({r['distribution']} {r['version']})" if r["distribution"] else "")
        extra = f"  overrides {r['overrides']}" if "overrides" in r else ""
        if "shadowed_by" in r:
            extra += f"  (the bare name {r['name'].split(':', 1)[1]!r} means {r['shadowed_by']}'s; this plugin's own families use this one)"
        elif "qualified" in r:
            extra += f"  (also {r['qualified']}; a plugin has the same name)"
        if "presets" in r:
            extra += f"  presets: {', '.join(r['presets'])}"
        if "family" in r:
            extra += f"  family {r['family']}"
        print(f"{r['kind']:<18} {r['name']:<22} {where}{extra}")
        if "settings" in r:
            if r["description"]:
                print(f"  {r['description']}")
            if "hooks" in r:
                print(f"  hooks: {', '.join(r['hooks']) or '(none: the defaults of its base)'}")
            for f in r["settings"] or [{"name": "(no settings)", "type": "", "default": ""}]:
                default = "" if f["name"] == "(no settings)" else (
                    f["default"] if f["default"] == "(required)" else f"= {f['default']!r}")
                print(f"  {f['name']:<24} {f['type']:<28} {default}")
    if not found:
        print(f"nothing matches {args.pattern!r}" + (f" in {args.kind}" if args.kind else ""))
    return 0
