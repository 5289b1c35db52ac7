"""Every built-in part file reads as its mechanism first: in each class of a file that holds a
registered part, the hooks in which the part states facts about itself (``zoo.core.kinds.FACT_HOOKS``:
checks, shrinking, cost, memory, plans) follow one divider line, ``FACTS_DIVIDER``, and below it there is
no mechanism: every method there is a fact hook, or a private helper that no method above the divider
calls. (Nested classes, a part's ``Config``, and class attributes are not methods and are not looked at.)"""

import ast
import inspect
from pathlib import Path

import pytest

from zoo.core import kinds, registry


def _part_files() -> list[Path]:
    files = set()
    for kind in kinds.BASES:
        for entry in registry.manager().registry(kind).entries():
            if entry.provider == "zoo.components" and isinstance(entry.obj, type):
                files.add(Path(inspect.getsourcefile(entry.obj)))
    return sorted(files)


def _problems(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ClassDef):
            continue
        methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        facts = [m for m in methods if m.name in kinds.FACT_HOOKS]
        if not facts:
            continue
        dividers = [i + 1 for i in range(node.lineno, node.end_lineno)
                    if lines[i].strip().startswith(kinds.FACTS_DIVIDER)]
        if len(dividers) != 1:
            out.append(f"{node.name}: {len(dividers)} divider lines ({kinds.FACTS_DIVIDER!r}), not one")
            continue
        line = dividers[0]
        above = [m for m in methods if m.lineno < line]
        called = {n.attr for m in above for n in ast.walk(m) if isinstance(n, ast.Attribute)}
        for m in methods:
            if m.name in kinds.FACT_HOOKS and m.lineno < line:
                out.append(f"{node.name}.{m.name} (a fact) is above the divider")
            elif m.lineno > line and m.name not in kinds.FACT_HOOKS:
                if not m.name.startswith("_") or m.name in called:
                    out.append(f"{node.name}.{m.name} (mechanism) is below the divider")
    return out


FILES = _part_files()


def test_the_built_in_part_files_are_found():
    names = {p.name for p in FILES}
    assert {"attention.py", "mla.py", "moe.py", "dense.py", "norms.py", "encodings.py"} <= names, names


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_part_file_states_its_facts_below_its_mechanism(path):
    assert _problems(path) == []


def test_the_check_sees_a_fact_above_the_divider_and_mechanism_below_it(tmp_path):
    f = tmp_path / "part.py"
    f.write_text(f'''
class Good:
    def forward(self, x):
        return self._run(x)

    def _run(self, x):
        return x

    {kinds.FACTS_DIVIDER}---
    def cost(self, context):
        return self._flops()

    def _flops(self):
        return 0


class Bad:
    def facts(self):
        return self._used_above()

    {kinds.FACTS_DIVIDER}---
    def forward(self, x):
        return x

    def _helper(self):
        return 1

    def cost(self, context):
        return 0

    def _used_above(self):
        return 2


class Undivided:
    def forward(self, x):
        return x

    def cost(self, context):
        return 0
''')
    assert _problems(f) == ["Bad.facts (a fact) is above the divider", "Bad.forward (mechanism) is below the divider",
                            "Bad._used_above (mechanism) is below the divider",
                            f"Undivided: 0 divider lines ({kinds.FACTS_DIVIDER!r}), not one"]
