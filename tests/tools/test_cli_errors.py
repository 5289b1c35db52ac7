"""Bad command-line input is a one-line error with exit code 2, never a traceback; zoo's own checks
come before any output and before transformers runs."""

import json

import importlib

import pytest

from zoo.cli import main

from test_cli_generate import checkpoint  # noqa: F401,E402  (a tiny llama with a byte tokenizer.json)

V = importlib.import_module("zoo.tools.verification")  # the module; `zoo.verify` is the function

tiny = pytest.importorskip("zoo.checkpoints.tiny")
pytest.importorskip("transformers")

TRAIN = ["train", "llama3-8b", "--set", "n_layers=1", "--set", "d_model=32", "--set", "vocab_size=256",
         "--set", "layers.*.mixer.n_heads=4", "--set", "layers.*.mixer.n_kv_heads=2", "--cpu",
         "--no-progress"]


@pytest.fixture
def no_reference(monkeypatch):
    """transformers must not run: zoo's own checks come first."""
    monkeypatch.setattr(V, "run_reference", lambda *a, **k: pytest.fail("transformers ran first"))


def one_line_error(capsys, argv, match):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zoo {argv[0]}: error: "), captured.err
    assert match in lines[0], lines[0]
    return captured


def test_describe_with_a_device_that_does_not_exist(capsys):
    one_line_error(capsys, ["describe", "llama3-8b", "--set", "n_layers=1", "--backends", "tpu"],
                   "--backends 'tpu' is not a device; use cuda or cpu")


@pytest.mark.parametrize("dtype", ["int8", "float99"])
def test_generate_with_a_dtype_weights_cannot_load_in(checkpoint, capsys, dtype):
    one_line_error(capsys, ["generate", str(checkpoint), "--prompt", "Hi", "--dtype", dtype],
                   f"dtype {dtype!r} is not a floating-point dtype")


def test_generate_validates_before_printing_the_prompt(checkpoint, capsys):
    out = one_line_error(capsys, ["generate", str(checkpoint), "--prompt", "Hello", "-n", "100000000"],
                         "beyond zoo's limit on a context")
    assert out.out == ""


def test_train_with_an_unreadable_tokenizer(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("this is not json")
    one_line_error(capsys, TRAIN + ["--tokenizer", str(tmp_path / "tokenizer.json"), "--out-dir", str(tmp_path)],
                   "tokenizer.json is not a tokenizer.json that the tokenizers library can read")


def test_train_with_fsdp_in_a_single_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(importlib.import_module("zoo.training.loop"), "build_model",
                        lambda *a, **k: pytest.fail("built a model before the FSDP check"))
    one_line_error(capsys, TRAIN + ["--fsdp", "--out-dir", str(tmp_path)], "fsdp: FSDP2 needs a process group")


@pytest.mark.parametrize("args, match", [
    (["--seq-len", "0"], "seq_len must be a positive integer, got 0"),
    (["--seq-len", "-1"], "seq_len must be a positive integer, got -1"),
    (["--batch-size", "0"], "batch_size must be a positive integer, got 0"),
    (["--seq-len", "100000000"], "seq_len 100000000 is beyond zoo's limit on a context, 16777216"),
    (["--batch-size", "10000000"], "seq_len 32 x batch_size 10000000 would hold about"),
])
def test_verify_sizes_are_checked_before_transformers_runs(checkpoint, capsys, no_reference, args, match):
    one_line_error(capsys, ["verify", str(checkpoint), *args], match)


def test_verify_with_a_malformed_reference_file(checkpoint, tmp_path, capsys, no_reference):
    from safetensors.torch import save_file
    import torch

    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    one_line_error(capsys, ["verify", str(checkpoint), "--reference", str(tmp_path / "junk.safetensors")],
                   "junk.safetensors is not a safetensors file")
    save_file({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, str(tmp_path / "partial.safetensors"))
    one_line_error(capsys, ["verify", str(checkpoint), "--reference", str(tmp_path / "partial.safetensors")],
                   "partial.safetensors lacks logits")
    save_file({"input_ids": torch.full((2, 4), 999), "logits": torch.zeros(2, 4, 256)}, str(tmp_path / "ids.safetensors"))
    one_line_error(capsys, ["verify", str(checkpoint), "--reference", str(tmp_path / "ids.safetensors")],
                   "input_ids hold ids outside this checkpoint's vocabulary [0, 256)")


def test_verify_saving_a_reference_into_a_missing_directory(checkpoint, tmp_path, capsys, no_reference):
    one_line_error(capsys, ["verify", str(checkpoint), "--save-reference", str(tmp_path / "nope" / "ref.safetensors")],
                   "save_reference: the directory of")


def test_verify_refuses_a_config_zoo_cannot_read_before_transformers_runs(checkpoint, tmp_path, capsys,
                                                                          no_reference):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "no_such_activation"}))
    one_line_error(capsys, ["verify", str(bad)], "no_such_activation")


