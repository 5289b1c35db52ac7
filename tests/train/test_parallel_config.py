"""The ``parallel`` section of the training config: sizes checked against the processes, read from
TOML and the command line, HSDP over a DeviceMesh, and activation checkpointing per block."""

import json
import os
import subprocess
import sys

import pytest
import torch

import zoo
from zoo.cli import build_parser
from zoo.commands.train import config_of
from zoo.testing import one_of_each, shrink
from zoo.training.config import ParallelConfig, TrainConfig
from zoo.training.loop import checkpoint_blocks


def test_sizes_multiply_to_the_processes_or_the_error_names_what_to_change():
    assert ParallelConfig().sizes(8) == {"dp_replicate": 1, "dp_shard": 8, "ep": 1, "tp": 1}
    assert ParallelConfig(dp_replicate=2).sizes(8)["dp_shard"] == 4
    assert ParallelConfig(dp_replicate=2, dp_shard=4).sizes(8)["dp_shard"] == 4
    with pytest.raises(ValueError, match=r"dp_replicate 3 = 3 does not divide the 8 processes.*change dp_replicate"):
        ParallelConfig(dp_replicate=3).sizes(8)
    with pytest.raises(ValueError, match=r"dp_replicate 2 x dp_shard 3 = 6, but 8 processes.*change dp_replicate, dp_shard"):
        ParallelConfig(dp_replicate=2, dp_shard=3).sizes(8)
    with pytest.raises(ValueError, match=r"parallel.dp_shard must be a positive integer or -1"):
        ParallelConfig(dp_shard=0).sizes(8)
    with pytest.raises(ValueError, match=r"parallel.tp must be a positive integer, got 'x'"):
        ParallelConfig(tp="x").sizes(8)


def test_activation_checkpointing_settings():
    assert ParallelConfig().checkpointed(4) == []
    assert ParallelConfig(ac="block").checkpointed(4) == [0, 1, 2, 3]
    assert ParallelConfig(ac="2").checkpointed(5) == [0, 2, 4]
    assert ParallelConfig(ac=3).checkpointed(5) == [0, 3]  # an integer from TOML
    with pytest.raises(ValueError, match=r"parallel.ac must be none, block or a positive integer.*'full'"):
        TrainConfig(parallel=ParallelConfig(ac="full")).check()


def test_the_parallel_table_from_toml_and_the_command_line(tmp_path):
    f = tmp_path / "train.toml"
    f.write_text('steps = 5\nseq_len = 16\n\n[parallel]\ndp_replicate = 2\nac = "block"\n')
    config = TrainConfig.from_toml(f)
    assert config.steps == 5 and config.parallel == ParallelConfig(dp_replicate=2, ac="block")
    args = build_parser().parse_args(["train", "llama3-8b", "--config", str(f), "--ac", "2", "--tp", "1", "--steps", "7"])
    config = config_of(args)
    assert config.steps == 7 and config.seq_len == 16
    assert config.parallel == ParallelConfig(dp_replicate=2, ac="2", tp=1)
    assert config_of(build_parser().parse_args(["train", "llama3-8b"])) == TrainConfig()
    f.write_text('[parallel]\ndp_replicas = 2\n')
    with pytest.raises(ValueError, match=r"parallel.dp_replicas: not a parallel setting"):
        TrainConfig.from_toml(f)
    f.write_text('stepz = 2\n')
    with pytest.raises(ValueError, match=r"train.toml: 'stepz' is not a TrainConfig field"):
        TrainConfig.from_toml(f)


def test_a_layout_that_does_not_fit_is_refused_before_any_compute(tmp_path):
    with pytest.raises(ValueError, match=r"dp_replicate 2 = 2 does not divide the 1 processes"):
        zoo.train("llama3-8b", overrides={"n_layers": 1, "d_model": 32, "vocab_size": 256},
                  parallel=ParallelConfig(dp_replicate=2), out_dir=str(tmp_path), cpu=True, progress=False)


