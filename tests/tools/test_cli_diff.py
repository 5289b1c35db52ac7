import json

from zoo.cli import main


def test_original_transformer_against_llama2(capsys):
    """The lecture's table: post-norm -> pre-norm, LayerNorm -> RMSNorm, sinusoidal -> RoPE,
    ReLU MLP -> SwiGLU, biases -> none; Llama 2 7B still has MHA (GQA came with 70B)."""
    assert main(["diff", "transformer-2017", "llama2-7b", "--json"]) == 0
    rows = {r["row"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["block"]["a"] == "serial(norm_position=post)" and rows["block"]["b"] == "serial"
    assert rows["norm"]["a"].startswith("layernorm") and rows["norm"]["b"].startswith("rmsnorm")
    assert (rows["position"]["a"], rows["position"]["b"]) == ("sinusoidal", "rope")
    assert "relu" in rows["ffn"]["a"] and rows["ffn"]["b"].startswith("swiglu")
    assert (rows["linear biases"]["a"], rows["linear biases"]["b"]) == ("yes", "no")
    assert all(rows[k]["differs"] for k in ("block", "norm", "position", "ffn", "linear biases"))
    assert rows["attention"] == {"row": "attention", "a": "MHA", "b": "MHA", "differs": False}


def test_diff_marks_only_differences(capsys):
    assert main(["diff", "llama2-7b", "llama2-70b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    marked = {line.split()[1] for line in lines if line.startswith("*")}
    assert {"d_model", "layers", "attention"} <= marked
    assert "norm" not in marked and "position" not in marked
