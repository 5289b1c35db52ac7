"""Runs that cannot lose or mix: fresh runs beside old ones, changed settings on resume, corrupt
checkpoints, torn metrics, pruning by step, fsynced checkpoints."""

import importlib
import json
import os

import pytest

T = importlib.import_module("zoo.training.loop")

TINY = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
QUIET = dict(progress=False, plot=False, export=False, cpu=True)
KW = dict(overrides=TINY, steps=8, seq_len=32, global_batch=8, micro_batch=4, lr=3e-3, warmup_steps=3, **QUIET)

pytestmark = pytest.mark.usefixtures("one_thread")


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def no_compute(monkeypatch):
    monkeypatch.setattr(T, "build_model", lambda *a, **k: pytest.fail("a model was built: the error came too late"))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run of 8 steps stopped after 4, with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("stopped")
    T.train("llama3-8b", out_dir=str(out), stop_after=4, save_every=2, **KW)
    return out


def test_fresh_run_refuses_a_directory_holding_another_run_and_leaves_it_alone(stopped_run, no_compute):
    before = sorted(p.name for p in (stopped_run / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints step-0000002, step-0000004\).*"
                                          r"resume=None.*another out_dir"):
        T.train("llama3-8b", out_dir=str(stopped_run), resume=None, **KW)
    assert sorted(p.name for p in (stopped_run / "checkpoints").iterdir()) == before


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    for step in (9_999_999, 10_000_000, 2):
        d = tmp_path / "checkpoints" / (f"step-{step:07d}")
        d.mkdir(parents=True)
        (d / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step-final").mkdir()
    assert [p.name for p in T.checkpoints(tmp_path)] == ["step-0000002", "step-9999999", "step-10000000"]


@pytest.mark.parametrize("field, value", [("lr", 1e-3), ("seq_len", 16), ("global_batch", 16), ("seed", 1),
                                          ("data", ("corpus.txt",)), ("weight_decay", 0.0)])
def test_resume_with_a_changed_setting_is_refused_naming_it(stopped_run, no_compute, field, value, tmp_path):
    if field == "data":
        (tmp_path / "corpus.txt").write_text("some text to learn from\n" * 50)
        value = (str(tmp_path / "corpus.txt"),)
    with pytest.raises(ValueError, match=rf"other training settings \({field}: .* in the checkpoint, .* now\)"):
        T.train("llama3-8b", out_dir=str(stopped_run), **{**KW, field: value})


def test_resume_applies_a_changed_step_count_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    T.train("llama3-8b", out_dir=str(out), stop_after=2, **KW)
    capsys.readouterr()
    result = T.train("llama3-8b", out_dir=str(out), **{**KW, "steps": 5})
    assert result.step == 5
    assert "changed settings, which apply from here: steps: 8 in the checkpoint, 5 now" in capsys.readouterr().out


def test_corrupt_last_checkpoint_and_torn_metrics_line_fall_back_to_the_last_complete_one(stopped_run, tmp_path):
    """Resume skips the truncated step-4 checkpoint for step 2 (naming it), drops the torn metrics
    line, and still follows the trajectory of a run never interrupted."""
    import shutil

    whole = T.train("llama3-8b", out_dir=str(tmp_path / "whole"), **KW)
    out = tmp_path / "broken"
    shutil.copytree(stopped_run, out)
    opt = out / "checkpoints" / "step-0000004" / "optimizer" / "shard-00001-model-00001-of-00001.safetensors"
    opt.write_bytes(opt.read_bytes()[:100])
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')
    with pytest.warns(UserWarning) as caught:
        rest = T.train("llama3-8b", out_dir=str(out), save_every=2, **KW)
    messages = [str(w.message) for w in caught]
    assert any("step-0000004 is incomplete or corrupt (optimizer/shard-00001-model-00001-of-00001.safetensors" in m
               for m in messages), messages
    assert any("metrics.jsonl, line 5: not a complete record" in m for m in messages), messages
    assert rest.step == 8 and len(rest.losses) == 6  # from step 2
    assert [m["step"] for m in metrics(out)] == list(range(1, 9))
    assert [m["loss"] for m in metrics(out)] == pytest.approx(
        [m["loss"] for m in metrics(tmp_path / "whole")], rel=1e-6, abs=0)
    assert whole.step == 8
    assert [p.name for p in T.checkpoints(out)] == ["step-0000006", "step-0000008"]


def test_explicit_resume_refuses_a_corrupt_checkpoint_or_a_directory_with_later_ones(stopped_run, tmp_path, no_compute):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(stopped_run, out)
    with pytest.raises(ValueError, match=r"holds checkpoints after step-0000002 \(step-0000004\)"):
        T.train("llama3-8b", out_dir=str(out), resume=str(out / "checkpoints" / "step-0000002"), **KW)
    (out / "checkpoints" / "step-0000004" / "state.json").write_text('{"step": 4, "spe')
    with pytest.raises(ValueError, match=r"step-0000004 is incomplete or corrupt: state.json is unreadable"):
        T.train("llama3-8b", out_dir=str(out), resume=str(out / "checkpoints" / "step-0000004"), **KW)
    (out / "checkpoints" / "step-0000002" / "model" / "shard-00001-model-00001-of-00001.safetensors").unlink()
    with pytest.warns(UserWarning) as caught, \
            pytest.raises(ValueError, match="no complete checkpoint in .*every one is corrupt"):
        T.train("llama3-8b", out_dir=str(out), **KW)
    assert [str(w.message).split(" is ")[0].rsplit("/", 1)[-1] for w in caught] == ["step-0000004", "step-0000002"]


def test_training_checkpoints_are_fsynced_before_they_are_renamed_into_place(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    result = T.train("llama3-8b", out_dir=str(tmp_path), steps=1, seq_len=16, global_batch=2, micro_batch=2,
                     overrides=TINY, **QUIET)
    files = sorted(p.name for p in result.checkpoint.iterdir())
    tmp = tmp_path / "checkpoints" / ".tmp-step-0000001"
    assert set(files) <= {os.path.basename(s) for s in synced if s.startswith(str(tmp) + "/")}
    assert str(tmp) in synced and str(tmp_path / "checkpoints") in synced


@pytest.mark.parametrize("field", ["lr", "weight_decay", "grad_clip", "min_lr_ratio", "eps", "z_loss"])
def test_non_finite_training_settings_are_refused_by_name(tmp_path, no_compute, field):
    with pytest.raises(ValueError, match=rf"TrainConfig.{field} must be a finite number, got nan"):
        T.train("llama3-8b", out_dir=str(tmp_path), **{**KW, field: float("nan")})



# A run stopped at step 2 of 4 by zoo 0.1, whose blocks stored the mixer as ``.mixer``: its
# checkpoint names the weights ``layers.{i}.attention.*``.
OLD_RUN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "train_run_0.1")
OLD_KW = dict(overrides={"n_layers": 1, "d_model": 16, "vocab_size": 256, "max_seq_len": 32, "layers.*.mixer.n_heads": 2,
                         "layers.*.mixer.n_kv_heads": 1, "layers.*.ffn.d_ff": 32},
              steps=4, seq_len=16, global_batch=2, micro_batch=2, lr=3e-3, warmup_steps=1, seed=0, **QUIET)


def test_a_checkpoint_of_the_old_layout_resumes_with_its_weights_under_the_new_names(tmp_path):
    import shutil

    from safetensors.torch import load_file

    out = tmp_path / "run"
    shutil.copytree(OLD_RUN, out)
    step2 = out / "checkpoints" / "step-0000002"
    stored = load_file(str(step2 / "model.safetensors"))
    assert any(".attention." in k for k in stored)  # the fixture really is of the old layout
    seen = {}

    def on_step(m, model):
        seen.setdefault("first", {k: v.detach().clone() for k, v in model.state_dict().items()})

    result = T.train("llama3-8b", out_dir=str(out), on_step=on_step, **OLD_KW)
    assert result.step == 4 and len(result.losses) == 2
    # After step 3 each weight has moved from its stored value by at most one Adam step's size
    # (lr 3e-3 scaled by the schedule): a weight loaded under the wrong name, or left at its
    # initial value, is off by the init's scale (~0.02-1).
    after3 = seen["first"]
    assert set(after3) == {k.replace(".attention.", ".mixer.") for k in stored}
    for k, v in stored.items():
        new = k.replace(".attention.", ".mixer.")
        assert (after3[new] - v).abs().max() <= 3.1e-3, new


def test_a_checkpoint_is_safetensors_and_json_only(stopped_run):
    """No pickle anywhere (DCP's default ``.metadata`` is one): every file is a safetensors file whose
    header reads, or JSON."""
    from safetensors import safe_open

    ckpt = stopped_run / "checkpoints" / "step-0000004"
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert files == ["model/shard-00001-model-00001-of-00001.safetensors",
                     "optimizer/shard-00001-model-00001-of-00001.safetensors", "rng-rank00000.safetensors",
                     "state.json"]
    for name in files:
        data = (ckpt / name).read_bytes()
        assert not data.startswith(b"\x80"), f"{name} is a pickle"  # every pickle protocol >= 2 starts so
        if name.endswith(".json"):
            assert json.loads(data)["format"] == 2
        else:
            with safe_open(str(ckpt / name), "pt") as f:
                assert list(f.keys())


def test_a_model_whose_tensors_differ_from_the_checkpoint_is_refused_naming_the_tensor(stopped_run):
    """Past the spec check (a model changed under the same spec, as a plugin's part could be): the load
    names the tensor and both shapes."""
    import torch
    from accelerate import Accelerator

    from zoo.model.recipes import get_spec
    from zoo.training.checkpointer import Checkpointer

    ckpt = stopped_run / "checkpoints" / "step-0000004"
    state = json.loads((ckpt / "state.json").read_text())
    other = T.build_model(get_spec("llama3-8b", {**TINY, "layers.*.ffn.d_ff": 48}))
    opt = torch.optim.AdamW(other.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match=r"model/ holds 'layers.0.ffn.\w+.weight' as \(\d+, \d+\), but the model's is"):
        Checkpointer(Accelerator(cpu=True), stopped_run, 2).load(ckpt, state, model=other, optimizer=opt, scheduler=sched)
