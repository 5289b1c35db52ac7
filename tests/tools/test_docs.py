"""The documentation's examples run as written, and its lists are the registry's."""

import ast
import re
from pathlib import Path

import pytest

import zoo
from zoo.core.registry import list_components

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def python_block(path: Path, after: str, containing: str = "") -> str:
    """The first ```python block after the heading or text ``after`` (that contains ``containing``)."""
    text = path.read_text()
    text = text[text.index(after):]
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if containing in block:
            return block
    raise AssertionError(f"{path.name}: no python block after {after!r} containing {containing!r}")


def test_spec_overrides_run_and_each_override_holds():
    code = python_block(DOCS / "reference" / "spec.md", "## Overrides")
    tree = ast.parse(code)
    built = []
    for i, node in enumerate(tree.body):  # keep each line's model, to check what its override set
        if isinstance(node, ast.Expr):
            built.append(f"m{len(built)}")
            target = ast.Name(built[-1], ast.Store())
            tree.body[i] = ast.copy_location(ast.Assign(targets=[target], value=node.value), node)
    ns: dict = {}
    exec(compile(ast.fix_missing_locations(tree), "spec.md", "exec"), ns)
    models = [ns[name] for name in built]
    assert len(models) == 5 and all(p.is_meta for m in models for p in m.parameters())
    llama, window, heads, window2, norm = (m.spec for m in models)
    assert (llama.n_layers, llama.d_model) == (2, 256)
    assert window.layers["local"].mixer.config.window == 64 == window2.layers["local"].mixer.config.window
    assert all(layer.mixer.config.n_heads == 4 for layer in heads.layers.values())
    assert norm.layers["default"].norm.name == "layernorm"


def test_the_decayed_linear_mixer_of_plugins_md_runs_and_conforms():
    import zoo.testing as zt

    ns: dict = {}
    exec(compile(python_block(DOCS / "guides" / "plugins.md", "## 5. A mixer", "class DecayedLinear"), "plugins.md", "exec"), ns)
    zoo.register("mixer", "docs_decayed_linear")(ns["DecayedLinear"])
    mixers = zoo.manager().registry("mixer")
    try:
        zt.check("mixer", "docs_decayed_linear")
        assert ns["DecayedLinear"](ns["DecayedLinear"].Config(), d_model=16, layer=None, spec=None).cost(8).flops > 0
    finally:  # the suite's other tests see the registry as zoo ships it
        mixers.remove("docs_decayed_linear", mixers.entry("docs_decayed_linear").provider)
    assert "docs_decayed_linear" not in list_components("mixer")


def test_checkpoints_md_lists_every_format_zoo_ships():
    text = (DOCS / "reference" / "checkpoints.md").read_text()
    table = text[text.index("## Supported `model_type`s"):]
    table = table[: table.index("\n\n", table.index("|---|"))]
    listed = {m for row in table.splitlines()[2:] for m in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    manager = zoo.manager()
    shipped = {m for m in list_components("checkpoint_format")
               if manager.provider_of("checkpoint_format", m) in manager.builtin_plugins}
    assert listed == shipped


def test_readme_list_models_comments_are_what_the_calls_return():
    lines = re.findall(r"(zoo\.list_models\([^)]*\))\s+# (\[.*\])", (ROOT / "README.md").read_text())
    assert lines
    for call, comment in lines:
        assert eval(call, {"zoo": zoo}) == ast.literal_eval(comment), call


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def test_every_relative_link_of_the_docs_resolves():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md"),
             *(ROOT / "plugins").glob("*/README.md")]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target, anchor in re.findall(r"\]\(([^)\s#:]*)(?:#([^)\s]*))?\)", text):
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken
