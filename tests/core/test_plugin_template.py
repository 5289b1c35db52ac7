"""docs/guides/plugins.md's pyproject.toml template, as a plugin author would use it: a plugin with a family
TOML built into a wheel (non-editable), installed, and its preset built. Without the template's
package-data the TOML is left out, and zoo's error says what to add."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guides" / "plugins.md"

MODULE = '''
from pathlib import Path

import zoo


@zoo.hookimpl
def zoo_register(registry):
    registry.add_family(Path(__file__).with_name("mynorm.toml"))
'''
FAMILY = '''
[family]
name = "mynorm"

[base]
vocab_size = 64
d_model = 32
n_layers = 2
max_seq_len = 64

[base.layers.default]
attention = { name = "attention", n_heads = 4, n_kv_heads = 2 }
ffn = { name = "swiglu", d_ff = 64 }

[presets."mynorm-tiny"]
description = "a tiny model of the template plugin"
'''


def template() -> str:
    """The pyproject.toml of docs/guides/plugins.md, with zoo's own distribution left out of the
    dependencies (it is installed here already)."""
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S)
    text = next(b for b in blocks if "[build-system]" in b)
    deps = 'dependencies = ["zoo-lm", "torch>=2.6"]'
    assert deps in text, "the template's dependencies line changed: update this test"
    return text.replace(deps, "dependencies = []")


def install(tmp_path: Path, pyproject: str) -> Path:
    src = tmp_path / "zoo-mynorm"
    (src / "src" / "zoo_mynorm").mkdir(parents=True)
    (src / "pyproject.toml").write_text(pyproject)
    (src / "src" / "zoo_mynorm" / "__init__.py").write_text(textwrap.dedent(MODULE))
    (src / "src" / "zoo_mynorm" / "mynorm.toml").write_text(textwrap.dedent(FAMILY))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return site


def run(site: Path, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOO_")}
    env.update(PYTHONPATH=str(site), PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow  # builds and installs a wheel
def test_a_wheel_built_from_the_template_ships_its_family(tmp_path):
    site = install(tmp_path, template())
    assert (site / "zoo_mynorm" / "mynorm.toml").is_file()
    proc = run(site, "import zoo; m = zoo.build('mynorm-tiny', device='meta'); "
                     "print(zoo.manager().provider_of('family', 'mynorm'), m.spec.n_layers)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["mynorm", "2"]


@pytest.mark.slow  # builds and installs a wheel
def test_without_package_data_the_error_says_what_to_add(tmp_path):
    pyproject = template()
    assert "[tool.setuptools.package-data]" in pyproject
    site = install(tmp_path, pyproject.split("\n# Data files inside the package")[0])
    assert not (site / "zoo_mynorm" / "mynorm.toml").exists()
    proc = run(site, "import zoo.cli; zoo.cli.main(['plugins'])")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"zoo plugin 'mynorm' .* family file .*mynorm\.toml is missing.*"
                     r"\[tool\.setuptools\.package-data\]", proc.stderr), proc.stderr


@pytest.fixture(autouse=True)
def _quiet_pip(monkeypatch):
    monkeypatch.setenv("PIP_NO_INPUT", "1")
