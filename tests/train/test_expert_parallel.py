"""Expert parallelism (``parallel.ep``) on CPU processes (torchrun, gloo, one launch of four): the routed
experts sharded by expert over ``ep``, token copies sent to their expert's process and back with uneven
all-to-all splits, give the one-process loss and EVERY gradient, the one-process initial weights, and
(FSDP2 x EP with activation checkpointing) the one-process weights after three optimizer steps, on tiny
deepseek-v3 (MLA + MoE + MTP) and qwen3-moe, under ep = 2 (HSDP: 2 replicas x ep 2), ep = 4 and
dp_shard 2 x ep 2.

"One process" is the same global batch on one process, each data-parallel process's rows a micro-batch
of its own and their losses averaged (the pooled and per-sequence balance losses are taken per
micro-batch, as under any data parallelism). The router's choices are asserted identical to the
one-process float32 and float64 runs' first, so the comparison is of one smooth function.

Tolerances are in units of the one-process float32 run's own error against float64 on the same
weights and data, as in tests/train/test_tensor_parallel.py (``||fp32 - fp64||``, plus fp32's half ulp of
the tensor's norm where that run is exact)."""

import pytest

import zoo
from zoo.training.config import ParallelConfig, TrainConfig

from parallel_check import (HELPERS, MOE_HELPERS, MOE_SETS as SETS, MOE_TRAIN as TRAIN,
                            assert_moe_loss_and_gradients_match, assert_within, launch)

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = '''import json, sys
import torch
import torch.distributed as dist
import zoo
import zoo.core.parallel as zp
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from zoo.testing import one_of_each
from zoo.training.checkpointer import full_state_dict
from zoo.training.config import ParallelConfig
from zoo.training.loop import clip_grad_norm, start_model

acc = Accelerator(cpu=True)
out, models, layouts, train = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
rank, world = dist.get_rank(), dist.get_world_size()
# DeepSeek-V3 with its aux-loss-free balancing on (the recipe leaves it off), so the bias moves each step
SPECS = {"deepseek-v3": lambda: zoo.get_spec(one_of_each("deepseek-v3", vocab_size=256),
                                             {"layers.moe.ffn.bias_update": "sign", "layers.moe.ffn.bias_rate": 0.01}),
         "qwen3-moe": lambda: one_of_each("qwen3-30b-a3b", vocab_size=256)}
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (8, 16), generator=gen) for _ in range(3)]

splits = []  # every all-to-all's input splits on this process
_exchange = zp._all_to_all
def recorded(x, output_splits, input_splits, group):
    splits.append(list(input_splits))
    return _exchange(x, output_splits, input_splits, group)
zp._all_to_all = recorded


''' + HELPERS + MOE_HELPERS + '''
report = {}
for lname, layout in layouts.items():
    steps = layout.pop("steps")
    parallel = ParallelConfig(**layout)
    sizes = parallel.sizes(world)
    dp = world // sizes["tp"]
    for name in models[lname]:
        spec = SPECS[name]()
        entry = report.setdefault(lname, {}).setdefault(name, {})
        net = start_model(spec, acc, seed=5, sharded=True, parallel=parallel)
        net.train()
        init = full_state_dict(net, sharded=True)
        ref = one_process(spec, steps, dp) if rank == 0 else None
        if rank == 0:
            plain = zoo.build_model(spec, seed=5).state_dict()
            entry["init_keys"] = sorted(init) == sorted(plain)
            entry["init_differ"] = [k for k in plain if not torch.equal(init[k], plain[k])]
        entry["experts_local"] = [tuple(x.experts.w_up.to_local().shape) for x in moes(net)][:1]
        chosen = routers(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        splits.clear()
        for s in range(steps):
            rows = batches[s].chunk(dp)[rank]
            loss = net(rows, labels=rows).loss
            mine = [c.tolist() for c in chosen]  # before backward, whose recomputation routes again
            loss.backward()
            if s == 0:
                mean = summed(loss.detach()) / world
                grads = {key(k): whole(p.grad) for k, p in net.named_parameters()}
                every = [None] * world
                dist.all_gather_object(every, mine)
                load = [summed(x.load).tolist() for x in moes(net)]
                if rank == 0:
                    r32, r64 = ref[torch.float32], ref[torch.float64]
                    entry["loss"] = [mean.item(), r32["loss"], r64["loss"]]
                    entry["grads"] = compare(grads, r32["grads"], r64["grads"])
                    # each reference call saw all dp chunks in turn: chunk r of call j is process r's call j
                    calls = len(mine)
                    ours = [sum((every[r][j] for r in range(dp)), []) for j in range(calls)]
                    for tag, r in (("fp32", r32), ("fp64", r64)):
                        theirs = [sum((r["chosen"][r_ * calls + j].tolist() for r_ in range(dp)), [])
                                  for j in range(calls)]
                        entry[f"same_choices_{tag}"] = ours == theirs
                    entry["load"] = [load, [x.tolist() for x in r32["load"]]]
            clip_grad_norm(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            for x in moes(net):
                x.after_optimizer_step(reduce=summed)
        every = [None] * world
        dist.all_gather_object(every, splits)
        if rank == 0:
            entry["uneven"] = sum(len(set(s)) > 1 for proc in every for s in proc)
            entry["exchanges"] = sum(len(proc) for proc in every)
            entry["empty"] = sum(0 in s for proc in every for s in proc)
        if steps > 1:
            after = {key(k): v for k, v in full_state_dict(net, sharded=True).items()}
            if rank == 0:
                entry["after"] = compare(after, ref[torch.float32]["after"], ref[torch.float64]["after"])
# zoo.train itself on dp_shard 2 x ep 2
report_and_train(report, out, "qwen3-30b-a3b", {"dp_shard": 2, "ep": 2}, train)
'''

