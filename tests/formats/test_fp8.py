"""Block-scaled FP8 checkpoints (DeepSeek-V3's layout): dequantised on load, tensor by tensor.

A tiny llama written by transformers is quantised here, block by block, by a quantiser of the
test's own (amax / 448 per 128 x 128 block, partial blocks at the edges), and checked against a
dequantisation written independently of zoo's: element by element, each weight times the scale
of the block its index falls in.
"""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints import CheckpointError, ConfigError, config_to_spec, ignored_fields
from zoo.checkpoints.quantized import dequantize_blocks
from zoo.checkpoints.tiny import make_tiny

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

transformers = pytest.importorskip("transformers")

B = 128
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [B, B]}
# Partial blocks in both directions: q_proj (160, 128), gate/up (200, 128), down (128, 200), and
# 2-block-wide rows (200 = 128 + 72).
PARTIAL = {"hidden_size": 128, "intermediate_size": 200, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 40, "vocab_size": 128, "num_hidden_layers": 2}
# Every dimension a multiple of the block or within one block: transformers' dequantising load
# agrees with the block layout only on such shapes (see docs/reference/checkpoints.md).
WHOLE = {**PARTIAL, "intermediate_size": 256, "head_dim": 32}


def quantize(w: torch.Tensor, B: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale = amax / 448 over each (possibly partial) B x B block."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / B), math.ceil(cols / B))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * B:(i + 1) * B, j * B:(j + 1) * B].float()
            s[i, j] = block.abs().max() / 448.0
            q[i * B:(i + 1) * B, j * B:(j + 1) * B] = (block / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def reference_dequantize(q: torch.Tensor, s: torch.Tensor, B: int = B) -> torch.Tensor:
    """w[..., i, j] = q[..., i, j] * s[..., i // B, j // B], by gathering each element's scale."""
    rows, cols = q.shape[-2:]
    i = torch.arange(rows)[:, None] // B
    j = torch.arange(cols)[None, :] // B
    return q.float() * s.float()[..., i, j]


def quantized_checkpoint(src, dst, *, split=False, block=B):
    """``src`` (written by transformers) with every projection of the layers quantised; the
    embeddings, norms, routers and head stay as stored (as in DeepSeek-V3). ``split`` writes two
    shards, each weight in the other shard from its scale."""
    tensors, dequantized = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and re.search(r"_proj(_with_mqa)?\.weight$", name):
            q, s = quantize(t, block)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            dequantized[name] = reference_dequantize(q, s, block)
        else:
            tensors[name] = t
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    quant = {**QUANT, "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    if split:
        shards = {n: ("model-00001-of-00002.safetensors" if n.endswith("_scale_inv") else
                      "model-00002-of-00002.safetensors") for n in tensors}
        for file in set(shards.values()):
            save_file({n: t for n, t in tensors.items() if shards[n] == file}, str(dst / file), metadata={"format": "pt"})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    else:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dequantized


def dequantized_checkpoint(src, dst, dequantized):
    """``src`` with the reference dequantisation in place of each quantised weight, unquantised."""
    dst.mkdir()
    save_file({**load_file(src / "model.safetensors"), **dequantized}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def rewrite(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(unquantised dir, fp8 dir, reference dequantisation of every quantised tensor)."""
    root = tmp_path_factory.mktemp("fp8")
    make_tiny("llama", root / "hf", overrides=PARTIAL, std=0.05)
    return root / "hf", root / "fp8", quantized_checkpoint(root / "hf", root / "fp8")


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        out = model(IDS)
    return getattr(out, "logits", out).float()  # a zoo model returns the logits, transformers' an output


@pytest.mark.parametrize("shape", [(256, 384), (200, 72), (300, 130), (130, 300), (5, 7), (2, 130, 260)])
def test_dequantize_blocks_is_the_block_layout(shape):
    torch.manual_seed(0)
    q = (torch.randn(shape) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(*shape[:-2], math.ceil(shape[-2] / B), math.ceil(shape[-1] / B)) + 0.5
    want = reference_dequantize(q, s)
    assert torch.equal(dequantize_blocks(q, s, (B, B), torch.float32), want)
    assert torch.equal(dequantize_blocks(q, s, (B, B), torch.bfloat16), want.to(torch.bfloat16))
    # transformers' FP8Linear reads partial blocks the same way (its dequantisation for the backward pass).
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    assert torch.equal(_dequantize_fp8_weight(q, s, [B, B], torch.float32), want)


def test_fp8_checkpoint_loads_dequantised(fp8):
    hf, d, dequantized = fp8
    model = zoo.from_pretrained(d)  # no dtype: the dtype the unquantised tensors are stored in
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.hf_config.get("quantization_config") is None
    # Each quantised weight is exactly the reference dequantisation, e.g. the 200 x 128 up-projection.
    assert torch.equal(model.layers[0].ffn.up.weight, dequantized["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.layers[1].ffn.down.weight, dequantized["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.layers[1].mixer.q_proj.weight, dequantized["model.layers.1.self_attn.q_proj.weight"])

    # Each weight is within e4m3 rounding of the unquantised one: half a unit in the last of 3
    # mantissa bits (2^-4 relative), or half the smallest subnormal step (2^-10 of the block's scale).
    original = load_file(hf / "model.safetensors")
    for name, w in dequantized.items():
        scale = load_file(d / "model.safetensors")[name + "_scale_inv"]
        per_element = scale.repeat_interleave(B, 0).repeat_interleave(B, 1)[: w.shape[0], : w.shape[1]]
        assert ((w - original[name]).abs() <= original[name].abs() * 2**-4 + per_element * 2**-10 + 1e-7).all()
    # End to end, the unquantised model's logits within what that error makes of them: ~2.7% per
    # weight, through 14 quantised projections in two layers ~7% of the logits.
    ours, ref = logits(model), logits(zoo.from_pretrained(hf))
    err = (ours - ref).norm() / ref.norm()
    assert 0 < err < 0.15, err


def test_fp8_logits_equal_the_reference_dequantisation(fp8, tmp_path):
    hf, d, dequantized = fp8
    dequantized_checkpoint(hf, tmp_path / "deq", dequantized)
    torch.testing.assert_close(logits(zoo.from_pretrained(d)), logits(zoo.from_pretrained(tmp_path / "deq")),
                               atol=0, rtol=0)
    # In bf16, each weight is the fp32 dequantisation rounded once.
    bf16 = zoo.from_pretrained(d, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert torch.equal(bf16.layers[0].ffn.gate.weight,
                       dequantized["model.layers.0.mlp.gate_proj.weight"].to(torch.bfloat16))


def test_scales_in_another_shard(fp8, tmp_path):
    hf, d, dequantized = fp8
    quantized_checkpoint(hf, tmp_path / "split", split=True)
    model = zoo.from_pretrained(tmp_path / "split")
    assert torch.equal(model.layers[1].ffn.down.weight, dequantized["model.layers.1.mlp.down_proj.weight"])


def test_matches_transformers_dequantising_load(tmp_path):
    make_tiny("llama", tmp_path / "hf", overrides=WHOLE, std=0.05)
    quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8")
    cfg = transformers.FineGrainedFP8Config(dequantize=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=cfg, dtype=torch.float32, attn_implementation="eager").eval()
    assert isinstance(ref.model.layers[0].mlp.up_proj, torch.nn.Linear)  # dequantised, not FP8Linear
    torch.testing.assert_close(logits(zoo.from_pretrained(tmp_path / "fp8")), logits(ref), atol=1e-5, rtol=0)


def test_deepseek_v3_fp8(tmp_path):
    """DeepSeek-V3's own format, quantised in 32 x 32 blocks so that its tiny MLA projections, dense
    FFN, shared and routed experts all end in partial blocks; the routers and their randomised
    selection bias stay unquantised, as released."""
    make_tiny("deepseek_v3", tmp_path / "hf", std=0.1)
    rewrite(tmp_path / "hf", lambda t: t.update({n: torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
                                                 for n, v in t.items() if n.endswith("e_score_correction_bias")}))
    dequantized = quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8", block=32)
    assert {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= set(dequantized)
    dequantized_checkpoint(tmp_path / "hf", tmp_path / "deq", dequantized)
    model = zoo.from_pretrained(tmp_path / "fp8")
    assert model.checkpoint_format == "deepseek_v3"
    assert torch.equal(logits(model), logits(zoo.from_pretrained(tmp_path / "deq")))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    torch.testing.assert_close(logits(model), logits(ref), atol=1e-5, rtol=0)
    # In bf16: the fp32 dequantisation rounded once, so the same model as the dequantised checkpoint in bf16.
    assert torch.equal(logits(zoo.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)),
                       logits(zoo.from_pretrained(tmp_path / "deq", dtype=torch.bfloat16)))


def test_save_writes_the_dequantised_model(fp8, tmp_path):
    hf, d, dequantized = fp8
    model = zoo.from_pretrained(d, dtype=torch.bfloat16)
    zoo.save_pretrained(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(n.endswith("_scale_inv") for n in saved)
    assert saved["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"],
                       dequantized["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    again = zoo.from_pretrained(tmp_path / "out")
    assert torch.equal(logits(again), logits(model))


def test_verify_an_fp8_directory(tmp_path):
    make_tiny("llama", tmp_path / "hf", overrides=WHOLE, std=0.05)
    quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8")
    report = zoo.verify(tmp_path / "fp8", seq_len=16)
    assert report.passed, report


def test_the_released_deepseek_v3_config():
    """Its quantization_config is the layout above; the spec is the unquantized model's."""
    from pathlib import Path

    from zoo.checkpoints.quantized import read_quantization

    config = json.loads((Path(__file__).parents[1] / "data" / "configs" / "deepseek-ai--DeepSeek-V3.json").read_text())
    assert read_quantization(config).block == (128, 128)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    assert config_to_spec(config).to_dict() == config_to_spec(plain).to_dict()
    assert "quantization_config" not in ignored_fields(config)  # read, not passed over


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "fbgemm_fp8"])
def test_unknown_quantization_is_refused_by_name(fp8, tmp_path, method):
    hf, _, _ = fp8
    config = json.loads((hf / "config.json").read_text())
    d = tmp_path / method
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": method}}))
    (d / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=rf"'quantization_config.quant_method'.*'{method}'.*{d / 'config.json'}"):
        zoo.from_pretrained(d)
    with pytest.raises(ConfigError, match=rf"'{method}'"):
        config_to_spec({**config, "quantization_config": {"quant_method": method}})


@pytest.mark.parametrize("change, field", [
    ({"quant_method": None}, "quant_method"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"expert_dtype": "fp4"}, "expert_dtype"),
])
def test_fp8_settings_zoo_cannot_follow(fp8, change, field):
    config = json.loads((fp8[0] / "config.json").read_text())
    quant = {k: v for k, v in {**QUANT, **change}.items() if v is not None or k == "weight_block_size"}
    with pytest.raises(ConfigError, match=rf"'quantization_config.{field}'"):
        config_to_spec({**config, "quantization_config": quant})
    # The fields transformers reads and zoo has no use for once the weights are dequantised are accepted.
    extra = {"modules_to_not_convert": ["lm_head"], "dequantize": False, "scale_fmt": "ue8m0"}
    assert config_to_spec({**config, "quantization_config": {**QUANT, **extra}}).d_model == 128


@pytest.fixture
def copy(fp8, tmp_path):
    d = tmp_path / "copy"
    d.mkdir()
    for f in fp8[1].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


W = "model.layers.1.mlp.down_proj.weight"


def test_without_dtype_dequantised_weights_take_the_stored_dtype(copy, fp8):
    # As released: everything but the fp8 projections (and their fp32 scales) in bf16.
    rewrite(copy, lambda t: t.update({n: v.to(torch.bfloat16) for n, v in t.items()
                                      if v.dtype == torch.float32 and not n.endswith("_scale_inv")}))
    model = zoo.from_pretrained(copy)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.layers[1].ffn.down.weight, fp8[2][W].to(torch.bfloat16))


@pytest.mark.parametrize("edit, message", [
    # (128, 200) in 128 x 128 blocks needs a (1, 2) grid
    (lambda t: t.update({W + "_scale_inv": torch.ones(1, 1)}),
     rf"scale '{W}_scale_inv' has shape \(1, 1\).*\(128, 200\).*needs \(1, 2\)"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)}),
     r"scale 'model.layers.0.mlp.extra.weight_scale_inv' has no weight"),
    (lambda t: t.pop(W + "_scale_inv"), rf"'{W}' is torch.float8_e4m3fn but has no scale"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
     r"'model.norm.weight' has the scale .* stored as torch.float32"),
    (lambda t: t.update({W + "_scale_inv": torch.ones(1, 2, dtype=torch.int32)}), rf"'{W}_scale_inv' is torch.int32"),
])
@pytest.mark.parametrize("mode", ["dequantize", "keep"])
def test_bad_scales_name_the_tensor(copy, edit, message, mode):
    rewrite(copy, edit)
    with pytest.raises(CheckpointError, match=message):
        zoo.from_pretrained(copy, fp8=mode)


@pytest.mark.parametrize("mode", ["dequantize", "keep"])
def test_block_size_that_does_not_fit_the_scales(copy, mode):
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"scale '.*_scale_inv' has shape .* 64x64 blocks"):
        zoo.from_pretrained(copy, fp8=mode)
