"""DeepSeek-V3's selection bias stays float32 in a bfloat16 model, as transformers keeps it
(``_keep_in_fp32_modules_strict = ["e_score_correction_bias"]``): rounded to bfloat16 it picks other
experts. The router declares the tensor (``fp32_tensors``); loading with and without ``dtype=``,
``model.to(...)``, ``build_model(dtype=...)`` and a save/load round trip all honour it."""

import pytest
import torch
from safetensors import safe_open

import zoo
from zoo.checkpoints import CheckpointError

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny deepseek_v3 written by transformers, its selection biases drawn close together around 1
    (differences of a few 1e-3, below bfloat16's step of 2^-7 there), so that rounding them matters."""
    d = tmp_path_factory.mktemp("dsv3")
    hf = tiny.make_tiny("deepseek_v3", d, std=0.1)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith(BIAS):
                b.copy_(1.0 + 0.01 * torch.rand(b.shape, generator=gen))
    hf.save_pretrained(d)
    return d


def routers(model):
    return [layer.ffn.router for layer in model.layers if layer.ffn.__class__.__name__ == "MoE"]


def hidden(n=256, d=64, seed=0):
    return (torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)


def chosen(indices):
    return indices.sort(-1).values


@torch.no_grad()
def test_bf16_loads_keep_the_bias_fp32_and_choose_as_transformers(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    ours = zoo.from_pretrained(checkpoint, dtype=torch.bfloat16)
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    mine = routers(ours)
    assert len(gates) == len(mine) == 2
    x = hidden()
    differs = 0
    for gate, router in zip(gates, mine):
        assert gate.e_score_correction_bias.dtype == router.bias.dtype == torch.float32
        assert router.weight.dtype == torch.bfloat16
        assert torch.equal(router.bias, gate.e_score_correction_bias)
        want = chosen(gate(x)[2])
        assert torch.equal(chosen(router(x).indices), want)  # every token, every layer
        # The same router with its bias rounded to bfloat16 (as zoo loaded it before) chooses otherwise.
        exact = router.bias.clone()
        router.bias = exact.bfloat16().float()
        differs += (chosen(router(x).indices) != want).any(-1).sum().item()
        router.bias = exact
    assert differs > 0


@torch.no_grad()
def test_casting_a_model_keeps_the_declared_tensors_fp32(checkpoint):
    ours = zoo.from_pretrained(checkpoint)
    exact = [r.bias.clone() for r in routers(ours)]
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16)):
        model = cast(ours)
        assert model.embed.weight.dtype != torch.float32
        for router, bias in zip(routers(model), exact):
            assert router.bias.dtype == torch.float32 and torch.equal(router.bias, bias)
    wide = ours.to(torch.float64)  # a wider model takes the bias with it
    assert {r.bias.dtype for r in routers(wide)} == {torch.float64}
    built = zoo.build_model(ours.spec, dtype=torch.bfloat16)
    assert {r.bias.dtype for r in routers(built)} == {torch.float32}
    assert built.embed.weight.dtype == torch.bfloat16


@torch.no_grad()
def test_a_bf16_save_writes_the_bias_fp32_and_loads_back(checkpoint, tmp_path):
    model = zoo.from_pretrained(checkpoint, dtype=torch.bfloat16)
    zoo.save_pretrained(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {v for k, v in dtypes.items() if k.endswith(BIAS)} == {"F32"}
    assert {v for k, v in dtypes.items() if not k.endswith(BIAS)} == {"BF16"}
    back = zoo.from_pretrained(tmp_path)  # mixed as stored, yet not refused: the bias is declared fp32
    for a, b in zip(routers(model), routers(back)):
        assert b.bias.dtype == torch.float32 and torch.equal(a.bias, b.bias)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    x = hidden(seed=1)
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    for gate, router in zip(gates, routers(back.to(torch.bfloat16))):
        assert torch.equal(gate.e_score_correction_bias, router.bias)
        assert torch.equal(chosen(gate(x)[2]), chosen(router(x).indices))


def test_another_odd_dtype_is_still_refused(checkpoint, tmp_path):
    model = zoo.from_pretrained(checkpoint)
    model.lm_head.weight.data = model.lm_head.weight.data.half()
    zoo.save_pretrained(model, tmp_path)
    with pytest.raises(CheckpointError, match="lm_head.weight.*mixed dtypes"):
        zoo.from_pretrained(tmp_path)