MODELS = ["deepseek-v3", "qwen3-moe"]
LAYOUTS = {"ep2": {"dp_replicate": 2, "dp_shard": 1, "ep": 2, "steps": 1},
           "ep4": {"dp_shard": 1, "ep": 4, "steps": 1},
           "fsdp_ep": {"dp_shard": 2, "ep": 2, "ac": "block", "steps": 3}}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One launch of four processes for every layout and model."""
    tmp = tmp_path_factory.mktemp("ep")
    models = {name: MODELS for name in LAYOUTS}
    return launch(tmp, "ep_check", SCRIPT, models, LAYOUTS, {**TRAIN, "out_dir": str(tmp / "train")})


RUNS = [(layout, name) for layout in LAYOUTS for name in MODELS]


@pytest.mark.parametrize("layout,name", RUNS)
def test_loss_and_every_gradient_equal_one_process(report, layout, name):
    assert_moe_loss_and_gradients_match(report["parts"][layout][name], f"{layout} {name}")


@pytest.mark.parametrize("layout,name", RUNS)
def test_the_token_copies_travel_with_uneven_splits(report, layout, name):
    entry = report["parts"][layout][name]
    # of 8 experts, E / ep on each process, FSDP2 sharding those over dp_shard
    assert entry["experts_local"][0][0] == 8 // (LAYOUTS[layout]["ep"] * LAYOUTS[layout]["dp_shard"])
    assert entry["exchanges"] > 0 and entry["uneven"] > 0, entry


@pytest.mark.parametrize("layout,name", RUNS)
def test_the_initial_weights_are_bit_equal_to_one_process(report, layout, name):
    entry = report["parts"][layout][name]
    assert entry["init_keys"] and entry["init_differ"] == [], entry


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_token_is_counted_once_in_the_expert_load(report, layout):
    """The aux-loss-free bias update reads the load summed over the processes: the one-process count."""
    ours, one = report["parts"][layout]["deepseek-v3"]["load"]
    assert ours == one and sum(map(sum, one)) > 0


@pytest.mark.parametrize("name", MODELS)
def test_three_optimizer_steps_of_fsdp_x_ep_equal_one_process(report, name):
    assert_within(report["parts"]["fsdp_ep"][name]["after"], 20, f"{name}: weights after 3 steps")


def test_zoo_train_on_fsdp_x_ep_repeats_the_one_process_run(report):
    """``zoo.train(parallel={"dp_shard": 2, "ep": 2})``: each process reads a quarter of the global batch;
    the losses are those of one process over the same global batch in four micro-batches, to the DDP
    test's float32 reduction-order bound."""
    one = zoo.train("qwen3-30b-a3b", out_dir=str(report["tmp"] / "one"), **TRAIN)
    assert report["train"]["losses"] == pytest.approx(one.losses, rel=2e-5, abs=0)


