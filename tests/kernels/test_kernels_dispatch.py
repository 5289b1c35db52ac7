"""Which path runs: the reference by default on the CPU, fast paths on CUDA when the dtype and shapes
allow, ``ZOO_KERNELS`` / the Python API to switch them off or force them, and everything working
without Triton. Decisions for CUDA are checked by device name, so no GPU is needed."""

import importlib.util

import pytest
import torch

import zoo
from zoo.core import kernels


def tiny(name="gemma2-2b", **over):
    base = {"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 48, "layers.local.mixer.window": 4} \
        if name.startswith("gemma2") else {"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 48}
    return zoo.build(name, n_layers=2, d_model=32, vocab_size=100, seed=0, overrides={**base, **over})


@pytest.fixture
def spy(monkeypatch):
    ran = []
    real = kernels.implementation
    monkeypatch.setattr(kernels, "implementation", lambda c, b: ran.append((c, b)) or real(c, b))
    return ran


@pytest.fixture
def no_triton(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    kernels.refresh()  # forget that Triton was found
    yield
    monkeypatch.undo()
    kernels.refresh()


def rows(model, **kw):
    return {r["component"]: r for r in kernels.backend_table(model, **kw)}


def test_cpu_default_runs_the_reference(monkeypatch, spy):
    monkeypatch.delenv(kernels.ENV, raising=False)
    model = tiny()
    model.loss(torch.randint(0, 100, (2, 6))).loss.backward()
    assert spy == []
    table = rows(model)
    assert {r["backend"] for c, r in table.items() if c != "attention"} == {"torch"}
    assert table["attention"]["backend"] == "eager"  # soft-capped: the eager reference
    assert "cpu" in table["rmsnorm"]["reason"]


def test_cuda_decisions_pick_fast_paths_where_they_apply(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    monkeypatch.delenv(kernels.ENV, raising=False)
    table = rows(tiny(), device="cuda", dtype=torch.bfloat16)
    assert {c: r["backend"] for c, r in table.items()} == {
        "rmsnorm": "triton", "rope": "triton", "glu": "triton", "loss": "triton", "attention": "flex"}
    assert table["rmsnorm"]["modules"][:2] == ["layers.0.attn_norm", "layers.0.ffn_norm"]
    # no soft-cap and no window: SDPA covers attention; float64 has no kernels
    llama = rows(tiny("llama3-8b"), device="cuda", dtype=torch.bfloat16)
    assert llama["attention"]["backend"] == "sdpa" and "SDPA covers" in llama["attention"]["reason"]
    f64 = rows(tiny("llama3-8b"), device="cuda", dtype=torch.float64)
    assert f64["rmsnorm"]["backend"] == "torch" and "float64" in f64["rmsnorm"]["reason"]


def test_rows_too_wide_for_one_block_stay_on_the_reference():
    norm = zoo.get("norm", "rmsnorm")(zoo.get("norm", "rmsnorm").Config(), dim=70000)
    d = kernels.decide(norm, "cuda", torch.bfloat16)
    assert d.backend is None and "65536" in d.reason


@pytest.mark.parametrize("how", ["env", "configure", "using"])
def test_off_switches_every_fast_path_off(monkeypatch, how):
    model = tiny()
    if how == "env":
        monkeypatch.setenv(kernels.ENV, "off")
        table = rows(model, device="cuda", dtype=torch.bfloat16)
    elif how == "configure":
        kernels.configure("off")
        try:
            table = rows(model, device="cuda", dtype=torch.bfloat16)
        finally:
            kernels.configure(None)
    else:
        with kernels.using("off"):
            table = rows(model, device="cuda", dtype=torch.bfloat16)
    assert not any(r["fast"] for r in table.values())
    assert all("switched off" in r["reason"] for r in table.values())


def test_per_component_settings(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "rmsnorm:off, attention:eager")
    table = rows(tiny("llama3-8b"), device="cuda", dtype=torch.bfloat16)
    assert table["rmsnorm"]["backend"] == "torch"
    assert table["attention"]["backend"] == "eager" and "forced" in table["attention"]["reason"]
    with kernels.using("attention:sdpa"):  # the API takes precedence over the environment
        assert rows(tiny("llama3-8b"))["attention"]["backend"] == "sdpa"
        assert rows(tiny("llama3-8b"))["rmsnorm"]["reason"] != "switched off (ZOO_KERNELS)"
    assert rows(tiny("llama3-8b"))["rmsnorm"]["reason"] == "switched off (ZOO_KERNELS)"


def test_forced_eager_attention_runs_eager(monkeypatch):
    model = tiny("llama3-8b")
    calls = []
    attn = model.layers[0].mixer
    monkeypatch.setattr(attn, "_eager", lambda *a: calls.append(1) or type(attn)._eager(attn, *a))
    ids = torch.randint(0, 100, (1, 5))
    model(ids)
    assert calls == []
    with kernels.using("attention:eager"):
        model(ids)
    assert calls == [1]


def test_forcing_triton_on_the_cpu_without_the_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(kernels.ENV, "rmsnorm:triton")
    if importlib.util.find_spec("triton") is None:
        match = "not installed"
    else:
        match = "Triton runs on CUDA"
    with pytest.raises(RuntimeError, match=f"ZOO_KERNELS forces rmsnorm:triton.*{match}"):
        tiny()(torch.randint(0, 100, (1, 4)))


@pytest.mark.parametrize("bad,message", [
    ("rmsnorn:off", "unknown component 'rmsnorn'"),
    ("rmsnorm:cuda", "rmsnorm:cuda is not a choice"),
    ("fastest", "is not a choice"),
    (":off", "cannot read"),
])
def test_bad_settings_name_the_variable_and_the_choices(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        kernels.configure(bad)
    assert "ZOO_KERNELS" in str(err.value)
    assert kernels._override is None


def test_without_triton_everything_runs_and_says_why(monkeypatch, no_triton, spy):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert not kernels.available() and "not installed" in kernels.available().reason
    model = tiny()
    model.loss(torch.randint(0, 100, (2, 6))).loss.backward()
    assert spy == []
    assert "not installed" in rows(model, device="cuda", dtype=torch.bfloat16)["rmsnorm"]["reason"]
    with kernels.using("triton"), pytest.raises(RuntimeError, match="not installed"):
        model(torch.randint(0, 100, (1, 4)))


def test_unknown_attention_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention has no fast backend 'flash9'.*flex"):
        kernels.attention_backend("flash9")


def test_kernel_backends_are_registered_parts():
    assert {"rmsnorm.triton", "layernorm.triton", "rope.triton", "glu.triton", "loss.triton",
            "attention.flex"} <= set(zoo.list_components("kernel"))
    for cls in (zoo.get("norm", "rmsnorm"), zoo.get("ffn", "swiglu"), zoo.get("position", "rope"),
                zoo.get("mixer", "attention")):
        fast = set(kernels.components()[cls.kernel])
        assert fast and fast <= set(cls.backends)


def test_describe_backends_prints_the_table(capsys, monkeypatch):
    from zoo.cli import main

    monkeypatch.setenv(kernels.ENV, "rmsnorm:off")
    assert main(["describe", "gemma2-2b", "--backends", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "gemma2-2b: backends on cpu, bfloat16" in out
    assert [line.split()[:4] for line in out.splitlines() if line.strip().startswith("rmsnorm")] == \
        [["rmsnorm", "RMSNorm", "105", "torch"]]  # 4 per layer x 26 + the final norm
    assert "switched off (ZOO_KERNELS)" in out
