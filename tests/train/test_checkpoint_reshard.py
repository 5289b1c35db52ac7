"""Checkpoints that reshard (torchrun, gloo, CPU): a run saved by FSDP2 on 2 processes resumes on 4, as
FSDP2 and as FSDP2 x TP on a 2 x 2 mesh. What each process loads is, gathered, the state the 2 processes
saved, bit for bit (weights and every optimizer tensor); the resumed steps follow the uninterrupted run;
the export streamed from the resharded run's checkpoint is the one the gathered model gives."""

import json
import os
import subprocess
import sys

import pytest
import torch

import zoo

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SETS = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
RUN = dict(steps=6, seq_len=32, global_batch=8, lr=3e-3, warmup_steps=2, seed=1, cpu=True, progress=False,
           plot=False, micro_batch=2)

# Every checkpoint save and load also writes the state it saved or loaded, gathered whole
# (get_*_state_dict with full_state_dict, not the checkpoint's files), for the test to compare.
SCRIPT = '''import json, sys
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
import zoo
from zoo.training import checkpointer

out, phase, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def dump(model, optimizer, name):
    weights = get_model_state_dict(model, options=WHOLE)
    osd = get_optimizer_state_dict(model, optimizer, options=WHOLE)
    if dist.get_rank() == 0:
        tensors = {"model." + k: v.contiguous() for k, v in weights.items()}
        tensors.update({f"optimizer.{p}.{k}": v.contiguous() for p, s in osd["state"].items() for k, v in s.items()})
        save_file(tensors, f"{out}/{name}.safetensors")
    dist.barrier()


real_save, real_load = checkpointer.Checkpointer.save, checkpointer.Checkpointer.load
layout = None


def save(self, *, model, optimizer, **rest):
    dump(model, optimizer, f"saved-{layout}-step{rest['step']}")
    return real_save(self, model=model, optimizer=optimizer, **rest)


def load(self, path, state, *, model, optimizer, scheduler):
    real_load(self, path, state, model=model, optimizer=optimizer, scheduler=scheduler)
    dump(model, optimizer, f"loaded-{layout}")


def gathered(model):
    """The export as it was made before checkpoints resharded: the whole model gathered, then save_pretrained."""
    whole = checkpointer.full_state_dict(model, sharded=True)
    if dist.get_rank() == 0:
        plain = zoo.build_model(model.spec, device="meta")
        plain.load_state_dict(whole, assign=True)
        zoo.save_pretrained(plain, out + "/gathered", model_type="llama")


checkpointer.Checkpointer.save, checkpointer.Checkpointer.load = save, load
if phase == "two":
    layout = "two"
    zoo.train("llama3-8b", out_dir=out + "/two", parallel={"dp_shard": 2}, save_every=3, export=False, **kw)
    layout = "earlier"  # a run of zoo 0.2 stopped at step 2 of 4, its FSDP2 shards one file per process
    zoo.train("llama3-8b", out_dir=out + "/earlier", **json.loads(sys.argv[4]))
else:
    step3 = out + "/two/checkpoints/step-0000003"
    layout = "fsdp4"
    zoo.train("llama3-8b", out_dir=out + "/fsdp4", resume=step3, parallel={"dp_shard": 4}, export=False, **kw)
    layout = "fsdp2xtp2"
    zoo.train("llama3-8b", out_dir=out + "/fsdp2xtp2", resume=step3, parallel={"dp_shard": 2, "tp": 2, "ac": "block"},
              export_format="llama", on_step=lambda row, model: row["step"] == 6 and gathered(model), **kw)
'''


EARLIER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "train_run_fsdp_0.2")
EARLIER_KW = dict(overrides={"n_layers": 1, "d_model": 16, "vocab_size": 256, "max_seq_len": 32,
                             "layers.*.mixer.n_heads": 2, "layers.*.mixer.n_kv_heads": 1, "layers.*.ffn.d_ff": 32},
                  steps=4, seq_len=16, global_batch=4, micro_batch=2, lr=3e-3, warmup_steps=1, seed=0, fsdp=True,
                  cpu=True, progress=False, plot=False, export=False)


