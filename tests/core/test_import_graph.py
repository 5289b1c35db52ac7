"""The wings keep their order: the import graph of zoo/, drawn from the source (imports at module
level and inside functions alike), has no arrow running up the wing order and no circle
(docs/forward.md, "The wings")."""

from __future__ import annotations

import ast
from pathlib import Path

import zoo

ROOT = Path(zoo.__file__).parent

#: Bottom to top; a wing imports only the wings below it.
ORDER = ("core", "model", "checkpoints", "inference", "training", "tools", "commands", "cli")
#: module prefix -> wing. The catalogue (parts and recipes) imports only core; zoo/__init__.py is the
#: front door above every wing, and nothing inside zoo imports it.
WINGS = {"zoo.core": "core", "zoo.components": "catalogue", "zoo.families": "catalogue", "zoo.model": "model",
         "zoo.checkpoints": "checkpoints", "zoo.inference": "inference", "zoo.training": "training",
         "zoo.tools": "tools", "zoo.testing": "tools", "zoo.commands": "commands", "zoo.cli": "cli"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a zoo module, wherever it stands."""
    def known(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges += [(name, known(a.name), node.lineno) for a in node.names if a.name.split(".")[0] == "zoo"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "zoo":
                    continue
                for a in node.names:  # a name that is a submodule is an arrow to that module
                    edges.append((name, f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base), node.lineno))
    return edges


def wing(module: str) -> str:
    for prefix, w in WINGS.items():
        if module == prefix or module.startswith(prefix + "."):
            return w
    return "front door"


def upward(edges) -> list[str]:
    bad = []
    for a, b, line in edges:
        wa, wb = wing(a), wing(b)
        if wa == wb or wa == "front door":
            continue
        if wb == "front door" or (wa == "catalogue" and wb != "core") or (wa == "core" and wb == "catalogue"):
            bad.append(f"{a}:{line} -> {b}")
        elif wa != "catalogue" and wb != "catalogue" and ORDER.index(wb) > ORDER.index(wa):
            bad.append(f"{a}:{line} -> {b} ({wa} imports {wb}, a wing above it)")
    return bad


def circles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_is_drawn_from_every_wing():
    mods = modules()
    edges = imports(mods)
    assert {wing(m) for m in mods} == {*ORDER, "catalogue", "front door"}
    drawn = {(a, b) for a, b, _ in edges}
    # one arrow of each kind the reader must see: module level, inside a function, a relative import
    assert ("zoo.model.decoder", "zoo.core.kinds") in drawn
    assert ("zoo.commands.generate", "zoo.inference.generate") in drawn  # inside run()
    assert len(edges) > 400


def test_no_arrow_runs_up_the_wing_order():
    assert upward(imports(modules())) == []


def test_no_circle():
    assert circles(imports(modules())) == []


def test_the_checks_see_an_arrow_up_and_a_circle(tmp_path):
    (tmp_path / "zoo" / "core").mkdir(parents=True)
    (tmp_path / "zoo" / "model").mkdir()
    for init in ("zoo", "zoo/core", "zoo/model"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "zoo" / "core" / "a.py").write_text("def f():\n    from zoo.model import b\n")
    (tmp_path / "zoo" / "model" / "b.py").write_text("from ..core import a\n")
    edges = imports(modules(tmp_path / "zoo"))
    assert upward(edges) == ["zoo.core.a:2 -> zoo.model.b (core imports model, a wing above it)"]
    assert circles(edges) == [["zoo.core.a", "zoo.model.b"]]