def test_verify_tiny_help_says_it_takes_a_model_type(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "--tiny MODEL_TYPE" in capsys.readouterr().out


def test_lm_eval_without_the_harness_installed_names_the_extra(capsys, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "zoo.tools.harness", raising=False)  # imported afresh, and put back after
    for name in ["lm_eval"] + [m for m in sys.modules if m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the lmeval extra were not installed
    one_line_error(capsys, ["lm-eval", "--model", "zoo", "--tasks", "x"], "pip install 'zoo-lm[lmeval]'")


# -- zoo export of a training checkpoint that is not what its state.json says ---------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training checkpoint of one step of a tiny Llama (the CLI's own run)."""
    out = tmp_path_factory.mktemp("run")
    assert main(TRAIN + ["--steps", "1", "--seq-len", "8", "--global-batch", "2", "--micro-batch", "2", "--out-dir",
                         str(out), "--no-plot", "--no-export"]) == 0
    (step,) = sorted((out / "checkpoints").iterdir())
    return step


def copy_of(step, tmp_path):
    import shutil

    dst = tmp_path / step.name
    shutil.copytree(step, dst)
    return dst


def test_export_of_a_checkpoint_whose_state_describes_another_model(trained, tmp_path, capsys):
    """Exported with exit 0 into a directory that could not load; the stored shapes are compared with the
    spec first, as resume compares them."""
    step = copy_of(trained, tmp_path)
    state = json.loads((step / "state.json").read_text())
    state["spec"]["d_model"] = 64
    (step / "state.json").write_text(json.dumps(state))
    one_line_error(capsys, ["export", str(step), str(tmp_path / "out")],
                   "its weights are not those of the model its state.json describes (embed.weight is (256, 32), "
                   "the spec's model has (256, 64)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, match", [("not json", "state.json: not valid JSON"),
                                         ("[1, 2]", "state.json: is a JSON list, not an object"),
                                         ('{"step": 1}', "state.json: has no spec")])
def test_export_of_a_checkpoint_whose_state_json_is_damaged(trained, tmp_path, capsys, text, match):
    step = copy_of(trained, tmp_path)
    (step / "state.json").write_text(text)
    one_line_error(capsys, ["export", str(step), str(tmp_path / "out")], match)


def test_export_of_a_checkpoint_with_a_truncated_shard(trained, tmp_path, capsys):
    step = copy_of(trained, tmp_path)
    shard = max((p for p in step.rglob("*.safetensors") if "optim" not in str(p) and "rng" not in p.name),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-100])
    one_line_error(capsys, ["export", str(step), str(tmp_path / "out")], "cut short")


# -- eval, generate and export: each bad value named ---------------------------------------------

@pytest.mark.parametrize("args, match", [
    (["--stride", "0"], "--stride must be at least 1, got 0"),
    (["--window", "1"], "--window must be at least 2, got 1"),
    (["--window", "8", "--stride", "9"], "--stride 9 is longer than the window 8"),
    (["--device", "nonsense"], "--device 'nonsense' is not a device"),
])
def test_eval_settings_are_refused_by_name(checkpoint, tmp_path, capsys, args, match):
    (tmp_path / "a.txt").write_text("some text to score, long enough")
    one_line_error(capsys, ["eval", str(checkpoint), "--text", str(tmp_path / "a.txt"), "--no-progress", *args], match)


@pytest.mark.parametrize("content, match", [(b"", "a.txt: the file is empty"), (b"   \n", "a.txt: the file is empty"),
                                            (b"x", "a.txt: the text is 1 token(s) long"),
                                            (b"\x89PNG\r\n\x1a\n\xff\xfe", "a.txt: not UTF-8 text")])
def test_eval_names_a_text_file_it_cannot_score(checkpoint, tmp_path, capsys, content, match):
    (tmp_path / "a.txt").write_bytes(content)
    one_line_error(capsys, ["eval", str(checkpoint), "--text", str(tmp_path / "a.txt"), "--no-progress"], match)


def test_eval_shows_progress_and_scores_each_token_once_by_default(checkpoint, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 4)
    assert main(["eval", str(checkpoint), "--text", str(tmp_path / "a.txt"), "--window", "64", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["total"]["stride"] == 64
    assert "eval" in captured.err and "tok/s" in captured.err


def test_generate_with_a_device_that_does_not_exist(checkpoint, capsys):
    one_line_error(capsys, ["generate", str(checkpoint), "--prompt", "Hi", "--device", "tpu:9"],
                   "--device 'tpu:9' is not a device")


def test_export_gguf_onto_a_directory(checkpoint, tmp_path, capsys):
    pytest.importorskip("gguf")
    one_line_error(capsys, ["export", str(checkpoint), str(tmp_path), "--gguf"], "is a directory; a GGUF is one file")


def test_train_with_a_seed_beyond_torch_s_range(tmp_path, capsys):
    one_line_error(capsys, TRAIN + ["--seed", str(2 ** 70), "--out-dir", str(tmp_path)],
                   "TrainConfig.seed must be in [0, 2**63), got 1180591620717411303424")


@pytest.mark.parametrize("name, content, match", [
    ("tokenizer_config.json", "{not json", "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", "[1]", "tokenizer_config.json must hold a JSON object"),
    ("generation_config.json", "{", "generation_config.json is not valid JSON"),
    ("chat_template.jinja", b"\xff\xfe\x00", "chat_template.jinja is not UTF-8 text"),
])
def test_a_broken_tokenizer_file_is_named(checkpoint, tmp_path, capsys, name, content, match):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    (bad / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line_error(capsys, ["generate", str(bad), "--prompt", "Hi"], match)


def test_a_config_with_no_attention_heads_is_refused_by_name(checkpoint, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    one_line_error(capsys, ["generate", str(bad), "--prompt", "Hi"],
                   "'num_attention_heads' (llama): must be a positive integer, got 0")