def test_a_run_on_fsdp_x_ep_resumes_exactly_from_its_shards(report):
    assert report["train"]["resumed"] == report["train"]["losses"][2:]


def test_ep_is_checked_against_the_processes_and_the_model():
    TrainConfig(parallel=ParallelConfig(ep=4)).check()
    assert ParallelConfig(ep=2).sizes(4) == {"dp_replicate": 1, "dp_shard": 2, "ep": 2, "tp": 1}
    with pytest.raises(ValueError, match="ep 3 = 3 does not divide the 4 processes"):
        ParallelConfig(ep=3).sizes(4)
    moe = zoo.get_spec("qwen3-30b-a3b", {"layers.*.ffn.n_experts": 6, "layers.*.ffn.top_k": 2})
    with pytest.raises(ValueError, match=r"parallel.ep = 4 does not divide layers.0.ffn.n_experts = 6"):
        ParallelConfig(ep=4).check_model(moe)
    ParallelConfig(ep=3).check_model(moe)
    with pytest.raises(ValueError, match=r"parallel.ep = 2: the model has no FFN with routed experts.*\['swiglu'\]"):
        ParallelConfig(ep=2).check_model(zoo.get_spec("llama3-8b"))
    ParallelConfig(ep=1).check_model(zoo.get_spec("llama3-8b"))


def test_expert_parallelism_refuses_to_run_without_fsdp():
    from types import SimpleNamespace

    from zoo.training.loop import start_model

    spec = zoo.get_spec("qwen3-30b-a3b", SETS)
    with pytest.raises(ValueError, match="ep = 2 trains with FSDP2.*turn fsdp on"):
        start_model(spec, SimpleNamespace(device="cpu"), seed=0, sharded=False, parallel=ParallelConfig(ep=2))


# -- the experts' names before they were a module of their own ------------------------------------------

def test_a_format_naming_the_experts_as_zoo_0_2_did_still_binds_and_warns():
    from zoo.checkpoints.hf.format import get_format
    from zoo.checkpoints.hf.maps import Rule, bind

    model = zoo.build_model(zoo.get_spec("qwen3-30b-a3b", SETS), seed=0)
    rules = get_format("qwen3_moe").rules(model.spec)
    old = [Rule(r.hf, tuple(n.replace(".experts.w_", ".w_") for n in r.zoo), r.transform) for r in rules]
    assert any(n.endswith("ffn.w_up") for r in old for n in r.zoo)
    with pytest.warns(DeprecationWarning, match=r"layers.\{i\}.ffn.w_gate.*use layers.\{i\}.ffn.experts.w_\*"):
        bound = list(bind(old, model))
    assert [b.zoo for b in bound] == [b.zoo for b in bind(rules, model)]


def test_the_old_attribute_reads_the_experts_module_and_warns():
    moe = zoo.build_model(zoo.get_spec("qwen3-30b-a3b", SETS), seed=0).layers[0].ffn
    with pytest.warns(DeprecationWarning, match="MoE.w_gate, MoE.w_up, MoE.w_down.*MoE.experts.w_gate"):
        assert moe.w_up is moe.experts.w_up
