"""Training on prepared corpora: packed documents, mixtures from TOML and the command line, validation
in the log, the plot and the result, and exact resume (one process here; 2 -> 4 processes under torchrun)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zoo
from zoo.cli import main as cli
from zoo.training.shards import prepare

TINY = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
QUIET = dict(progress=False, export=False, cpu=True)
KW = dict(overrides=TINY, steps=6, seq_len=32, global_batch=8, micro_batch=4, lr=3e-3, warmup_steps=2, seed=1, **QUIET)

pytestmark = pytest.mark.usefixtures("one_thread")


def _corpus(tmp_path: Path, name: str, n: int = 120) -> Path:
    rows = [{"text": f"{name} {i}: " + " ".join(f"w{(i * j) % 17}" for j in range(3 + i % 11))} for i in range(n)]
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare([tmp_path / f"{name}.jsonl"], tmp_path / name, None, workers=1, shard_tokens=2000, progress=False)
    return tmp_path / name


def _metrics(out_dir: Path):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_validation_every_n_steps_is_logged_plotted_and_returned_and_a_resume_is_exact(tmp_path):
    a = _corpus(tmp_path, "a")
    val = dict(fraction=0.1, every=2, samples=8)
    whole = zoo.train("llama3-8b", data=[{"path": str(a)}], val=val, out_dir=str(tmp_path / "whole"), plot=True, **KW)
    rows = _metrics(tmp_path / "whole")
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 6]
    assert [v["step"] for v in whole.val] == [0, 2, 4, 6] and whole.val[-1]["val_loss"] < whole.val[0]["val_loss"]
    assert whole.plot is not None and whole.plot.is_file()
    cut = zoo.train("llama3-8b", data=[{"path": str(a)}], val=val, out_dir=str(tmp_path / "cut"), plot=False,
                    stop_after=3, **KW)
    resumed = zoo.train("llama3-8b", data=[{"path": str(a)}], val=val, out_dir=str(tmp_path / "cut"), plot=False, **KW)
    assert cut.losses + resumed.losses == whole.losses  # the same batches after the resume, bit for bit
    assert [r.get("val_loss") for r in _metrics(tmp_path / "cut")] == [r.get("val_loss") for r in rows]


def test_a_weighted_mixture_from_toml_and_from_the_command_line_are_the_same_run(tmp_path):
    a, b = _corpus(tmp_path, "a"), _corpus(tmp_path, "b")
    (tmp_path / "run.toml").write_text(
        f'data = [{{path = "{a}", weight = 3}}, {{path = "{b}", weight = 1}}]\npacking = "documents"\n'
        f'[val]\npath = "{b}"\nevery = 3\nsamples = 4\n')
    sets = [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]
    common = ["train", "llama3-8b", *sets, "--steps", "3", "--seq-len", "32", "--global-batch", "8", "--micro-batch",
              "4", "--cpu", "--no-progress", "--no-plot", "--no-export"]
    assert cli([*common, "--config", str(tmp_path / "run.toml"), "--out-dir", str(tmp_path / "toml")]) == 0
    assert cli([*common, "--data", f"{a}@3", f"{b}@1", "--val", f"path={b},every=3,samples=4",
                "--out-dir", str(tmp_path / "cli")]) == 0
    one, two = _metrics(tmp_path / "toml"), _metrics(tmp_path / "cli")
    assert [r["loss"] for r in one] == [r["loss"] for r in two] and "val_loss" in one[-1] and "val_loss" in two[-1]


def test_text_files_keep_working_and_refuse_what_needs_prepared_data(tmp_path):
    (tmp_path / "a.txt").write_text("plain text for the old path " * 40)
    r = zoo.train("llama3-8b", data=[str(tmp_path / "a.txt")], out_dir=str(tmp_path / "old"), plot=False,
                  **{**KW, "steps": 1})
    assert len(r.losses) == 1
    with pytest.raises(ValueError, match="sft needs prepared corpora"):
        zoo.train("llama3-8b", data=[str(tmp_path / "a.txt")], sft=True, out_dir=str(tmp_path / "x"), **KW)


@pytest.mark.slow  # torchrun: 2 then 4 processes
def test_a_run_resumed_on_four_processes_reads_what_two_would_have(tmp_path):
    a = _corpus(tmp_path, "a")
    args = ["-m", "zoo.cli", "train", "llama3-8b", "--cpu", "--no-progress", "--no-plot", "--no-export",
            "--data", str(a), "--steps", "4", "--seq-len", "32", "--global-batch", "8", "--micro-batch", "1",
            "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "2"]
    args += [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def torchrun(n, out, *more):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *args,
               "--out-dir", str(out), *more]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    torchrun(2, tmp_path / "two")
    torchrun(2, tmp_path / "moved", "--stop-after", "2")
    torchrun(4, tmp_path / "moved")
    two, moved = _metrics(tmp_path / "two"), _metrics(tmp_path / "moved")
    assert [r["step"] for r in moved] == [1, 2, 3, 4]
    # The same samples each step: the losses agree up to the order of the processes' float32 sums.
    assert [r["loss"] for r in moved] == pytest.approx([r["loss"] for r in two], rel=1e-5)


def test_zoo_data_prepare_and_zoo_eval_on_the_prepared_corpus(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"text {i} " * (i % 9 + 2)}) + "\n" for i in range(60)))
    run = zoo.train("llama3-8b", out_dir=str(tmp_path / "run"), plot=False, **{**KW, "steps": 1, "export": True})
    final = str(run.export)
    assert cli(["data", "prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "p"), "--tokenizer", final,
                "--workers", "1", "--no-progress"]) == 0
    assert "60 documents" in capsys.readouterr().out
    assert cli(["eval", final, "--data", str(tmp_path / "p"), "--window", "32", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["packing"] == "documents" and summary["sequences"] > 10 and 0 < summary["loss"] < 10
    assert cli(["eval", final, "--data", str(tmp_path / "p"), "--text", "x.txt"]) == 2  # one of the two
