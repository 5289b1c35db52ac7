"""Tensor and sequence parallelism (``parallel.tp``) on CPU processes (torchrun, gloo): each part's plan
gives the one-process loss and EVERY gradient (the loss alone hides a gradient that gets only one
process's share), the one-process initial weights, and the one-process weights after optimizer steps,
under tp = 2, tp = 4 and FSDP2 x TP on a 2 x 2 mesh (with activation checkpointing).

Tolerances are in units of the one-process float32 run's own error against float64 on the same
weights and data (``||fp32 - fp64||``, plus fp32's half ulp of the tensor's norm for a tensor float32
computes exactly): measured at most 1.3 for gradients and 5.3 after three AdamW steps
(whose first update is about ``lr * sign(g)``, so it magnifies tiny gradients' rounding)."""

import pytest

import zoo
from zoo.training.config import ParallelConfig, TrainConfig

from parallel_check import HELPERS, assert_loss_and_gradients_match, assert_within, launch

pytestmark = pytest.mark.usefixtures("one_thread")

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
out, models, layouts, train = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
rank, world = dist.get_rank(), dist.get_world_size()


def tiny(name):
    data = one_of_each(name, vocab_size=256).to_dict()
    if name.startswith("deepseek-v3"):  # MLA (DSA) on dense layers (the MoE's plan: tests/train/test_moe_tensor_parallel.py)
        data.update(mtp=None, layer_pattern=["dense", "dense"])
        data["layers"].pop("moe")
    return ModelSpec.from_dict(data)


def dense_qwen3():
    data = one_of_each("qwen3-30b-a3b", vocab_size=256).to_dict()
    for layer in data["layers"].values():
        layer["ffn"] = {"name": "swiglu", "d_ff": 64}
    return ModelSpec.from_dict(data)


def gemma2_padded_zloss():
    """Tied head, soft-capped logits, a vocabulary padded to 260 rows (the last process's columns end in
    padding) and z-loss: what the vocabulary-parallel loss must get right beside the plain one."""
    data = one_of_each("gemma2-2b", vocab_size=256).to_dict()
    data["embedding"]["padded_vocab_size"] = 260
    data["z_loss"] = 1e-2
    return ModelSpec.from_dict(data)


SPECS = {"gemma2-padded-zloss": gemma2_padded_zloss, "llama3-8b": lambda: tiny("llama3-8b"),
         "gemma2-2b": lambda: tiny("gemma2-2b"), "qwen3": dense_qwen3,
         "olmo2-7b": lambda: tiny("olmo2-7b"), "deepseek-v3": lambda: tiny("deepseek-v3"),
         "deepseek-v3.2": lambda: tiny("deepseek-v3.2-exp")}
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (4, 16), generator=gen) for _ in range(3)]


''' + HELPERS + '''

report = compare_layouts(models, layouts, SPECS)
# zoo.train itself on FSDP2 x TP (2 x 2)
report_and_train(report, out, "llama3-8b", {"dp_shard": 2, "tp": 2}, train)
'''

DENSE = ["llama3-8b", "gemma2-2b", "qwen3", "olmo2-7b", "deepseek-v3", "deepseek-v3.2"]
MODELS = {"tp2": DENSE + ["gemma2-padded-zloss"], "tp4": ["llama3-8b", "olmo2-7b", "deepseek-v3", "deepseek-v3.2"],
          "fsdp_tp": DENSE + ["gemma2-padded-zloss"]}
LAYOUTS = {"tp2": {"dp_replicate": 2, "tp": 2, "dp_shard": 1, "fsdp": False},  # two independent tp = 2 groups
           "tp4": {"tp": 4, "dp_shard": 1, "fsdp": False},
           "fsdp_tp": {"dp_shard": 2, "tp": 2, "ac": "block", "fsdp": True}}
SETS = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
TRAIN = dict(overrides=SETS, steps=3, seq_len=32, global_batch=8, micro_batch=4, lr=3e-3, warmup_steps=1, seed=1,
             cpu=True, progress=False, plot=False, export=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One launch of four processes for every layout and model."""
    tmp = tmp_path_factory.mktemp("tp")
    return launch(tmp, "tp_check", SCRIPT, MODELS, LAYOUTS, {**TRAIN, "out_dir": str(tmp / "train")})


RUNS = [(layout, name) for layout, names in MODELS.items() for name in names
        if not (layout == "tp4" and name == "llama3-8b")]


@pytest.mark.parametrize("layout,name", RUNS)
def test_loss_and_every_gradient_equal_one_process(report, layout, name):
    assert_loss_and_gradients_match(report["parts"][layout][name], f"{layout} {name}")


@pytest.mark.parametrize("layout,name", RUNS)
def test_the_initial_weights_are_bit_equal_to_one_process(report, layout, name):
    entry = report["parts"][layout][name]
    assert entry["init_keys"] and entry["init_differ"] == [], entry


@pytest.mark.parametrize("name", MODELS["fsdp_tp"])
def test_three_optimizer_steps_of_fsdp_x_tp_equal_one_process(report, name):
    assert_within(report["parts"]["fsdp_tp"][name]["after"], 20, f"{name}: weights after 3 steps")


def test_a_part_without_a_plan_or_with_heads_that_do_not_split_is_an_error_naming_it(report):
    heads = report["parts"]["tp4"]["llama3-8b"]["error"]
    assert "layers.0.mixer" in heads and "n_kv_heads = 2 does not split over tp = 4" in heads, heads
    # A plugin's part without parallelize (the toy plugin's recurrent mixer): the plan is asked of every
    # part on the meta device (zoo describe --parallel does the same), before any process is started.
    assert zoo.load_plugin("toy_plugin").error is None
    import toy_plugin

    from zoo.tools.memory import plan

    with pytest.raises(NotImplementedError, match=r"layers.0.mixer \(toy_plugin.ToyRecurrent\) has no tensor-parallel plan"):
        plan(zoo.get_spec(toy_plugin.SPEC), "tp=2,dp_shard=1", seq_len=16, micro_batch=1, device="cpu")


def test_zoo_train_on_fsdp_x_tp_repeats_the_one_process_run(report):
    """``zoo.train(parallel={"dp_shard": 2, "tp": 2})``: each tensor-parallel pair reads one half of the
    global batch, gradients are clipped over both meshes; the losses are those of one process over the
    same global batch (two accumulated micro-batches), to the DDP test's float32 reduction-order bound."""
    one = zoo.train("llama3-8b", out_dir=str(report["tmp"] / "one"), **TRAIN)
    assert report["train"]["losses"] == pytest.approx(one.losses, rel=2e-5, abs=0)


def test_a_run_on_fsdp_x_tp_resumes_exactly_from_its_shards(report):
    """Resumed from the step-2 checkpoint on the same layout, step 3 is the uninterrupted run's, bit for bit."""
    assert report["train"]["resumed"] == report["train"]["losses"][2:]


def test_tp_is_accepted():
    TrainConfig(parallel=ParallelConfig(tp=2)).check()
