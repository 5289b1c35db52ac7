"""Tensor parallelism (``parallel.tp``) of the recurrent mixers on CPU processes (torchrun, gloo, one launch
of four): Mamba-2 (tiny mamba2, one group of B and C, and nemotron-h, two groups, beside attention and an
MLP), Gated DeltaNet (qwen3-next, two key heads for four value heads, beside gated attention) and
lightning attention (minimax), plus linear attention with RetNet's decays and the sum normaliser. Each
gives the one-process loss and EVERY gradient and the one-process initial weights under tp = 2 (two
independent groups), tp = 4 (one head per process: B and C, or a key head, shared by processes) and
FSDP2 x TP on a 2 x 2 mesh with activation checkpointing, and there the one-process weights after three
AdamW steps.

The packed projections (``[z | x | B | C | dt]``, ``[q | k | v | z]``) and their convolutions compute
each process's rows of every section; a gradient that reached only the rows one process computes, or
twice a row two processes share, would show here. Routed experts have no tensor-parallel plan here, so
the MoE FFNs of qwen3-next and minimax are dense SwiGLUs; attention has as many kv heads as heads so
that tp = 4 splits it.

Tolerances are in units of the one-process float32 run's own error against float64 on the same weights
and data, as in tests/train/test_tensor_parallel.py."""

import pytest

from parallel_check import HELPERS, assert_loss_and_gradients_match, launch

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

SCRIPT = '''import json, sys
import torch
import torch.distributed as dist
import zoo
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from zoo.core.spec import ModelSpec
from zoo.testing import one_of_each
from zoo.training.checkpointer import full_state_dict
from zoo.training.config import ParallelConfig
from zoo.training.loop import clip_grad_norm, start_model

acc = Accelerator(cpu=True)
out, models, layouts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
rank, world = dist.get_rank(), dist.get_world_size()


def tiny(name, **mixer):
    """one_of_each(name) with dense FFNs for its MoEs, attention with a kv head per head, ``mixer`` set on
    the recurrent mixers."""
    data = one_of_each(name, vocab_size=256).to_dict()
    data["mtp"] = None
    for layer in data["layers"].values():
        if layer.get("ffn", {}).get("name") == "moe":
            layer["ffn"] = {"name": "swiglu", "d_ff": 64}
        if layer["mixer"]["name"] == "attention":
            layer["mixer"]["n_kv_heads"] = 4
        elif layer["mixer"]["name"] != "none":
            layer["mixer"].update(mixer)
    return ModelSpec.from_dict(data)


def linear():
    data = one_of_each("llama3-8b", vocab_size=256).to_dict()
    data["layers"]["default"]["mixer"] = {"name": "linear_attention", "n_heads": 4, "head_dim": 8,
                                          "feature_map": "elu1", "decay": "retnet", "normalize": "sum", "chunk": 4}
    return ModelSpec.from_dict(data)


SPECS = {"mamba2": lambda: tiny("mamba2-2.7b"), "nemotron-h": lambda: tiny("nemotron-h-8b"),
         "qwen3-next": lambda: tiny("qwen3-next-80b-a3b", chunk_size=4),
         "minimax": lambda: tiny("minimax-text-01", n_heads=4),
         "linear": linear,
         "mamba2-3-groups": lambda: tiny("mamba2-2.7b", n_heads=6, n_groups=3),
         "qwen3-next-3-key-heads": lambda: tiny("qwen3-next-80b-a3b", n_heads=6, n_key_heads=3)}
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (4, 16), generator=gen) for _ in range(3)]

''' + HELPERS + '''

report = compare_layouts(models, layouts, SPECS)
if rank == 0:
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
'''

MIXERS = ["mamba2", "nemotron-h", "qwen3-next", "minimax", "linear"]
MODELS = {"tp2": MIXERS + ["mamba2-3-groups", "qwen3-next-3-key-heads"], "tp4": MIXERS, "fsdp_tp": MIXERS}
LAYOUTS = {"tp2": {"dp_replicate": 2, "tp": 2, "dp_shard": 1, "fsdp": False},  # two independent tp = 2 groups
           "tp4": {"tp": 4, "dp_shard": 1, "fsdp": False},
           "fsdp_tp": {"dp_shard": 2, "tp": 2, "ac": "block", "fsdp": True}}
RUNS = [(layout, name) for layout, names in MODELS.items() for name in names if name in MIXERS]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One launch of four processes for every layout and model."""
    return launch(tmp_path_factory.mktemp("tp_recurrent"), "tp_recurrent_check", SCRIPT, MODELS, LAYOUTS)["parts"]


@pytest.mark.parametrize("layout,name", RUNS)
def test_loss_and_every_gradient_equal_one_process(report, layout, name):
    assert_loss_and_gradients_match(report[layout][name], f"{layout} {name}")


@pytest.mark.parametrize("layout,name", RUNS)
def test_the_initial_weights_are_bit_equal_to_one_process(report, layout, name):
    entry = report[layout][name]
    assert entry["init_keys"] and entry["init_differ"] == [], entry


@pytest.mark.parametrize("name", MIXERS)
def test_three_optimizer_steps_of_fsdp_x_tp_equal_one_process(report, name):
    after = report["fsdp_tp"][name]["after"]
    bad = {k: v for k, v in after.items() if not v <= 20}
    assert not bad, f"{name}: weights after 3 steps off by these multiples of float32's own error: {bad}"


@pytest.mark.parametrize("name,field", [("mamba2-3-groups", "n_groups"), ("qwen3-next-3-key-heads", "n_key_heads")])
def test_groups_that_neither_split_over_tp_nor_divide_it_are_an_error_naming_the_field(report, name, field):
    error = report["tp2"][name]["error"]
    assert error.startswith("layers.0.mixer") and f"{field} = 3 and tp = 2" in error, error
