"""Plugins through real entry points: small plugin distributions are pip-installed into a temporary
directory, and zoo runs in a subprocess with that directory on PYTHONPATH, so importlib.metadata
finds their ``zoo.plugins`` entry points exactly as it would after ``pip install``. The registry's
own rules (interfaces, duplicates, overrides, rollback) are also tested in-process on a fresh
plugin manager."""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

import zoo
from zoo.core.registry import DuplicateNameError, InterfaceError, PluginError, PluginManager, PluginWarning

GOOD = '''
from dataclasses import dataclass
import torch
import zoo

class HalfNorm(torch.nn.Module):
    """RMSNorm at half scale."""
    @dataclass(frozen=True)
    class Config:
        eps: float = 1e-6
    def __init__(self, cfg, *, dim):
        super().__init__()
        self.eps = cfg.eps
    def forward(self, x):
        return 0.5 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

class Cube(torch.nn.Module):
    Config = dataclass(frozen=True)(type("Config", (), {}))
    def __init__(self, cfg):
        super().__init__()
    def forward(self, x):
        return x ** 3

@zoo.hookimpl
def zoo_register(registry):
    registry.add_norm("halfnorm", HalfNorm)
    registry.add_activation("gelu", Cube, override=True)  # replaces the built-in, on purpose
'''
DUPLICATE = '''
import zoo
from zoo.components.norms import LayerNorm

@zoo.hookimpl
def zoo_register(registry):
    registry.add_norm("rmsnorm", LayerNorm)  # taken by the built-ins
'''
BROKEN = '''
import zoo
import a_module_that_does_not_exist
'''
NO_CONFIG = '''
import torch
import zoo

class NoConfig(torch.nn.Module):
    def __init__(self, cfg, *, dim):
        super().__init__()

@zoo.hookimpl
def zoo_register(registry):
    registry.add_norm("noconfig", NoConfig)
'''
DISTRIBUTIONS = {  # distribution: (version, entry-point name, module, source)
    "zoo-test-good": ("0.3", "good", "zoo_test_good", GOOD),
    "zoo-test-dup": ("0.2", "dup", "zoo_test_dup", DUPLICATE),
    "zoo-test-broken": ("1.0", "broken", "zoo_test_broken", BROKEN),
    "zoo-test-noconfig": ("0.1", "noconfig", "zoo_test_noconfig", NO_CONFIG),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The test plugin distributions, installed by pip into a directory of their own."""
    root = tmp_path_factory.mktemp("plugin-src")
    sources = []
    for dist, (version, ep, module, code) in DISTRIBUTIONS.items():
        src = root / dist
        (src / module).mkdir(parents=True)
        (src / module / "__init__.py").write_text(textwrap.dedent(code))
        (src / "pyproject.toml").write_text(textwrap.dedent(f"""
            [build-system]
            requires = ["setuptools>=64"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{dist}"
            version = "{version}"
            [project.entry-points."zoo.plugins"]
            {ep} = "{module}"
            [tool.setuptools]
            packages = ["{module}"]
            """))
        sources.append(str(src))
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), *sources], check=True, capture_output=True)
    return target


def python(site, code, **env):
    """Run ``code`` in a fresh interpreter that sees the test plugins (and no ZOO_* settings but ``env``)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZOO_")}
    full_env.update(PYTHONPATH=str(site), PYTHONWARNINGS="default", **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def autoloaded(site):
    """``zoo plugins --json`` and ``zoo list --json`` in one fresh interpreter, with every test plugin
    discovered through its entry point."""
    code = "import zoo.cli; zoo.cli.main(['plugins', '--json']); print('\\f'); zoo.cli.main(['list', '--json'])"
    proc = python(site, code)
    assert proc.returncode == 0, proc.stderr  # broken plugins do not take zoo down
    plugins, listing = proc.stdout.split("\f")
    return {p["name"]: p for p in json.loads(plugins)}, proc.stderr, json.loads(listing)


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_discovery_and_provenance(autoloaded):
    plugins, _, _ = autoloaded
    good = plugins["good"]
    assert good["distribution"] == "zoo-test-good" and good["version"] == "0.3" and good["module"] == "zoo_test_good"
    assert good["error"] is None and not good["builtin"]
    assert good["registered"] == [{"kind": "norm", "name": "halfnorm"}, {"kind": "activation", "name": "gelu"}]
    builtin = plugins["zoo.components"]
    assert builtin["builtin"] and builtin["distribution"] == "zoo-lm"
    assert {"kind": "norm", "name": "rmsnorm"} in builtin["registered"]


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_broken_plugin_is_reported_and_skipped(autoloaded):
    plugins, stderr, _ = autoloaded
    broken = plugins["broken"]
    assert "ModuleNotFoundError" in broken["error"] and "a_module_that_does_not_exist" in broken["error"]
    assert broken["registered"] == []
    assert "zoo plugin 'broken' (zoo-test-broken) failed to load" in stderr  # the warning names it


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_a_plugin_sharing_a_name_with_zoo_loads_with_a_warning_naming_both_providers(autoloaded):
    plugins, stderr, _ = autoloaded
    assert plugins["dup"]["error"] is None  # a name zoo also ships does not take the plugin down
    assert ("norm 'rmsnorm' is registered by zoo (zoo.components) and by plugin 'dup' "
            "(distribution zoo-test-dup 0.2): both are kept") in stderr
    assert "'zoo:rmsnorm'" in stderr and "'dup:rmsnorm'" in stderr


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_interface_is_checked_at_registration(autoloaded):
    error = autoloaded[0]["noconfig"]["error"]
    assert error.startswith("InterfaceError") and "norm 'noconfig'" in error and "a `Config` dataclass" in error


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_zoo_list_names_the_provider(autoloaded):
    rows = {(r["kind"], r["name"]): r for r in autoloaded[2]}
    assert rows[("norm", "halfnorm")]["provider"] == "good"
    assert rows[("norm", "halfnorm")]["distribution"] == "zoo-test-good"
    assert rows[("activation", "gelu")]["provider"] == "good"
    assert rows[("activation", "gelu")]["overrides"] == "zoo.components"
    assert rows[("norm", "rmsnorm")]["provider"] == "zoo.components"  # the duplicate did not win
    assert ("norm", "noconfig") not in rows
    assert rows[("family", "llama3")]["presets"][0].startswith("llama3")


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_strict_mode_makes_a_failing_plugin_fatal(site):
    proc = python(site, "import sys, zoo.cli; sys.exit(zoo.cli.main(['plugins']))", ZOO_STRICT_PLUGINS="1")
    assert proc.returncode != 0
    assert "zoo plugins: error: zoo plugin" in proc.stderr and "failed to load" in proc.stderr


@pytest.mark.slow  # pip-installs plugin distributions, runs zoo in subprocesses
def test_autoload_switch_and_explicit_loading(site):
    """Autoloading off: the built-ins, the plugins named in ZOO_PLUGINS (by entry-point name, with
    their provenance), and those loaded through the Python API; none of the broken ones."""
    code = textwrap.dedent("""
        import json, zoo
        zoo.list_components("norm")  # first use: loads what is to be loaded
        loaded = {n: i.distribution for n, i in zoo.manager().plugins.items()}
        info = zoo.load_plugin("good")
        m = zoo.build("llama3-8b", n_layers=1, d_model=32, vocab_size=64, overrides={
            "layers.*.norm": "halfnorm", "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2,
            "layers.*.ffn.d_ff": 64})
        print(json.dumps([loaded, info.version, type(m.layers[0].attn_norm).__name__]))
    """)
    proc = python(site, code, ZOO_DISABLE_PLUGIN_AUTOLOAD="1", ZOO_PLUGINS="good")
    assert proc.returncode == 0, proc.stderr
    loaded, version, norm = json.loads(proc.stdout)
    assert set(loaded) == {*zoo.core.registry.BUILTIN_PLUGINS, "good"}  # nothing else third-party
    assert loaded["good"] == "zoo-test-good" and version == "0.3"
    assert "failed to load" not in proc.stderr  # the broken ones were never tried
    assert norm == "HalfNorm"


# ------------------------------------------------------------------- the registry, in-process

@pytest.fixture
def fresh(monkeypatch):
    """A plugin manager with no built-ins and autoloading off."""
    monkeypatch.setenv("ZOO_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("ZOO_PLUGINS", raising=False)
    monkeypatch.delenv("ZOO_STRICT_PLUGINS", raising=False)
    return PluginManager(builtin_plugins=())


class Scale(torch.nn.Module):
    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, dim):
        super().__init__()

    def forward(self, x):
        return x


@pytest.mark.parametrize("kind,obj,needs", [
    ("norm", object, "torch.nn.Module subclass"),
    ("norm", type("NoCfg", (torch.nn.Module,), {"forward": lambda self, x: x}), "`Config` dataclass"),
    ("mixer", Scale, "constructor accepting `(config, d_model=..., layer=..., spec=..., index=...)`"),
    ("mixer", Scale, "`forward(self, x, ctx, pos)`"),
    ("attention", Scale, "`forward(self, x, ctx, pos)`"),  # the old helper registers a mixer
    ("position", Scale, "`applies_to` set to one of"),
    ("rope_scaling", Scale, "a `frequencies` method"),
    ("stability", 3.0, "callable"),
    ("family", object(), "a `presets` dict"),
])
def test_typed_helpers_say_what_is_missing(fresh, kind, obj, needs):
    add = getattr(fresh, f"add_{kind}")
    kind_name = {"attention": "mixer"}.get(kind, kind)
    old = pytest.deprecated_call() if kind == "attention" else contextlib.nullcontext()
    with pytest.raises(InterfaceError, match="does not meet the " + kind_name + " interface") as err, old:
        add(obj) if kind == "family" else add("x", obj)
    assert needs in str(err.value)
    assert not fresh.registry(kind_name).names()


def test_duplicates_and_explicit_override(fresh):
    class Other(Scale):
        pass

    with fresh.providing("first"):
        fresh.add_norm("scale", Scale)
    with fresh.providing("second"):
        with pytest.raises(DuplicateNameError, match="by 'first' and by 'second'"):
            fresh.add_norm("scale", Other)
        fresh.add_norm("scale", Other, override=True)
    entry = fresh.registry("norm").entry("scale")
    assert entry.obj is Other and entry.provider == "second" and entry.replaced.provider == "first"
    fresh.registry("norm").remove("scale", "second")  # withdrawing an override restores the original
    assert fresh.registry("norm").get("scale") is Scale


def test_family_presets_must_be_unique(fresh):
    fam = zoo.get("family", "llama2")
    fresh.add_family(fam)
    clash = zoo.Family(name="mine", base=fam.base, presets={"llama2-7b": {}})
    with pytest.raises(DuplicateNameError, match="claims 'llama2-7b'"):
        fresh.add_family(clash)


def test_a_plugin_that_fails_halfway_is_withdrawn(fresh, tmp_path, monkeypatch):
    (tmp_path / "halfway.py").write_text(textwrap.dedent('''
        import zoo
        from test_plugins import Scale
        @zoo.hookimpl
        def zoo_register(registry):
            registry.add_norm("first_half", Scale)
            raise RuntimeError("second half failed")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(__file__)))
    with pytest.warns(PluginWarning, match="zoo plugin 'halfway' .* second half failed"):
        info = fresh.load_plugin("halfway")
    assert info.error == "RuntimeError: second half failed" and info.registered == []
    assert "first_half" not in fresh.registry("norm")
    monkeypatch.setenv("ZOO_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="halfway"):
        PluginManager(builtin_plugins=()).load_plugin("halfway")


def test_hooks_are_called_with_keywords_only(fresh):
    class Plugin:
        @zoo.hookimpl
        def zoo_register(self, registry):
            registry.add_norm("kw", Scale)

    fresh.pm.register(Plugin())
    with pytest.raises(TypeError):
        fresh.pm.hook.zoo_register(fresh)  # positional: refused by pluggy
    fresh.pm.hook.zoo_register(registry=fresh)
    assert fresh.registry("norm").get("kw") is Scale


def test_cli_text_output(capsys):
    from zoo.cli import main

    assert main(["list", "norm", "rms*"]) == 0
    assert capsys.readouterr().out.split() == ["norm", "rmsnorm", "zoo.components", "(zoo-lm", f"{zoo.__version__})"]
    assert main(["list", "model", "llama2-7b"]) == 0
    assert capsys.readouterr().out.split()[:4] == ["model", "llama2-7b", "zoo.families", "(zoo-lm"]
    assert main(["plugins"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "zoo-lm" in lines["zoo.components"] and "norm: layernorm, rmsnorm" in lines["zoo.components"]
    assert "family: " in lines["zoo.families"] and "llama3" in lines["zoo.families"]
    assert main(["list", "nrom"]) == 2
    assert "unknown registry kind 'nrom'. Did you mean 'norm'?" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter
def test_importing_a_builtin_part_module_first_loads_every_plugin():
    """`from zoo.components.mixers.attention import ...` as a script's first line registers the part to its
    plugin without running the plugins half-way through that import (a plugin family naming the
    attention mixer would otherwise be checked before the mixer exists)."""
    # The example plugins import zoo 0.1's paths: those warn as deprecated, and nothing else may.
    code = ("import warnings; warnings.simplefilter('error'); warnings.simplefilter('default', DeprecationWarning)\n"
            "from zoo.components.mixers.attention import causal_mask\n"
            "import zoo\n"
            "m = zoo.manager()\n"
            "assert m.provider_of('mixer', 'attention') == 'zoo.components'\n"
            "assert ('mixer', 'attention') in m.plugins['zoo.components'].registered\n"
            "assert all(info.error is None for info in m.plugins.values()), "
            "[(n, i.error) for n, i in m.plugins.items() if i.error]\n"
            "print(len(zoo.list_models()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 20
