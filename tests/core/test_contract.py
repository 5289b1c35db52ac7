"""The contract of a part (zoo.core.kinds): one base per kind, the defaults a duck-typed part gets at
registration, the misspelt-hook warning, `zoo list`'s hooks, the docs table, and a part's own init."""

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo
from zoo.core import kinds, registry
from zoo.core.registry import PluginManager
from zoo.testing import tiny_model, tiny_spec_with

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setenv("ZOO_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("ZOO_PLUGINS", raising=False)
    return PluginManager(builtin_plugins=())


@pytest.fixture
def scratch():
    """Register into the live registry for one test, then take the names out again."""
    added = []

    def add(kind, name, cls):
        registry.manager().add(kind, name, cls)
        added.append((kind, name))
        return cls

    yield add
    for kind, name in added:
        registry.manager().registry(kind)._entries.pop(name, None)


class DuckState:
    """A decode state as the last release's docs taught it: an object with nbytes() and nothing else."""

    def __init__(self):
        self.seen = None

    def nbytes(self):
        return 0


class DuckMixer(nn.Module):
    """A mixer written as the last release's docs taught: no base class, only the methods it needs."""

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, d_model, layer, spec, index):
        super().__init__()
        self.proj, self.index = nn.Linear(d_model, d_model, bias=False), index

    def forward(self, x, ctx, pos):
        return self.proj(torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1)[None, :, None])

    def new_state(self, batch, max_len, *, dtype, device):
        return DuckState()


def test_a_duck_typed_part_gets_the_defaults_and_keeps_its_identity(scratch):
    scratch("mixer", "contract_duck", DuckMixer)
    assert registry.get("mixer", "contract_duck") is DuckMixer  # what the plugin registered
    assert DuckMixer.rotary_dim(DuckMixer.Config(), 32) is None and DuckMixer.mixes_tokens
    assert kinds.overrides(DuckMixer, kinds.Mixer) == ["new_state"]
    model = tiny_model(tiny_spec_with("mixer", "contract_duck"))
    assert model(torch.randint(0, 64, (1, 5))).shape[:2] == (1, 5)
    state = model.new_state(1, 8)
    with pytest.raises(TypeError, match="layer 0's decode state \\(DuckState\\) has no to_static"):
        state.to_static(8)
    with pytest.raises(TypeError, match="has no truncate"):
        state.truncate(0)


def test_a_misspelt_hook_warns_naming_part_method_and_hook(fresh):
    class Typo(DuckMixer):
        @staticmethod
        def shrunk(cfg, **sizes):
            return {}

        def new_sate(self, batch, max_len, *, dtype, device):
            return None

    with pytest.warns(UserWarning) as caught:
        fresh.add("mixer", "typo", Typo)
    said = sorted(str(w.message) for w in caught)
    assert len(said) == 2
    assert "Typo" in said[0] and "'new_sate'" in said[0] and "'new_state'" in said[0]
    assert "Typo" in said[1] and "'shrunk'" in said[1] and "'shrink'" in said[1]


def test_zoos_own_parts_register_without_a_warning():
    registry.manager().ensure_loaded()
    for kind, base in kinds.BASES.items():
        for entry in registry.manager().registry(kind).entries():
            assert kinds.misspelt_hooks(entry.obj, base) == [], f"{kind} {entry.name}"
            assert issubclass(entry.obj, base) or entry.provider != "zoo.components", f"{kind} {entry.name}"


def test_zoo_list_shows_the_hooks_a_part_overrides():
    from zoo.commands.list import rows

    attention = rows("mixer", "attention")[0]["hooks"]
    assert {"new_state", "rotary_dim", "heads", "cost", "facts", "shrink"} <= set(attention)
    assert rows("norm", "rmsnorm")[0]["hooks"] == ["kernel", "backends", "kernel_problem", "kernel_on_shards",
                                                  "reset_parameters", "activation_bytes", "tp_plan"]  # its plan is data
    assert rows("block", "serial")[0]["hooks"] == []  # its tensor-parallel plan is the Block default: each part's own


def test_required_hooks_are_checked_and_optional_ones_are_not(fresh):
    class NoFrequencies(nn.Module):
        @dataclass(frozen=True)
        class Config:
            pass

        def __init__(self, cfg, *, dim, theta):
            super().__init__()

    with pytest.raises(registry.InterfaceError, match="a `frequencies` method"):
        fresh.add("rope_scaling", "nofreq", NoFrequencies)


def test_docs_table_is_the_bases():
    docs = (ROOT / "docs" / "guides" / "plugins.md").read_text()
    found = re.search(r"<!-- contract table:.*?-->\n(.*?)\n<!-- end of contract table -->", docs, re.S)
    assert found, "docs/guides/plugins.md has no contract table"
    assert found.group(1) == kinds.contract_table()


def test_the_constructor_contract_is_the_bases():
    for kind, base in kinds.BASES.items():
        assert kinds.CONSTRUCTOR_CONTEXT[kind] == base.CONTEXT


def test_no_core_module_probes_for_a_hook():
    names = set().union(*(kinds.hooks(b) for b in (*kinds.BASES.values(), kinds.LayerState))) | {"attend", "head_dim_for"}
    names.discard("reset_parameters")  # also torch's own modules' method: init_weights asks it of those only
    probe = re.compile(r"(?:getattr|hasattr)\([^,]+,\s*[\"'](\w+)[\"']")
    found = []
    for path in (ROOT / "zoo").rglob("*.py"):
        if path.name == "kinds.py" or "components" in path.relative_to(ROOT / "zoo").parts:
            continue  # the contract itself, and the parts (a part may ask its own sub-parts)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {m}" for m in probe.findall(line) if m in names]
    assert found == []


class ConvPart(kinds.Mixer):
    """A mixer holding a Conv1d, with its own rule for the convolution's weights."""

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, d_model, layer, spec, index):
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, 3, groups=d_model, padding=2)
        self.index = index

    def forward(self, x, ctx, pos):
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    def new_state(self, batch, max_len, *, dtype, device):
        return None

    def reset_parameters(self):
        with torch.no_grad():
            self.conv.weight.fill_(0.5)
            self.conv.bias.zero_()


def test_a_parts_own_initialisation_is_final(scratch):
    scratch("mixer", "contract_conv", ConvPart)
    from zoo.model.decoder import build_model

    model = build_model(tiny_spec_with("mixer", "contract_conv"), seed=0)
    conv = model.layers[0].mixer.conv
    assert torch.equal(conv.weight, torch.full_like(conv.weight, 0.5)) and not conv.bias.any()
