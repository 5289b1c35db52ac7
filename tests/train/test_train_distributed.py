"""Real two-process runs on the CPU (torchrun, gloo): DDP and FSDP2 through ``zoo train``."""

import json
import os
import subprocess
import sys

import pytest
import torch

import zoo

SETS = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
RUN = dict(steps=6, seq_len=32, global_batch=8, lr=3e-3, warmup_steps=2, seed=1)


def run(args):
    """``torchrun --standalone --nproc_per_node 2 ARGS`` on the CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # slow: several processes


def test_ddp_on_two_processes_matches_one_process_over_the_same_global_batch(tmp_path):
    # Without --cpu on a machine without a GPU: zoo must still ask Accelerate for CPU processes (gloo).
    cpu = ["--cpu"] if torch.cuda.is_available() else []
    args = ["-m", "zoo.cli", "train", "llama3-8b", *cpu, "--no-progress", "--no-plot", "--no-export",
            "--out-dir", str(tmp_path / "ddp"), "--micro-batch", "4"]
    args += [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    args += [a for k, v in RUN.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    run(args)
    two = metrics(tmp_path / "ddp")
    # One process, the same 8 sequences per step, as 2 accumulated micro-batches of 4.
    one = zoo.train("llama3-8b", overrides=SETS, micro_batch=4, out_dir=str(tmp_path / "one"), cpu=True,
                  progress=False, plot=False, export=False, **RUN)
    assert [m["step"] for m in two] == list(range(1, 7))
    losses = [m["loss"] for m in two]
    assert losses[-1] < losses[0] - 0.3
    # Same data, same initial weights, gradients averaged over the same 8 sequences: only the order
    # of float32 additions differs (all-reduce vs accumulation), a few parts in 1e7 per step.
    assert losses == pytest.approx(one.losses, rel=2e-5, abs=0)
    assert [m["z"] for m in two] == pytest.approx(one.z, rel=2e-5, abs=0)


FSDP_SCRIPT = """
import json, sys
import zoo
out, sets, run = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
kw = dict(overrides=sets, fsdp=True, cpu=True, progress=False, plot=False, micro_batch=2, **run)
zoo.train("gemma2-2b", out_dir=out + "/a", save_every=3, export_format="gemma2", **kw)
zoo.train("gemma2-2b", out_dir=out + "/b", resume=out + "/a/checkpoints/step-0000003", export=False, **kw)
# Start from the exported weights; with lr 0 they come back out unchanged, shard by shard.
kw.update(overrides=None, lr=0.0, steps=1, export=False)
zoo.train(init_from=out + "/a/final", out_dir=out + "/c", **kw)
"""


def test_fsdp2_on_two_processes_trains_and_resumes_from_sharded_checkpoints(tmp_path):
    """FSDP2 per block from the meta device on a Gemma 2 shaped model (sandwich norms, soft-caps,
    sliding window): the loss falls; each process writes its own shard; a run resumed from the
    step-3 checkpoint repeats steps 4-6 of the uninterrupted one."""
    sets = {**SETS, "layers.*.mixer.head_dim": 16, "layers.local.mixer.window": 8}
    sets.pop("layers.*.mixer.n_kv_heads")
    script = tmp_path / "fsdp_run.py"
    script.write_text(FSDP_SCRIPT)
    run([str(script), str(tmp_path), json.dumps(sets), json.dumps(RUN)])
    first, resumed = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    losses = [m["loss"] for m in first]
    assert losses[-1] < losses[0] - 0.3
    ckpt = tmp_path / "a" / "checkpoints" / "step-0000003"
    names = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert names == [f"{part}/shard-0000{r}-model-00001-of-00001.safetensors" for part in ("model", "optimizer")
                     for r in (1, 2)] + ["rng-rank00000.safetensors", "rng-rank00001.safetensors", "state.json"]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 3 and state["data_position"] == 24 and state["sharded"] and state["format"] == 2
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx(losses[3:], rel=1e-6, abs=0)
    # Each process wrote its half of every weight: FSDP2's dim-0 shards, with their offsets.
    from safetensors.torch import load_file

    from zoo.training.checkpointer import CheckpointWeights

    step6 = tmp_path / "a" / "checkpoints" / "step-0000006" / "model"
    halves = [load_file(str(step6 / f"shard-0000{r}-model-00001-of-00001.safetensors")) for r in (1, 2)]
    weights = CheckpointWeights(step6.parent)
    exported = zoo.from_pretrained(str(tmp_path / "a" / "final")).state_dict()
    assert set(exported) == set(halves[0]) == set(weights)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, torch.cat([halves[0][name], halves[1][name]]), rtol=0, atol=0)
    # Started from the export with lr 0, the weights come back out unchanged.
    again = CheckpointWeights(tmp_path / "c" / "checkpoints" / "step-0000001")
    for name, tensor in exported.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0)


HOOK_SCRIPT = """
import json, sys
import zoo
assert zoo.load_plugin("toy_plugin").error is None
import toy_plugin
out = sys.argv[1]
kw = dict(overrides={"vocab_size": 256}, steps=3, seq_len=16, global_batch=8, micro_batch=2, lr=3e-3, cpu=True,
          progress=False, plot=False, export=False, seed=1)
