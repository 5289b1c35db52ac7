"""zoo.verify / `zoo verify`: the comparison with the reference, stored references, the tiny sweep."""

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.cli import main
from zoo.checkpoints.tiny import make_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_tiny("llama", d)
    return d


def test_verify_matches_and_locates(tiny_llama, tmp_path, monkeypatch):
    ref_file = tmp_path / "ref.safetensors"
    report = zoo.verify(tiny_llama, save_reference=ref_file, seq_len=24)
    assert report.passed and report.model_type == "llama" and report.shape == (2, 24)
    assert report.max_abs < 1e-4 and report.top1 == 1.0 and len(report.hidden) == 3  # embeddings + 2 layers
    stored = load_file(ref_file)
    assert stored["input_ids"].shape == (2, 24) and stored["logits"].shape == (2, 24, 128)

    # Against the stored reference, with transformers unavailable.
    monkeypatch.setitem(sys.modules, "transformers", None)
    again = zoo.verify(tiny_llama, reference=ref_file)
    assert again.passed and again.max_abs == report.max_abs and again.hidden == report.hidden

    # Break layer 1 (0-based) of the checkpoint: verification fails and says where.
    tensors = load_file(tiny_llama / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama / "config.json").read_text())
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 1.01
    save_file(tensors, broken / "model.safetensors")
    bad = zoo.verify(broken, reference=ref_file)
    assert not bad.passed and bad.worst_layer == 2
    assert bad.hidden[1] < 1e-4 < bad.hidden[2]
    assert "first departs at layer 2" in bad.summary()
    assert main(["verify", str(broken), "--reference", str(ref_file)]) == 1
    assert main(["verify", str(tiny_llama), "--reference", str(ref_file)]) == 0


def test_verify_bf16(tiny_llama):
    report = zoo.verify(tiny_llama, dtype="bfloat16")
    assert report.passed and report.dtype == "bfloat16"
    assert report.max_abs > 0  # bf16 rounding shows, but the distributions agree
    assert report.mean_kl < 1e-2


def test_cli_tiny(capsys):
    assert main(["verify", "--tiny", "gpt2"]) == 0
    # gemma's tiny config has 16 positions with dynamic RoPE scaling: the default 32 tokens run past
    # max_seq_len, as transformers lets them (the README's main command verifies every model_type).
    assert main(["verify", "--tiny", "gemma"]) == 0
    out = capsys.readouterr().out
    assert "gpt2" in out and "PASS" in out and "1/1 model_types match transformers" in out
    assert main(["verify", "--tiny", "nonesuch"]) == 2
