"""`zoo verify --dtype bfloat16` judges zoo by the reference's own bf16 error: a correct load of a
checkpoint whose bf16 logits are noisy passes (transformers' own bf16 run misses the fixed 0.95 top-1
bar there), a wrong weight still fails, and a stored reference judges the same way."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints.tiny import make_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """A tiny llama with large random weights (std 0.5): bf16 rounding flips many top-1 tokens."""
    d = tmp_path_factory.mktemp("noisy")
    make_tiny("llama", d / "good", std=0.5)
    return d


def top1_of_transformers_bf16_against_its_fp32(directory, ids):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
        with torch.no_grad():
            out[dtype] = hf(ids).logits.float()
    return float((out[torch.float32].argmax(-1) == out[torch.bfloat16].argmax(-1)).float().mean())


def test_a_correct_load_passes_where_the_reference_itself_misses_the_fixed_bar(noisy):
    good = noisy / "good"
    report = zoo.verify(good, dtype="bfloat16", seq_len=64, save_reference=noisy / "ref.safetensors")
    ids = load_file(noisy / "ref.safetensors")["input_ids"]
    own = top1_of_transformers_bf16_against_its_fp32(good, ids)
    assert own < 0.95  # transformers' bf16 against its own fp32: the old fixed bar would fail transformers too
    assert report.reference_error["top1"] == pytest.approx(own)
    assert report.passed, report.summary()
    assert report.tolerances["top1"] == pytest.approx(1 - 2 * (1 - own))
    assert "reference's float32 run" in report.summary()
    stored = load_file(noisy / "ref.safetensors")
    assert stored["float32_logits"].shape == stored["logits"].shape
    again = zoo.verify(good, reference=noisy / "ref.safetensors")
    assert again.passed and again.float32 == report.float32 and again.reference_error == report.reference_error


def test_a_wrong_weight_still_fails_in_bf16(noisy, tmp_path):
    zoo.verify(noisy / "good", dtype="bfloat16", seq_len=64, save_reference=tmp_path / "ref.safetensors")
    tensors = load_file(noisy / "good" / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((noisy / "good" / "config.json").read_text())
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    bad = zoo.verify(tmp_path / "bad", reference=tmp_path / "ref.safetensors")
    assert bad.dtype == "bfloat16" and not bad.passed