def launch(tmp, phase, processes, kw):
    script = tmp / "reshard.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           str(script), str(tmp), phase, json.dumps(kw), json.dumps(EARLIER_KW)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches: 6 steps on 2 processes (FSDP2), checkpointed at step 3; then on 4 processes,
    resumed from that checkpoint as FSDP2 and as FSDP2 x TP (with activation checkpointing)."""
    tmp = tmp_path_factory.mktemp("reshard")
    kw = {**RUN, "overrides": SETS}
    import shutil

    shutil.copytree(EARLIER, tmp / "earlier")
    launch(tmp, "two", 2, kw)
    launch(tmp, "four", 4, kw)
    return tmp


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_checkpoint_holds_safetensors_and_json_only(runs):
    ckpt = runs / "two" / "checkpoints" / "step-0000003"
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert files == ["model/shard-00001-model-00001-of-00001.safetensors",
                     "model/shard-00002-model-00001-of-00001.safetensors",
                     "optimizer/shard-00001-model-00001-of-00001.safetensors",
                     "optimizer/shard-00002-model-00001-of-00001.safetensors",
                     "rng-rank00000.safetensors", "rng-rank00001.safetensors", "state.json"]
    from safetensors import safe_open

    for name in files:
        data = (ckpt / name).read_bytes()
        assert not data.startswith(b"\x80"), f"{name} is a pickle"  # every pickle protocol >= 2 starts so
        if name.endswith(".json"):
            json.loads(data)
        else:
            with safe_open(str(ckpt / name), "pt") as f:
                assert list(f.keys())


@pytest.mark.parametrize("layout", ["fsdp4", "fsdp2xtp2"])
def test_a_checkpoint_of_two_processes_loads_bit_equal_on_four(runs, layout):
    """Gathered after the load on 4 processes, every weight and every optimizer tensor (exp_avg,
    exp_avg_sq, step) is the one the 2 processes held when they saved, bit for bit."""
    from safetensors.torch import load_file

    saved = load_file(str(runs / "saved-two-step3.safetensors"))
    loaded = load_file(str(runs / f"loaded-{layout}.safetensors"))
    assert sorted(loaded) == sorted(saved)
    assert sum(k.startswith("optimizer.") and k.endswith(".exp_avg_sq") for k in saved) == \
        sum(k.startswith("model.") for k in saved)  # an Adam state for every weight
    differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert differ == []


@pytest.mark.parametrize("out", ["fsdp4", "fsdp2xtp2"])
def test_a_run_resumed_on_another_layout_follows_the_uninterrupted_run(runs, out):
    """Steps 4-6 on 4 processes repeat those of the run that never stopped on 2: the same state, the
    same global batches; only the order of float32 additions differs (the gradients are reduced over 4
    processes, not 2), the bound of the DDP-vs-one-process test."""
    two, resumed = metrics(runs / "two"), metrics(runs / out)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in two[3:]], rel=2e-5, abs=0)
    state = json.loads((runs / out / "checkpoints" / "step-0000006" / "state.json").read_text())
    assert state["processes"] == 4 and state["step"] == 6


def test_the_export_streamed_from_shards_equals_the_export_of_the_gathered_model(runs):
    """At the end of the FSDP2 x TP run, rank 0 writes out_dir/final tensor by tensor from the
    checkpoint's shards; the directory "today's way" (the model gathered whole, save_pretrained) is the
    same, file for file and byte for byte."""
    final, gathered = runs / "fsdp2xtp2" / "final", runs / "gathered"
    names = sorted(p.name for p in gathered.iterdir())
    assert names == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in final.iterdir() if p.name in names) == names  # and the run's tokenizer
    for name in names:
        assert (final / name).read_bytes() == (gathered / name).read_bytes(), name
    back = zoo.from_pretrained(str(final))
    assert back.spec.n_layers == 2


def test_a_sharded_checkpoint_of_the_earlier_layout_resumes_on_its_processes(runs):
    """Written by zoo 0.2 (one model and optimizer file per process): resumed on its 2 processes, steps
    3-4 are those of that version's uninterrupted run, and the checkpoint the run writes reshards."""
    expected = [json.loads(line)["loss"] for line in open(os.path.join(EARLIER, "uninterrupted.jsonl"))]
    assert [m["loss"] for m in metrics(runs / "earlier")] == pytest.approx(expected, rel=1e-6, abs=0)
    state = json.loads((runs / "earlier" / "checkpoints" / "step-0000004" / "state.json").read_text())
    assert state["format"] == 2 and state["step"] == 4
