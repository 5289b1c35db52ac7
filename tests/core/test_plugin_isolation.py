"""A plugin cannot take zoo down or leave it half-loaded: strict mode fails every call, healthy
plugins load whatever the order, sys.exit at import is caught, new kinds are rolled back, slow
plugins are named, unmarked hooks are warned about, families are checked when registered."""

import os
import subprocess
import sys
import textwrap

import pytest

from zoo.core.registry import PluginError, PluginManager, PluginWarning, RegistryError

HEALTHY = '''
import zoo
from zoo.components.norms import RMSNorm

@zoo.hookimpl
def zoo_register(registry):
    registry.add_norm("healthy_norm", RMSNorm)
'''
BROKEN = '''
raise ImportError("broken on purpose")
'''
EXITING = '''
import sys
sys.exit(3)
'''
NEW_KIND = '''
import zoo
from zoo.components.norms import RMSNorm

@zoo.hookimpl
def zoo_register(registry):
    registry.add_kind("widget", lambda obj: [])
    registry.add("widget", "w", object())
    registry.add_norm("kind_norm", RMSNorm)
    raise RuntimeError("fails after adding a kind")
'''
UNMARKED = '''
from zoo.components.norms import RMSNorm

def zoo_register(registry):
    registry.add_norm("unmarked_norm", RMSNorm)
'''
SLOW = '''
import time
import zoo
time.sleep(1.5)

@zoo.hookimpl
def zoo_register(registry):
    pass
'''
BAD_FAMILY = '''
import zoo
from zoo.components.norms import RMSNorm

@zoo.hookimpl
def zoo_register(registry):
    registry.add_norm("family_plugin_norm", RMSNorm)
    registry.add_family(zoo.Family(name="badfam", base={"vocab_size": 64, "d_model": 32, "n_layers": "two",
                                                          "layers": {"default": {}}},
                                   presets={"badfam-1": {}}, source="badfam.toml"))
'''
MODULES = {"zt_healthy": HEALTHY, "zt_broken": BROKEN, "zt_exiting": EXITING, "zt_new_kind": NEW_KIND,
           "zt_unmarked": UNMARKED, "zt_slow": SLOW, "zt_bad_family": BAD_FAMILY}


@pytest.fixture
def plugins_dir(tmp_path, monkeypatch):
    for name, code in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ZOO_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("ZOO_STRICT_PLUGINS", raising=False)
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def manager(monkeypatch, *names):
    monkeypatch.setenv("ZOO_PLUGINS", ",".join(names))
    return PluginManager()


@pytest.mark.parametrize("order", [("zt_broken", "zt_healthy"), ("zt_healthy", "zt_broken")])
def test_without_strict_mode_every_healthy_plugin_loads_whatever_the_order(plugins_dir, monkeypatch, order):
    m = manager(monkeypatch, *order)
    with pytest.warns(PluginWarning, match="zoo plugin 'zt_broken' .* failed to load: ImportError: broken on purpose"):
        assert "healthy_norm" in m.registry("norm").names()
    assert m.plugins["zt_broken"].error and m.plugins["zt_healthy"].error is None


def test_strict_mode_fails_every_call_until_fixed_and_still_loads_the_healthy_ones(plugins_dir, monkeypatch):
    monkeypatch.setenv("ZOO_STRICT_PLUGINS", "1")
    m = manager(monkeypatch, "zt_broken", "zt_healthy")
    for _ in range(3):
        with pytest.raises(PluginError, match="zoo plugin 'zt_broken' .* broken on purpose"):
            m.registry("norm").names()
    assert m.plugins["zt_healthy"].registered == [("norm", "healthy_norm")]
    (plugins_dir / "zt_broken.py").write_text(HEALTHY.replace("healthy_norm", "fixed_norm"))
    fixed = manager(monkeypatch, "zt_broken", "zt_healthy")  # the next process, once the plugin is fixed
    assert {"healthy_norm", "fixed_norm"} <= set(fixed.registry("norm").names())


def test_sys_exit_at_import_is_skipped_with_a_warning_naming_the_plugin(plugins_dir, monkeypatch):
    m = manager(monkeypatch, "zt_exiting", "zt_healthy")
    with pytest.warns(PluginWarning, match="zoo plugin 'zt_exiting' .* failed to load: SystemExit: 3"):
        assert "healthy_norm" in m.registry("norm").names()


def test_a_registry_kind_added_by_a_failing_plugin_is_rolled_back(plugins_dir, monkeypatch):
    from zoo.core import kinds as hookspecs

    m = manager(monkeypatch, "zt_new_kind")
    with pytest.warns(PluginWarning, match="fails after adding a kind"):
        m.ensure_loaded()
    assert "widget" not in m.registries and "widget" not in hookspecs.INTERFACES
    assert "kind_norm" not in m.registry("norm").names()
    with pytest.raises(RegistryError, match="unknown registry kind 'widget'"):
        m.registry("widget")


def test_a_hook_without_the_marker_is_warned_about_by_name(plugins_dir, monkeypatch):
    m = manager(monkeypatch, "zt_unmarked")
    with pytest.warns(PluginWarning, match="'zt_unmarked' .* defines zoo_register without @zoo.hookimpl"):
        m.ensure_loaded()
    assert "unmarked_norm" not in m.registry("norm").names()


def test_a_plugins_families_are_checked_when_it_registers_them(plugins_dir, monkeypatch):
    m = manager(monkeypatch, "zt_bad_family")
    with pytest.warns(PluginWarning, match=r"'zt_bad_family' .* n_layers: expected an integer, got 'two' "
                                           r"\(preset 'badfam-1' of family 'badfam', badfam.toml\)"):
        m.ensure_loaded()
    assert "family_plugin_norm" not in m.registry("norm").names()  # all or nothing
    assert "badfam" not in m.registry("family").names()
    monkeypatch.setenv("ZOO_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="badfam-1"):
        manager(monkeypatch, "zt_bad_family").ensure_loaded()
    later = manager(monkeypatch)  # loaded explicitly, after everything else
    monkeypatch.delenv("ZOO_STRICT_PLUGINS")
    with pytest.warns(PluginWarning, match="badfam-1"):
        later.load_plugin("zt_bad_family")
    assert "badfam" not in later.registry("family").names()


def test_a_missing_family_file_says_what_to_add(tmp_path):
    m = PluginManager(builtin_plugins=())
    m._loaded = True
    with pytest.raises(RegistryError, match=r"family file .*gone\.toml is missing.*package-data"):
        m.add_family(tmp_path / "gone.toml")


@pytest.mark.slow  # runs zoo in subprocesses
def test_the_command_line_survives_exiting_slow_and_unmarked_plugins(plugins_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOO_")}
    env.update(PYTHONPATH=str(plugins_dir), ZOO_PLUGINS="zt_exiting,zt_slow,zt_unmarked,zt_healthy",
               PYTHONWARNINGS="default")
    proc = subprocess.run([sys.executable, "-m", "zoo.cli", "plugins"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "zt_healthy" in proc.stdout and "zt_exiting" in proc.stdout
    assert "zoo plugin 'zt_exiting'" in proc.stderr and "SystemExit: 3" in proc.stderr
    assert "zoo: loading plugin 'zt_slow' (zt_slow) is taking over 1 s" in proc.stderr
    assert "'zt_unmarked' (zt_unmarked) defines zoo_register without @zoo.hookimpl" in proc.stderr
