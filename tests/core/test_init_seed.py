"""One initialisation for every layout: ``build_model(spec, seed=s)`` draws every part's weights from
``s`` (never from the global RNG), and FSDP2's start from the meta device on several processes
ends with the same whole weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.model.recipes import get_spec
from zoo.testing import hybrid_spec, one_of_each, tiny_spec_with

from hf_pairs import own

# Presets that between them use every built-in mixer, FFN, router, block and position kind (and MTP);
# the parts no preset uses come from the tiny spec.
PRESETS = ["llama3-8b", "gemma2-2b", "gpt3-125m", "palm-8b", "transformer-2017", "deepseek-v2",
           "deepseek-v3", "deepseek-v3.2-exp", "qwen1.5-moe-a2.7b", "qwen3-next-80b-a3b", "minimax-text-01",
           "mamba2-2.7b", "nemotron-h-8b"]
PARTS = {"linear_attention": lambda: hybrid_spec("linear_attention", {"n_heads": 4, "head_dim": 8}),
         "glu": lambda: tiny_spec_with("ffn", "glu"), "reglu": lambda: tiny_spec_with("ffn", "reglu"),
         "alibi": lambda: tiny_spec_with("position", "alibi")}


SPECS = {**{name: (lambda name=name: one_of_each(name)) for name in PRESETS}, **PARTS}


def kinds(spec):
    out = set()
    for i in range(spec.n_layers):
        layer = spec.layer(i)
        out |= {("mixer", layer.mixer.name), ("block", layer.block.name), ("position", spec.position_for(i).name)}
        if layer.ffn is not None:
            out.add(("ffn", layer.ffn.name))
            if layer.ffn.name == "moe":
                out.add(("router", layer.ffn.config.router.name))
    return out


def test_the_specs_cover_every_built_in_part_kind():
    covered = set().union(*(kinds(make()) for make in SPECS.values()))
    for kind in ("mixer", "ffn", "router", "block", "position"):
        # zoo's own parts: a part a test or a plugin registered in this process is not zoo's to cover
        missing = own(kind) - {n for k, n in covered if k == kind}
        assert not missing, f"no spec here uses the {kind} {sorted(missing)}: add a preset or a part spec"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_two_builds_with_one_seed_are_bit_equal_whatever_the_global_rng(name):
    spec = SPECS[name]()
    torch.manual_seed(1)
    a = zoo.build_model(spec, seed=7).state_dict()
    torch.manual_seed(2)
    torch.rand(1000)  # a different global stream, moved on
    b = zoo.build_model(spec, seed=7).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{name}: {key} differs between two builds with seed 7"


def test_every_random_parameter_moves_with_the_seed_and_none_draws_from_the_global_rng():
    """Each parameter that is random under one seed differs under another, and building draws
    nothing from the global RNG: its state is the same before and after."""
    for name in ("deepseek-v3", "qwen3-next-80b-a3b", "mamba2-2.7b"):
        spec = SPECS[name]()
        before = torch.get_rng_state()
        a = zoo.build_model(spec, seed=3)
        assert torch.equal(torch.get_rng_state(), before), f"{name}: building drew from the global RNG"
        b = zoo.build_model(spec, seed=4)
        for (key, p), q in zip(a.named_parameters(), b.parameters()):
            # not a constant (norm weights, Mamba-2's D = 1 and A = -(1..heads))
            if p.unique().numel() > 1 and not (name == "mamba2-2.7b" and key.endswith("A_log")):
                assert not torch.equal(p, q), f"{name}: {key} does not follow the seed"


def test_experts_and_router_follow_the_spec_init_std():
    spec = one_of_each("qwen3-30b-a3b", d_model=64, d_ff=256).with_overrides(init_std=0.2)
    model = zoo.build_model(spec, seed=0)
    moe = model.layers[0].ffn
    for what, w in (("w_up", moe.experts.w_up), ("w_down", moe.experts.w_down), ("w_gate", moe.experts.w_gate),
                    ("router", moe.router.weight)):
        # n >= 512 normal draws: the sample std is within 10% of 0.2 with odds far beyond 1e-6
        assert w.numel() >= 512 and abs(w.std().item() / 0.2 - 1) < 0.1, (what, w.std().item())


def test_a_plugin_part_that_draws_from_the_global_rng_is_seeded_too():
    """The toy plugin's MoE initialises its experts with ``normal_`` on the global RNG (the old
    protocol): the model seeds that RNG from the seed and the module's name around it."""
    assert zoo.load_plugin("toy_plugin").error is None
    import toy_plugin

    spec = get_spec(toy_plugin.SPEC, {"vocab_size": 64})
    torch.manual_seed(1)
    a = zoo.build_model(spec, seed=5).state_dict()
    torch.manual_seed(2)
    b = zoo.build_model(spec, seed=5).state_dict()
    assert any("w_up" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["layers.0.ffn.w_up"], a["layers.1.ffn.w_up"]), "two layers drew the same values"


FSDP_START = """
import json, sys
import torch
import zoo
from accelerate import Accelerator
from zoo.testing import one_of_each
from zoo.training.checkpointer import full_state_dict
from zoo.training.loop import start_model

acc = Accelerator(cpu=True)
out, names = sys.argv[1], json.loads(sys.argv[2])
report = {}
for name in names:
    spec = one_of_each(name, vocab_size=67)  # 67 rows: shards of uneven size
    net = start_model(spec, acc, seed=11, sharded=True)
    local = {k: v.to_local().shape[0] for k, v in net.state_dict().items() if hasattr(v, "to_local")}
    whole = full_state_dict(net, sharded=True)  # collective; the whole tensors land on rank 0
    if not acc.is_main_process:
        continue
    ref = zoo.build_model(spec, seed=11).state_dict()
    report[name] = {"keys": sorted(whole) == sorted(ref),
                    "differ": [k for k in ref if not torch.equal(whole[k], ref[k])],
                    "local_rows": local}
if acc.is_main_process:
    with open(out, "w") as f:
        json.dump(report, f)
"""


@pytest.mark.slow  # torchrun, two processes
def test_fsdp2_from_meta_on_two_processes_starts_from_the_one_process_weights(tmp_path, one_thread):
    """FSDP2 per block, built on the meta device and initialised shard by shard on two CPU
    processes (gloo), as ``zoo.train(fsdp=True)`` starts: the gathered whole state dict is
    bit-equal to ``build_model(spec, seed=s)`` on one process, for a dense model, MLA + MoE with a
    selection bias and MTP, and a Gated DeltaNet hybrid (short convolutions, recurrent decays)."""
    names = ["llama3-8b", "deepseek-v3", "qwen3-next-80b-a3b"]
    script = tmp_path / "start.py"
    script.write_text(FSDP_START)
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(out), json.dumps(names)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Error" in line]
    assert proc.returncode == 0, "\n".join(errors[:6]) + proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for name in names:
        assert report[name]["keys"], name
        assert report[name]["differ"] == [], f"{name}: FSDP2's start differs from one process in {report[name]['differ']}"
        assert report[name]["local_rows"]["embed.weight"] == 34  # rank 0's share of 67 rows: it was sharded
