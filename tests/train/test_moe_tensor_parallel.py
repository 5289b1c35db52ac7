"""Tensor parallelism of the mixture of experts (``parallel.tp`` on an ``moe`` FFN), alone and with FSDP2 and
expert parallelism, on CPU processes (torchrun, gloo, one launch of four): each process routes its own slice
of the sequence with the router, experts and shared expert whole (or, under EP, its experts), their
gradients summed over tp, and the balance statistics summed over tp. On tiny qwen3-moe (softmax top-k, the
Switch loss per layer and pooled, the router z-loss) and deepseek-v3 (MLA + MoE: sigmoid group router with
the aux-loss-free bias update, shared expert, the sequence-wise loss), under tp = 2 (2 replicas), FSDP2 x TP
(dp_shard 2 x tp 2) and FSDP2 x TP x EP (tp 2 x ep 2, the dense parameters sharded by FSDP2 over the ep
processes): the routers' top-k choices identical to the one-process float32 and float64 runs' first, then
the loss, each loss term and metric, and EVERY gradient; the load each token adds to the selection bias
counted once; the one-process initial weights; three AdamW steps of FSDP2 x TP x EP (with clipping, the
bias update and activation checkpointing); and ``zoo.train`` on tp 2 x ep 2 repeating the one-process
losses and resuming exactly.

A layout with FSDP2 over dp_shard as well (dp_shard 2 x tp 2 x ep 2) needs eight processes; on four, the
composition with all three is tp 2 x ep 2, where FSDP2 shards everything but the experts over the two ep
processes (dp_shard x ep) and the experts are an FSDP2 unit of their own.

"One process" is the same global batch on one process, each data-parallel group's rows a micro-batch of
its own and their losses averaged (the balance losses are taken per micro-batch, as under any data
parallelism). Tolerances are in units of the one-process float32 run's own error against float64 on the
same weights and data, as in tests/train/test_tensor_parallel.py."""

import pytest

import zoo

from parallel_check import (HELPERS, MOE_HELPERS, MOE_SETS as SETS, MOE_TRAIN as TRAIN,
                            assert_moe_loss_and_gradients_match, assert_within, launch)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

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


def deepseek():  # the aux-loss-free bias moving each step, the sequence-wise loss on; no MTP (it has no TP plan)
    data = one_of_each("deepseek-v3", vocab_size=256).to_dict()
    data["mtp"] = None
    return zoo.get_spec(ModelSpec.from_dict(data), {"layers.moe.ffn.bias_update": "sign", "layers.moe.ffn.bias_rate": 0.01,
                                                    "layers.moe.ffn.sequence_loss": 0.1})


SPECS = {"deepseek-v3": deepseek,
         "qwen3-moe": lambda: zoo.get_spec(one_of_each("qwen3-30b-a3b", vocab_size=256),
                                           {"layers.*.ffn.switch_loss": 0.1, "layers.*.ffn.switch_pooled_loss": 0.1,
                                            "layers.*.ffn.z_loss": 0.01})}
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (8, 16), generator=gen) for _ in range(3)]
padding = torch.ones(8, 16, dtype=torch.long)
padding[0, :5] = 0  # left-padded, and right-padded across the two halves of the sequence
padding[3, 6:] = 0


''' + HELPERS + MOE_HELPERS + '''
def padded(model):
    """Loss, loss terms and gradients of the first batch with padding (the MoE's masks are its slice's under TP)."""
    o = model(batches[0], labels=batches[0], attention_mask=padding)
    o.loss.backward()
    res = {"loss": o.loss.detach(), "terms": terms(o), "grads": {key(k): whole(p.grad) for k, p in model.named_parameters()}}
    model.zero_grad()
    for x in moes(model):
        x.load.zero_()
    return res


