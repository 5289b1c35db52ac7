import re
import json

from zoo.cli import main


def test_describe_json_figures(capsys):
    assert main(["describe", "llama2-70b", "--json", "--context", "4096", "--batch", "64", "--dtype", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert out["kv_cache"]["bytes"] == 2 * 80 * 8 * 128 * 2 * 4096 * 64
    assert out["components"]["attention"] == "GQA-8"
    assert out["params"]["total"] == 68_976_648_192


def test_describe_table_and_overrides(capsys):
    assert main(["describe", "gemma2-2b", "--set", "n_layers=2", "--context", "8192"]) == 0
    text = capsys.readouterr().out
    assert "[local] n_kv_heads" in text and re.search(r"\[local\] window +4096", text)
    assert "KV cache 8,192 x batch 1" in text
    assert "AdamW mixed-precision training" in text


def test_describe_unknown_model_says_what_to_do(capsys):
    assert main(["describe", "llama9-1b"]) == 2
    assert "unknown model 'llama9-1b'" in capsys.readouterr().err