# -- activation checkpointing ---------------------------------------------------------------------

def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model.loss(ids)
    out.loss.backward()
    plain = lambda n: n.replace("._checkpoint_wrapped_module", "")  # noqa: E731 (the wrapper's name in the path)
    grads = {plain(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = {plain(n): b.clone() for n, b in model.named_buffers() if n.endswith(".load")}
    return {k: v.detach().clone() for k, v in out.terms().items()}, grads, loads  # terms read after backward


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3"])
def test_checkpointed_blocks_give_bit_equal_losses_gradients_and_counters(name):
    """Every block recomputed in backward (and every second one): the same loss, auxiliary terms,
    gradients and MoE token counters, bit for bit; the state dict's keys unchanged."""
    if name == "deepseek-v3":  # a dense block and an MoE one with the aux-free bias counters on
        spec = one_of_each(name).with_overrides(**{"layers.moe.ffn.bias_update": "sign"})
    else:
        spec = shrink(zoo.get_spec(name))
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = zoo.build_model(spec, seed=0).train()
    want = loss_and_grads(plain, ids)
    for blocks in ([0, 1], [0]):
        model = zoo.build_model(spec, seed=0).train()
        checkpoint_blocks(model, blocks)
        assert list(model.state_dict()) == list(plain.state_dict())
        got = loss_and_grads(model, ids)
        assert got[0].keys() == want[0].keys() and len(got[1]) == len(want[1]) == len(list(plain.parameters()))
        for a, b in zip(got, want):
            for key in b:
                assert torch.equal(a[key], b[key]), (blocks, key)
    if name == "deepseek-v3":
        assert want[2] and all(v.sum() > 0 for v in want[2].values())  # the counters counted


def saved_bytes(model, ids):
    """Bytes of the tensors autograd saves during the forward, inside the blocks and outside them."""
    inside = {"now": False}
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *a: inside.update(now=True))
        layer.register_forward_hook(lambda *a: inside.update(now=False))
    seen, total = set(), {True: 0, False: 0}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total[inside["now"]] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(ids)
    return total[True], total[False]


def test_checkpointed_blocks_save_only_their_inputs():
    """Without checkpointing the blocks save many times their input; with it each saves its input
    (B x T x d_model float32) and nothing else, and what is saved outside the blocks (embedding,
    final norm, head and loss) is unchanged."""
    spec = shrink(zoo.get_spec("llama3-8b"), d_model=64, d_ff=256)
    B, T = 2, 32
    ids = torch.randint(0, spec.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    inside, outside = saved_bytes(zoo.build_model(spec, seed=0).train(), ids)
    model = zoo.build_model(spec, seed=0).train()
    checkpoint_blocks(model, list(range(len(model.layers))))
    inside_ac, outside_ac = saved_bytes(model, ids)
    block_input = B * T * spec.d_model * 4
    assert inside > 5 * spec.n_layers * block_input, inside  # a block saves several activations per token
    assert inside_ac == spec.n_layers * block_input and outside_ac == outside, (inside_ac, outside_ac, outside)


# -- on two processes ------------------------------------------------------------------------------

SETS = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
SCRIPT = """
import json, sys
import zoo
from zoo.training.config import ParallelConfig
out, run = sys.argv[1], json.loads(sys.argv[2])
kw = dict(overrides=json.loads(sys.argv[3]), cpu=True, progress=False, plot=False, export=False, micro_batch=4, **run)
zoo.train("llama3-8b", out_dir=out + "/fsdp", fsdp=True, **kw)
zoo.train("llama3-8b", out_dir=out + "/fsdp-ac", parallel=ParallelConfig(ac="block"), fsdp=True, **kw)
zoo.train("llama3-8b", out_dir=out + "/hsdp", parallel=ParallelConfig(dp_replicate=2), **kw)
"""


@pytest.mark.slow  # torchrun, two processes
def test_fsdp_with_checkpointed_blocks_and_hsdp_on_two_processes(tmp_path, one_thread):
    """On two gloo processes: FSDP2 with every block checkpointed repeats FSDP2's losses bit for bit;
    HSDP (dp_replicate 2, which turns FSDP2 on by itself) matches one process over the same global
    batch to float32 rounding (the DDP test's bound)."""
    run = dict(steps=3, seq_len=32, global_batch=8, lr=3e-3, warmup_steps=1, seed=1)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path), json.dumps(run), json.dumps(SETS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Error" in line]
    assert proc.returncode == 0, "\n".join(errors[:6]) + proc.stdout[-2000:] + proc.stderr[-2000:]

    def losses(d):
        return [json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]

    assert losses("fsdp-ac") == losses("fsdp")
    one = zoo.train("llama3-8b", overrides=SETS, micro_batch=4, cpu=True, progress=False, plot=False, export=False,
                    out_dir=str(tmp_path / "one"), **run)
    assert losses("hsdp") == pytest.approx(one.losses, rel=2e-5, abs=0)
    state = json.loads((tmp_path / "hsdp" / "checkpoints" / "step-0000003" / "state.json").read_text())
    assert state["sharded"] and state["config"]["parallel"]["dp_replicate"] == 2


def test_the_toml_example_in_the_docs_reads_as_it_says(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "training.md").read_text()
    example = re.search(r"```toml\n(# train.toml.*?)```", text, re.S).group(1)
    (tmp_path / "train.toml").write_text(example)
    config = TrainConfig.from_toml(tmp_path / "train.toml")
    config.check()
    assert config.parallel.sizes(8) == {"dp_replicate": 2, "dp_shard": 4, "ep": 1, "tp": 1}
    assert config.parallel.checkpointed(3) == [0, 1, 2]


def test_an_accelerate_parallelism_config_sets_the_sizes_or_the_error_names_both():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "8",
           "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "1"}
    mine = ParallelConfig(ep=2, ac="block")
    assert mine.with_accelerate(env) == ParallelConfig(dp_replicate=2, dp_shard=4, tp=8, ep=2, ac="block")
    assert mine.with_accelerate({**env, "ACCELERATE_USE_PARALLELISM_CONFIG": "false"}) == mine
    assert ParallelConfig(tp=8).with_accelerate(env).tp == 8  # agreeing is fine
    with pytest.raises(ValueError, match=r"parallel.tp = 2 in zoo's settings, but the accelerate config's "
                                         r"parallelism_config_tp_size = 8"):
        ParallelConfig(tp=2).with_accelerate(env)
    with pytest.raises(ValueError, match=r"parallelism_config_cp_size = 2, but zoo has no context parallelism"):
        mine.with_accelerate({**env, "PARALLELISM_CONFIG_CP_SIZE": "2"})
    with pytest.raises(ValueError, match=r"parallelism_config_tp_size \(PARALLELISM_CONFIG_TP_SIZE\) must be an integer"):
        mine.with_accelerate({**env, "PARALLELISM_CONFIG_TP_SIZE": "x"})


def test_zoo_train_takes_the_accelerate_parallelism_config_and_builds_its_own_mesh(tmp_path, monkeypatch):
    """On one process the accelerate sizes (all 1) go through, and Accelerate is not left to build its
    own parallelism config, which refuses CPU processes."""
    from zoo.training.loop import train

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for k in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP"):
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{k}_SIZE", "1")
    r = train("llama3-8b", overrides={"n_layers": 1, "d_model": 32, "vocab_size": 256, "layers.*.mixer.n_heads": 4,
                                      "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64},
              steps=1, seq_len=8, global_batch=1, micro_batch=1, warmup_steps=0, progress=False, plot=False,
              cpu=True, out_dir=str(tmp_path / "run"))
    assert r.step == 1 and "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match=r"parallel: tp 2 = 2, but 1 processes are running"):
        train("llama3-8b", steps=1, cpu=True, out_dir=str(tmp_path / "other"))