report = {}
for lname, layout in layouts.items():
    steps, sharded = layout.pop("steps"), layout.pop("fsdp")
    parallel = ParallelConfig(**layout)
    sizes = parallel.sizes(world)
    tp = sizes["tp"]
    # tp is the mesh's last dimension; without FSDP2 (no data parallelism) every group reads the whole batch
    dp = world // tp if sharded else 1
    group = (lambda proc: proc // tp) if sharded else (lambda proc: 0)
    dp_rank = group(rank)
    for name in models[lname]:
        spec = SPECS[name]()
        entry = report.setdefault(lname, {}).setdefault(name, {})
        net = start_model(spec, acc, seed=5, sharded=sharded, parallel=parallel)
        net.train()
        init = full_state_dict(net, sharded=True)
        if not sharded:  # every process reads the whole batch
            got = padded(net)
            if rank == 0:
                r32, r64 = (padded(zoo.build_model(spec, seed=5).to(dtype).train()) for dtype in (torch.float32, torch.float64))
                entry["padded"] = {"loss": compare({"loss": got["loss"]}, {"loss": r32["loss"]}, {"loss": r64["loss"]}),
                                   "terms": compare(got["terms"], r32["terms"], r64["terms"]),
                                   "grads": compare(got["grads"], r32["grads"], r64["grads"])}
        ref = one_process(spec, steps, dp) if rank == 0 else None
        if rank == 0:
            plain = zoo.build_model(spec, seed=5).state_dict()
            entry["init_keys"] = sorted(init) == sorted(plain)
            entry["init_differ"] = [k for k in plain if not torch.equal(init[k], plain[k])]
        w_up = moes(net)[0].experts.w_up
        entry["experts_local"] = list((w_up.to_local() if isinstance(w_up, DTensor) else w_up).shape)
        chosen = routers(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(steps):
            rows = batches[s].chunk(dp)[dp_rank]
            o = net(rows, labels=rows)
            mine = [c.tolist() for c in chosen]  # before backward, whose recomputation routes again
            o.loss.backward()
            if s == 0:
                mean = summed(o.loss.detach()) / world
                parts = {k: summed(v) / world for k, v in terms(o).items()}  # alike on a tp group's processes
                grads = {key(k): whole(p.grad) for k, p in net.named_parameters()}
                every = [None] * world
                dist.all_gather_object(every, mine)
                copies = world // tp // dp  # groups reading the same rows
                load = [(summed(x.load) / copies).tolist() for x in moes(net)]
                if rank == 0:
                    r32, r64 = ref[torch.float32], ref[torch.float64]
                    entry["loss"] = [mean.item(), r32["loss"], r64["loss"]]
                    entry["terms"] = compare(parts, r32["terms"], r64["terms"])
                    entry["grads"] = compare(grads, r32["grads"], r64["grads"])
                    # process (d, t)'s call j routed slice t of the sequences of chunk d's call j in the reference
                    calls, T = len(mine), rows.shape[1]
                    for tag, r in (("fp32", r32), ("fp64", r64)):
                        same = True
                        for proc in range(world):
                            d, t = group(proc), proc % tp
                            for j in range(calls):
                                full = r["chosen"][d * calls + j].view(rows.shape[0], T, -1)
                                part = full[:, t * T // tp:(t + 1) * T // tp].reshape(-1, full.shape[-1])
                                same = same and part.tolist() == every[proc][j]
                        entry[f"same_choices_{tag}"] = same
                    entry["load"] = [load, [x.tolist() for x in r32["load"]]]
            clip_grad_norm(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            for x in moes(net):
                x.after_optimizer_step(reduce=summed)
        if steps > 1:
            after = {key(k): v for k, v in full_state_dict(net, sharded=True).items()}
            if rank == 0:
                entry["after"] = compare(after, ref[torch.float32]["after"], ref[torch.float64]["after"])
# zoo.train itself on tp 2 x ep 2
report_and_train(report, out, "qwen3-30b-a3b", {"dp_shard": 1, "ep": 2, "tp": 2}, train)
'''

MODELS = ["deepseek-v3", "qwen3-moe"]
LAYOUTS = {"tp2": {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "steps": 1, "fsdp": False},  # two tp = 2 groups, one batch
           "fsdp_tp": {"dp_shard": 2, "tp": 2, "steps": 1, "fsdp": True},
           "fsdp_tp_ep": {"dp_shard": 1, "ep": 2, "tp": 2, "ac": "block", "steps": 3, "fsdp": True}}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One launch of four processes for every layout and model."""
    tmp = tmp_path_factory.mktemp("moe_tp")
    models = {name: MODELS for name in LAYOUTS}
    return launch(tmp, "moe_tp_check", SCRIPT, models, LAYOUTS, {**TRAIN, "out_dir": str(tmp / "train")})


RUNS = [(layout, name) for layout in LAYOUTS for name in MODELS]


@pytest.mark.parametrize("layout,name", RUNS)
def test_loss_its_terms_and_every_gradient_equal_one_process(report, layout, name):
    entry = report["parts"][layout][name]
    assert_moe_loss_and_gradients_match(entry, f"{layout} {name}")
    assert any(".router." in k for k in entry["grads"]), entry["grads"]
    loss_terms = entry["terms"]
    want = {"deepseek-v3": ["moe_sequence"], "qwen3-moe": ["moe_switch", "moe_switch_pooled", "router_z"]}[name]
    assert set(want + ["moe_load_max", "router_entropy"]) <= set(loss_terms), loss_terms
    assert_within(loss_terms, 4, f"{layout} {name}: loss terms")


@pytest.mark.parametrize("name", MODELS)
def test_padding_is_masked_in_each_process_slice(report, name):
    """With padding in both halves of the sequences (tp = 2), the MoE masks its own slice's tokens: the
    loss, its terms and every gradient are one process's."""
    padded = report["parts"]["tp2"][name]["padded"]
    assert len(padded["terms"]) > 2 and len(padded["grads"]) > 12, padded
    for what in ("loss", "terms", "grads"):
        assert_within(padded[what], 4, f"{name} with padding: {what}")


@pytest.mark.parametrize("layout,name", RUNS)
def test_the_initial_weights_are_bit_equal_to_one_process(report, layout, name):
    entry = report["parts"][layout][name]
    assert entry["init_keys"] and entry["init_differ"] == [], entry


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_token_is_counted_once_in_the_expert_load(report, layout):
    """The aux-loss-free bias update reads the load summed over the processes: the one-process count,
    though the two processes of a tensor-parallel group read the same rows."""
    ours, one = report["parts"][layout]["deepseek-v3"]["load"]
    assert ours == one and sum(map(sum, one)) > 0


def test_the_experts_are_sharded_by_expert_parallelism_and_whole_over_tp(report):
    # 8 experts: whole on every process of tp 2 (FSDP2 splitting their rows over dp_shard 2), 4 per process under ep 2
    assert report["parts"]["tp2"]["qwen3-moe"]["experts_local"][0] == 8
    assert report["parts"]["fsdp_tp"]["qwen3-moe"]["experts_local"][0] == 4
    assert report["parts"]["fsdp_tp_ep"]["qwen3-moe"]["experts_local"][0] == 4


@pytest.mark.parametrize("name", MODELS)
def test_three_optimizer_steps_of_fsdp_x_tp_x_ep_equal_one_process(report, name):
    assert_within(report["parts"]["fsdp_tp_ep"][name]["after"], 20, f"{name}: weights after 3 steps")


def test_zoo_train_on_tp_x_ep_repeats_the_one_process_run(report):
    """``zoo.train(parallel={"ep": 2, "tp": 2})``: each tensor-parallel pair reads half the global batch; the
    losses are those of one process over the same global batch in four micro-batches, to the DDP test's
    float32 reduction-order bound."""
    one = zoo.train("qwen3-30b-a3b", out_dir=str(report["tmp"] / "one"), **TRAIN)
    assert report["train"]["losses"] == pytest.approx(one.losses, rel=2e-5, abs=0)


def test_a_run_on_tp_x_ep_resumes_exactly_from_its_shards(report):
    assert report["train"]["resumed"] == report["train"]["losses"][2:]
