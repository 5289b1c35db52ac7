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
from zoo.train.config import ParallelConfig, TrainConfig

from parallel_check import HELPERS, launch

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = '''import json, sys
import torch
import torch.distributed as dist
import zoo
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from zoo.core.spec import ModelSpec
from zoo.testing import one_of_each
from zoo.train.checkpointer import full_state_dict
from zoo.train.config import ParallelConfig
from zoo.train.loop import clip_grad_norm, start_model

acc = Accelerator(cpu=True)
out, models, layouts, train = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
rank, world = dist.get_rank(), dist.get_world_size()


def tiny(name):
    data = one_of_each(name, vocab_size=256).to_dict()
    if name.startswith("deepseek-v3"):  # MLA (DSA) on dense layers (the MoE has no tensor-parallel plan yet)
        data.update(mtp=None, layer_pattern=["dense", "dense"])
        data["layers"].pop("moe")
    return ModelSpec.from_dict(data)


def dense_qwen3():
    data = one_of_each("qwen3-30b-a3b", vocab_size=256).to_dict()
    for layer in data["layers"].values():
        layer["ffn"] = {"name": "swiglu", "d_ff": 64}
    return ModelSpec.from_dict(data)


SPECS = {"llama3-8b": lambda: tiny("llama3-8b"), "gemma2-2b": lambda: tiny("gemma2-2b"), "qwen3": dense_qwen3,
         "olmo2-7b": lambda: tiny("olmo2-7b"), "deepseek-v3": lambda: tiny("deepseek-v3"),
         "deepseek-v3.2": lambda: tiny("deepseek-v3.2-exp"),
         "qwen3-moe": lambda: tiny("qwen3-30b-a3b")}
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (4, 16), generator=gen) for _ in range(3)]


''' + HELPERS + '''

def one_process(spec, steps):
    """Loss and gradients of the first batch (float32 and float64), and the weights after ``steps`` AdamW steps."""
    res = {}
    for dtype in (torch.float32, torch.float64):
        m = zoo.build_model(spec, seed=5).to(dtype)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(steps):
            loss = m.loss(batches[s]).loss
            loss.backward()
            if s == 0:
                res[dtype] = {"loss": loss.item(), "grads": {k: p.grad.clone() for k, p in m.named_parameters()}}
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        res[dtype]["after"] = {k: v.clone() for k, v in m.state_dict().items()}
    return res


report = {}
for lname, layout in layouts.items():
    sharded = layout.pop("fsdp")
    parallel = ParallelConfig(**layout)
    sizes = parallel.sizes(world)
    tp, dp = sizes["tp"], (sizes["dp_shard"] if sharded else 1)
    dp_rank = (rank // tp) % sizes["dp_shard"] if sharded else 0
    for name in models[lname]:
        spec = SPECS[name]()
        entry = report.setdefault(lname, {}).setdefault(name, {})
        try:
            net = start_model(spec, acc, seed=5, sharded=sharded, parallel=parallel)
        except NotImplementedError as exc:
            entry["error"] = str(exc)
            continue
        init = full_state_dict(net, sharded=True)
        steps = 3 if sharded else 1
        ref = one_process(spec, steps) if rank == 0 else None
        if rank == 0:
            plain = zoo.build_model(spec, seed=5).state_dict()
            entry["init_keys"] = sorted(init) == sorted(plain)
            entry["init_differ"] = [k for k in plain if not torch.equal(init[k], plain[k])]
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(steps):
            rows = batches[s].chunk(dp)[dp_rank]
            loss = net(rows, labels=rows).loss  # through forward: FSDP2 gathers the root there
            loss.backward()
            if s == 0:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                grads = {key(k): whole(p.grad) for k, p in net.named_parameters()}
                if rank == 0:
                    r32, r64 = ref[torch.float32], ref[torch.float64]
                    entry["loss"] = [mean.item() / world, r32["loss"], r64["loss"]]
                    entry["grads"] = compare(grads, r32["grads"], r64["grads"])
            clip_grad_norm(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if sharded:
            after = {key(k): v for k, v in full_state_dict(net, sharded=True).items()}
            if rank == 0:
                entry["after"] = compare(after, ref[torch.float32]["after"], ref[torch.float64]["after"])
# zoo.train itself on FSDP2 x TP (2 x 2)
report_and_train(report, out, "llama3-8b", {"dp_shard": 2, "tp": 2}, train)
'''

DENSE = ["llama3-8b", "gemma2-2b", "qwen3", "olmo2-7b", "deepseek-v3", "deepseek-v3.2"]
MODELS = {"tp2": DENSE + ["qwen3-moe"], "tp4": ["llama3-8b", "olmo2-7b", "deepseek-v3", "deepseek-v3.2"], "fsdp_tp": DENSE}
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
        if not (name == "qwen3-moe" or (layout == "tp4" and name == "llama3-8b"))]


@pytest.mark.parametrize("layout,name", RUNS)
def test_loss_and_every_gradient_equal_one_process(report, layout, name):
    entry = report["parts"][layout][name]
    got, r32, r64 = entry["loss"]
    # zoo's loss takes the logits to float32 in both references (r32 == r64 here), and FSDP averages two
    # halves' means where one process takes one mean: the bound is in float32's units, 16 ulps relative.
    assert abs(got - r64) <= 16 * 2 ** -24 * abs(r64), entry["loss"]
    grads = entry["grads"]
    assert len(grads) > 8, grads  # every parameter was compared
    bad = {k: v for k, v in grads.items() if not v <= 4}
    assert not bad, f"{layout} {name}: gradients off by these multiples of float32's own error: {bad}"


@pytest.mark.parametrize("layout,name", RUNS)
def test_the_initial_weights_are_bit_equal_to_one_process(report, layout, name):
    entry = report["parts"][layout][name]
    assert entry["init_keys"] and entry["init_differ"] == [], entry


@pytest.mark.parametrize("name", DENSE)
def test_three_optimizer_steps_of_fsdp_x_tp_equal_one_process(report, name):
    after = report["parts"]["fsdp_tp"][name]["after"]
    bad = {k: v for k, v in after.items() if not v <= 20}
    assert not bad, f"{name}: weights after 3 steps off by these multiples of float32's own error: {bad}"


def test_a_part_without_a_plan_or_with_heads_that_do_not_split_is_an_error_naming_it(report):
    moe = report["parts"]["tp2"]["qwen3-moe"]["error"]
    assert moe.startswith("layers.0.ffn (zoo.components.ffn.moe.MoE) has no tensor-parallel plan"), moe
    heads = report["parts"]["tp4"]["llama3-8b"]["error"]
    assert "layers.0.mixer" in heads and "n_kv_heads = 2 does not split over tp = 4" in heads, heads


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
