"""zoo ablate: the sweep on a tiny grid, skipping done runs, divergence, bad input, trackers, plots."""

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.tools.accounting import account
from zoo.tools import ablate
from zoo.cli import main as cli

T = importlib.import_module("zoo.training.loop")
EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "ablations").glob("*.toml"))

TINY_FILE = """
[ablation]
claim = "GQA trades KV memory for little loss"
base = "llama3-8b"
lrs = [1e-3, 1e-2]
seeds = [0, 1]

[set]
n_layers = 2
d_model = 32
vocab_size = 256
max_seq_len = 32
"layers.*.mixer.n_heads" = 4
"layers.*.mixer.n_kv_heads" = 4
"layers.*.ffn.d_ff" = 64

[train]
steps = 3
seq_len = 16
global_batch = 4
micro_batch = 4
warmup_steps = 1
cpu = true

[variants.mha]

[variants.gqa]
"layers.*.mixer.n_kv_heads" = 2
"""

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(tmp_path, text=TINY_FILE, name="tiny.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One tiny sweep through the command line: 2 variants x 2 learning rates x 2 seeds, 3 steps each."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ablate")
    path = tiny(root)
    out = root / "out"
    assert cli(["ablate", str(path), "--out-dir", str(out)]) == 0
    return ablate.load(path), out


def results(out):
    return sorted((json.loads(p.read_text()) for p in out.glob("runs/*/*/*/result.json")),
                  key=lambda r: (r["variant"], r["lr"], r["seed"]))


def test_sweep_runs_every_variant_lr_and_seed_and_records_the_metrics(swept):
    ab, out = swept
    runs = results(out)
    assert [(r["variant"], r["lr"], r["seed"]) for r in runs] == sorted(ab.runs())
    for r in runs:
        assert r["status"] == "ok" and r["diverged_step"] is None
        assert [h["step"] for h in r["history"]] == [1, 2, 3]
        for h in r["history"]:
            assert math.isfinite(h["loss"]) and h["grad_norm"] > 0 and h["param_norm"] > 0 and h["tokens_per_s"] > 0
            assert len(h["attn_logit_max"]) == 2 and all(math.isfinite(x) for x in h["attn_logit_max"])
            assert h["log_z_rms"] == pytest.approx(math.sqrt(h["z"]))
        # JSONL is always written, with the same rows
        jsonl = [json.loads(line) for line in (ablate.run_dir(out, r["variant"], r["lr"], r["seed"])
                                               / "metrics.jsonl").read_text().splitlines()]
        assert [j["loss"] for j in jsonl] == [h["loss"] for h in r["history"]]
        assert jsonl[-1]["attn_logit_max"] == r["history"][-1]["attn_logit_max"]
    # seeds differ, learning rates differ
    by = {(r["variant"], r["lr"], r["seed"]): r["history"][-1]["loss"] for r in runs}
    assert by[("mha", 1e-3, 0)] != by[("mha", 1e-3, 1)] and by[("mha", 1e-3, 0)] != by[("mha", 1e-2, 0)]
    # no weights are kept
    assert not list(out.glob("runs/**/checkpoints"))


def test_kv_bytes_per_token_come_from_the_accounting(swept):
    ab, out = swept
    summary = json.loads((out / "summary.json").read_text())
    mha, gqa = summary["variants"]["mha"], summary["variants"]["gqa"]
    expected = account(zoo.get_spec(ab.base, ab.overrides("gqa")), dtype="bf16")
    assert gqa["kv_bytes_per_token"] == expected["decode_state"]["bytes_per_token"]
    assert mha["kv_bytes_per_token"] == 2 * gqa["kv_bytes_per_token"]  # 4 kv heads against 2
    assert mha["params"] > gqa["params"]


def test_summary_best_lr_and_lr_sensitivity_follow_the_final_losses(swept):
    ab, out = swept
    summary = json.loads((out / "summary.json").read_text())
    runs = results(out)
    for name, v in summary["variants"].items():
        finals = {lr: [ablate.final_loss(r["history"]) for r in runs if r["variant"] == name and r["lr"] == lr]
                  for lr in ab.lrs}
        means = {lr: sum(x) / len(x) for lr, x in finals.items()}
        assert v["best_lr"] == min(means, key=means.get)
        assert v["best_loss"] == pytest.approx(min(means.values()))
        init = v["initial_loss"]
        capped = [min(m, init) for m in means.values()]
        assert v["lr_sensitivity"] == pytest.approx(sum(capped) / len(capped) - min(capped))
        assert [p["min"] for p in v["per_lr"]] == pytest.approx([min(finals[lr]) for lr in ab.lrs])
    md = (out / "summary.md").read_text()
    assert "| mha |" in md and "| gqa |" in md and "LR sensitivity" in md


def test_done_runs_are_kept_and_skipped(swept, monkeypatch):
    ab, out = swept
    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/*/result.json")}

    def refuse(*a, **k):
        raise AssertionError("a done run was trained again")

    monkeypatch.setattr(T, "train", refuse)
    lines = []
    ablate.sweep(ab, out, echo=lines.append, report=False)
    assert "8 already done, 0 to run" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/*/result.json")} == before


def test_a_run_made_with_other_settings_is_run_again(tmp_path):
    path = tiny(tmp_path, TINY_FILE.replace("lrs = [1e-3, 1e-2]", "lrs = [1e-3]").replace("seeds = [0, 1]",
                                                                                       "seeds = [0]"))
    ab = ablate.load(path)
    lines = []
    ablate.sweep(ab, tmp_path / "out", echo=lines.append, report=False)
    longer = ablate.load(tiny(tmp_path, path.read_text().replace("steps = 3", "steps = 4")))
    specs = ablate.check(longer)
    assert {row[4] for row in ablate.plan(longer, specs, tmp_path / "out")} == {"stale"}
    ablate.sweep(longer, tmp_path / "out", echo=lines.append, report=False)
    assert any("other settings" in line for line in lines)
    assert all(len(r["history"]) == 4 for r in results(tmp_path / "out"))


def test_divergence_is_recorded_with_its_step_and_the_sweep_goes_on(tmp_path):
    # the loss starts near ln 256 = 5.55: above 5.6 is divergence; lr 3 gets there, and so does a model
    # whose weights are so large that its loss is not finite after one update
    text = TINY_FILE.replace('claim = ', 'diverge_loss = 5.6\nclaim = ').replace("seeds = [0, 1]", "seeds = [0]")
    text = text.replace("lrs = [1e-3, 1e-2]", "lrs = [1e-3, 3.0]").replace("steps = 3", "steps = 6")
    text += '\n[variants.blows-up]\ninit_std = 1e30\n'
    out = tmp_path / "out"
    summary = ablate.sweep(ablate.load(tiny(tmp_path, text)), out, echo=lambda s: None, report=False)
    runs = {(r["variant"], r["lr"]): r for r in results(out)}
    assert len(runs) == 6  # every run happened
    for r in runs.values():
        losses = [h["loss"] for h in r["history"]]
        bad = [i for i, x in enumerate(losses) if not math.isfinite(x) or x > 5.6]
        if bad:  # stopped at the first bad step, which is recorded
            assert r["status"] == "diverged" and r["diverged_step"] == bad[0] + 1 == len(losses)
        else:
            assert r["status"] == "ok" and r["diverged_step"] is None and len(losses) == 6
    assert runs[("mha", 1e-3)]["status"] == runs[("gqa", 1e-3)]["status"] == "ok"
    assert runs[("mha", 3.0)]["status"] == runs[("gqa", 3.0)]["status"] == "diverged"
    blown = runs[("blows-up", 1e-3)]
    assert blown["status"] == "diverged" and not math.isfinite(blown["history"][-1]["loss"])
    v = summary["variants"]["blows-up"]
    assert v["diverged_runs"] == 2 and v["best_lr"] is None and v["best_loss"] is None
    assert v["per_lr"][0]["diverged"] == [{"seed": 0, "step": blown["diverged_step"]}]
    assert summary["variants"]["mha"]["best_lr"] == 1e-3  # the diverged learning rate is not the best


@pytest.mark.parametrize("change, words", [
    (('"layers.*.mixer.n_kv_heads" = 2', '"layers.*.mixer.n_kv_head" = 2'),
     ["variant 'gqa'", "layers.default.mixer.n_kv_head", "unknown key"]),
    (('"layers.*.mixer.n_kv_heads" = 2', '"layers.*.mixer.n_kv_heads" = 3'),
     ["variant 'gqa'", "n_kv_heads", "not divisible"]),
    (('"layers.*.mixer.n_kv_heads" = 2', '"layers.*.ffn" = { name = "no-such-ffn" }'),
     ["variant 'gqa'", "no-such-ffn"]),
    (("lrs = [1e-3, 1e-2]", "lrs = []"), ["lrs", "empty"]),
    (("seeds = [0, 1]", "seeds = []"), ["seeds"]),
    (("[variants.mha]", "[variants.mha.train]\nwarmup_step = 3"), ["variant 'mha'", "warmup_step",
                                                                   "TrainConfig"]),
    (("steps = 3", "steps = 3\nlr = 0.1"), ["[train].lr", "set by the sweep"]),
    (("seq_len = 16", "seq_len = 64"), ["variant 'mha'", "max_seq_len 32", "seq_len 64"]),
])
def test_bad_files_are_refused_before_any_run_naming_the_variant_and_field(tmp_path, monkeypatch, capsys,
                                                                            change, words):
    monkeypatch.setattr(T, "train", lambda *a, **k: pytest.fail("trained before checking"))
    path = tiny(tmp_path, TINY_FILE.replace(*change))
    assert cli(["ablate", str(path), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    for w in words:
        assert w in err
    assert not (tmp_path / "out").exists()


def test_an_empty_variants_table_and_a_missing_larger_table_are_refused(tmp_path):
    with pytest.raises(ablate.AblationError, match="variants"):
        ablate.load(tiny(tmp_path, TINY_FILE.split("[variants.mha]")[0]))
    with pytest.raises(ablate.AblationError, match=r"\[larger\]"):
        ablate.load(tiny(tmp_path), larger=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_built_in_ablation_files_check_in_both_settings(path):
    for larger in (False, True):
        ab = ablate.load(path, larger=larger)
        specs = ablate.check(ab)
        assert ab.claim and ab.source and len(specs) >= 2
        # the larger setting is larger
        if larger:
            small = ablate.load(path)
            assert ab.train["steps"] > small.train["steps"] and len(ab.seeds) >= len(small.seeds)


def test_variants_may_change_training_settings_and_larger_replaces_the_grid():
    path = next(p for p in EXAMPLES if p.stem == "prenorm-vs-postnorm")
    small, large = ablate.load(path), ablate.load(path, larger=True)
    assert small.train_for("post-norm")["warmup_steps"] == 0
    assert small.train_for("post-norm-warmup")["warmup_steps"] == 20
    assert large.train_for("post-norm-warmup")["warmup_steps"] == 200
    assert large.train_for("post-norm")["steps"] == large.train["steps"] > small.train["steps"]
    assert large.shared["n_layers"] > small.shared["n_layers"] and large.lrs != small.lrs
    runs = {tuple(row[:3]): row[4] for row in ablate.plan(small, ablate.check(small), "/nonexistent")}
    assert set(runs.values()) == {"todo"} and len(runs) == len(small.variants) * len(small.lrs) * len(small.seeds)


def test_the_attention_logit_probe_matches_the_scores_the_softmax_sees(monkeypatch):
    """Against the eager path's own scores (captured at its softmax), with GQA and a soft-cap."""
    for softcap in (None, 2.0):
        over = {"n_layers": 2, "d_model": 32, "vocab_size": 64, "max_seq_len": 32, "layers.*.mixer.n_heads": 4,
                "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64, "init_std": 0.2,
                "layers.*.mixer.softcap": softcap}
        model = zoo.build("llama3-8b", overrides=over, seed=0)
        for layer in model.layers:
            layer.mixer.backend = "eager"
        seen = []
        softmax = torch.softmax

        def capture(x, dim, dtype=None):
            seen.append(float(x.detach().amax()))  # masked entries are filled with the dtype's minimum
            return softmax(x, dim=dim, dtype=dtype)

        monkeypatch.setattr(torch, "softmax", capture)
        ids = torch.randint(0, 64, (2, 12))
        with ablate.AttentionLogits() as probe:
            model(ids)
            got = probe.take()
        monkeypatch.setattr(torch, "softmax", softmax)
        assert got == pytest.approx(seen, rel=1e-5)
        if softcap:
            assert max(got) < softcap
        assert probe.take() == [None, None]  # reset by take
        assert "attend" not in vars(model.layers[0].mixer)  # unwrapped on exit


def test_trackers_get_every_step_and_an_unknown_tracker_is_refused(tmp_path, monkeypatch):
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

    logged = []

    class Memory(GeneralTracker):
        name = "memory"
        requires_logging_directory = True

        def __init__(self, run_name, logging_dir):
            super().__init__()
            self.run_name, self.dir = run_name, logging_dir

        @property
        def tracker(self):
            return self

        def start(self):
            logged.append(("start", self.run_name, self.dir))

        def store_init_configuration(self, values):
            logged.append(("config", values))

        def log(self, values, step=None, **kw):
            logged.append(("log", step, values))

        def finish(self):
            logged.append(("finish", self.run_name))

    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "memory", Memory)
    path = tiny(tmp_path, TINY_FILE.replace("lrs = [1e-3, 1e-2]", "lrs = [1e-3]").replace("seeds = [0, 1]",
                                                                                        "seeds = [0]"))
    with pytest.raises(ValueError, match="no-such-tracker"):
        ablate.sweep(ablate.load(path), tmp_path / "out", log_with=["no-such-tracker"], echo=lambda s: None)
    assert not (tmp_path / "out").exists()
    ablate.sweep(ablate.load(path), tmp_path / "out", log_with=["memory"], echo=lambda s: None, report=False)
    starts = [e for e in logged if e[0] == "start"]
    assert [s[1] for s in starts] == ["mha/lr=0.001/seed=0", "gqa/lr=0.001/seed=0"]
    assert all(s[2] == str(tmp_path / "out" / "logs") for s in starts)
    logs = [e for e in logged if e[0] == "log"]
    assert [e[1] for e in logs] == [1, 2, 3, 1, 2, 3]
    assert {"loss", "ce", "grad_norm", "param_norm", "log_z_rms", "attn_logit_max/layer0",
            "attn_logit_max/layer1"} <= set(logs[0][2])
    assert [e[0] for e in logged].count("finish") == 2


# -- plots ----------------------------------------------------------------------------------------

def test_the_lr_figure_has_a_line_per_variant_with_the_final_losses(swept):
    pytest.importorskip("matplotlib")
    ab, out = swept
    summary = json.loads((out / "summary.json").read_text())
    fig = ablate.lr_figure(summary)
    loss_ax, logit_ax, z_ax = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == ["learning rate"] * 3
    assert loss_ax.get_ylabel() == "final loss (cross-entropy)"
    assert logit_ax.get_ylabel() == "largest attention logit" and z_ax.get_ylabel() == "RMS log Z (output)"
    assert all(ax.get_xscale() == "log" for ax in fig.axes)
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert set(lines) == {"mha", "gqa"}
    for name, line in lines.items():
        assert list(line.get_xdata()) == list(ab.lrs)
        assert list(line.get_ydata()) == pytest.approx([p["final_loss"] for p in summary["variants"][name]["per_lr"]])
    assert len(loss_ax.collections) == 2  # the seed bands
    assert {line.get_label() for line in logit_ax.get_lines()} == {"mha", "gqa"}


def test_the_lr_figure_marks_diverged_learning_rates():
    pytest.importorskip("matplotlib")
    per_lr = [{"lr": 1e-3, "final_loss": 3.0, "min": 2.9, "max": 3.1, "diverged": [], "attn_logit_max": 5.0,
               "log_z_rms": 1.0},
              {"lr": 1e-1, "final_loss": None, "min": None, "max": None, "diverged": [{"seed": 0, "step": 7}],
               "attn_logit_max": 900.0, "log_z_rms": 30.0}]
    summary = {"name": "x", "variants": {"a": {"per_lr": per_lr, "initial_loss": 5.5}}}
    loss_ax = ablate.lr_figure(summary).axes[0]
    marks = {line.get_label(): line for line in loss_ax.get_lines()}
    assert list(marks["a"].get_xdata()) == [1e-3]
    assert marks["a diverged"].get_marker() == "x"
    assert list(marks["a diverged"].get_xdata()) == [1e-1] and list(marks["a diverged"].get_ydata()) == [5.5]


def test_curve_figures_have_a_panel_per_variant_and_a_line_per_lr(swept):
    pytest.importorskip("matplotlib")
    ab, out = swept
    fig = ablate.curves_figure(ab, results(out), "ce", "cross-entropy (nats/token)")
    assert [ax.get_title() for ax in fig.axes] == ["mha", "gqa"]
    assert fig.axes[0].get_ylabel() == "cross-entropy (nats/token)"
    for ax, variant in zip(fig.axes, ["mha", "gqa"]):
        assert ax.get_xlabel() == "step"
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["lr=0.001", "lr=0.01"]
        runs = [r for r in results(out) if r["variant"] == variant and r["lr"] == 1e-3]
        mean = [sum(r["history"][i]["ce"] for r in runs) / 2 for i in range(3)]
        assert list(lines[0].get_xdata()) == [1, 2, 3] and list(lines[0].get_ydata()) == pytest.approx(mean)


def test_pngs_are_written_and_not_blank(swept):
    image = pytest.importorskip("matplotlib.image")
    _, out = swept
    for name in ("lr_sensitivity.png", "loss_curves.png", "attention_logits.png", "log_z.png"):
        png = out / name
        assert png.stat().st_size > 5000
        pixels = image.imread(png)
        assert pixels.shape[0] > 150 and pixels.shape[1] > 300
        assert len(torch.unique(torch.from_numpy(pixels[..., :3].copy()).reshape(-1, 3), dim=0)) > 20


def test_without_matplotlib_the_tables_are_still_written(swept, tmp_path, monkeypatch):
    ab, out = swept
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    lines = []
    summary = ablate.summarise(ab, results(out))
    written = ablate.write_report(ab, summary, results(out), tmp_path, echo=lines.append)
    assert sorted(p.name for p in written) == ["summary.json", "summary.md"]
    assert not list(tmp_path.glob("*.png")) and "matplotlib is not installed" in lines[0]


def test_tensorboard_gets_the_scalars_of_every_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = tiny(tmp_path, TINY_FILE.replace("lrs = [1e-3, 1e-2]", "lrs = [1e-3]").replace("seeds = [0, 1]",
                                                                                        "seeds = [0]"))
    ablate.sweep(ablate.load(path), tmp_path / "out", log_with=["tensorboard"], echo=lambda s: None, report=False)
    gqa = next(r for r in results(tmp_path / "out") if r["variant"] == "gqa")
    events = EventAccumulator(str(tmp_path / "out" / "logs" / "gqa" / "lr=0.001" / "seed=0"))
    events.Reload()
    assert {"loss", "grad_norm", "param_norm", "log_z_rms", "attn_logit_max/layer1"} <= set(events.Tags()["scalars"])
    got = [e.value for e in events.Scalars("loss")]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert got == pytest.approx([h["loss"] for h in gqa["history"]])


@pytest.mark.slow  # several processes
def test_under_torchrun_each_run_is_ddp_over_the_processes_and_matches_one_process(tmp_path):
    # 2 processes x micro_batch 2 read the same 4 sequences per step as one process does
    path = tiny(tmp_path, TINY_FILE.replace("lrs = [1e-3, 1e-2]", "lrs = [1e-2]").replace(
        "seeds = [0, 1]", "seeds = [0]").replace("micro_batch = 4", "micro_batch = 2"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zoo.cli", "ablate", str(path), "--out-dir", str(tmp_path / "two")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("2 runs, 0 already done") == 1  # the main process reports
    ablate.sweep(ablate.load(path), tmp_path / "one", echo=lambda s: None, report=False)
    two, one = results(tmp_path / "two"), results(tmp_path / "one")
    assert [r["variant"] for r in two] == ["gqa", "mha"]
    for a, b in zip(two, one):
        assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]], abs=1e-5)
        assert a["history"][-1]["attn_logit_max"] == pytest.approx(b["history"][-1]["attn_logit_max"], abs=1e-4)