zoo.train(toy_plugin.SPEC, out_dir=out + "/ddp", **kw)


def keep_bias(row, model):  # each process's own buffers: a checkpoint holds one copy of what all hold whole
    if row["step"] == 3:
        from safetensors.torch import save_file
        import torch.distributed as dist
        save_file({k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith("expert_bias")},
                  f"{out}/fsdp-bias-rank{dist.get_rank()}.safetensors")


zoo.train(toy_plugin.SPEC, out_dir=out + "/fsdp", fsdp=True, on_step=keep_bias, **kw)
"""


def test_post_step_hooks_see_every_process_and_update_identically_under_ddp_and_fsdp2(tmp_path):
    """The toy MoE's selection bias moves by the expert counts summed over all processes: under DDP
    two processes end with the bias a one-process run over the same global batch ends with; under
    FSDP2, where nothing synchronises buffers, both processes end with the same bias. The auxiliary
    loss of every layer reaches the logged loss under both (FSDP2 wraps each block)."""
    from pathlib import Path

    from safetensors.torch import load_file

    tests = str(Path(__file__).parents[1])
    script = tmp_path / "hook_run.py"
    script.write_text(HOOK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert zoo.load_plugin("toy_plugin").error is None
    import toy_plugin

    one = zoo.train(toy_plugin.SPEC, overrides={"vocab_size": 256}, steps=3, seq_len=16, global_batch=8, micro_batch=4,
                    lr=3e-3, cpu=True, progress=False, plot=False, export=False, seed=1, out_dir=str(tmp_path / "one"))
    from zoo.training.checkpointer import CheckpointWeights

    ref = CheckpointWeights(one.checkpoint)
    ddp = CheckpointWeights(tmp_path / "ddp" / "checkpoints" / "step-0000003")
    fsdp = [load_file(str(tmp_path / f"fsdp-bias-rank{r}.safetensors")) for r in (0, 1)]
    for i in range(4):
        name = f"layers.{i}.ffn.expert_bias"
        assert ref[name].abs().max() > 0 and fsdp[0][name].abs().max() > 0, "the hook never moved the bias"
        torch.testing.assert_close(ddp[name], ref[name], rtol=0, atol=0)
        torch.testing.assert_close(fsdp[1][name], fsdp[0][name], rtol=0, atol=0)
    for run in ("ddp", "fsdp"):
        for row in metrics(tmp_path / run):  # four MoE layers, each balance term near 1
            assert row["moe_balance"] > 3.5 and row["loss"] == pytest.approx(row["ce"] + 0.01 * row["moe_balance"], rel=1e-5)
