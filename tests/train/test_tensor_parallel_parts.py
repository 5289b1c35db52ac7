"""Tensor and sequence parallelism (``parallel.tp = 2``, torchrun on two CPU processes, gloo) for the parts
whose plans go beyond attention, MLA and the dense FFNs: DeepSeek Sparse Attention (DeepSeek-V3.2's, and
GLM-5's with a layer sharing the previous layer's selection), multi-token prediction (DeepSeek-V3's, two
depths), learned positions (GPT-3), sinusoidal positions (the 2017 Transformer) and ALiBi (the
zoo-alibi-dyt plugin). Each gives the one-process loss and EVERY gradient, and the initial weights of
one process, on a batch with a left-padded row; the indexer's top-k selection equals one process's.

Tolerances: in float32, those of tests/train/test_tensor_parallel.py (in units of the one-process float32
run's own error against float64 on the same weights and data); the same parallel run in float64 equals
the one-process float64 run to float64's rounding."""

import importlib.util

import pytest

from parallel_check import HELPERS, assert_loss_within, launch

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

SCRIPT = '''import copy, json, sys
import torch
import torch.distributed as dist
import zoo
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from zoo.components.mixers.dsa import LightningIndexer
from zoo.core.spec import ModelSpec
from zoo.testing import one_of_each
from zoo.training.checkpointer import full_state_dict
from zoo.training.config import ParallelConfig
from zoo.training.loop import start_model

acc = Accelerator(cpu=True)
out, models = sys.argv[1], json.loads(sys.argv[2])
rank = dist.get_rank()


def dense(name, mtp=None, second="dense"):
    """One layer of the preset's dense kind, then one of ``second`` (the MoE has no tensor-parallel plan)."""
    data = one_of_each(name, vocab_size=256).to_dict()
    data["layers"].pop("moe", None)
    kind = next(iter(data["layers"]))
    if second == "shared":  # GLM's IndexShare: the second layer reads the first one's selection
        data["layers"]["shared"] = copy.deepcopy(data["layers"][kind])
        data["layers"]["shared"]["mixer"]["indexer"] = "shared"
    data.update(n_layers=2, layer_pattern=[kind, second if second == "shared" else kind], mtp=mtp, dropout=0.0)
    return data


def alibi():
    data = dense("llama3-8b")
    data["position"] = {"name": "alibi"}
    return data


SPECS = {"deepseek-v3.2": lambda: dense("deepseek-v3.2-exp"), "glm-5": lambda: dense("glm-5", second="shared"),
         "deepseek-v3-mtp": lambda: dense("deepseek-v3", mtp={"depth": 2, "weight": 0.3}),
         "gpt3": lambda: dense("gpt3-125m"), "transformer-2017": lambda: dense("transformer-2017"), "alibi": alibi}
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, 256, (4, 16), generator=gen)
mask = torch.ones_like(ids)
mask[0, :3] = 0  # a left-padded row


''' + HELPERS + '''

def selections(model):
    """The (indices, allowed, scores) of every top-k the model's indexers take, as they are taken."""
    taken = []
    for m in model.modules():
        if isinstance(m, LightningIndexer):
            def top(scores, allowed, m=m, plain=m.top):
                idx, ok = plain(scores, allowed)
                taken.append((idx, ok, scores.detach()))
                return idx, ok
            m.top = top
    return taken


def mismatched(got, ref):
    """Selected keys of ``got`` not in ``ref`` (or the reverse) whose one-process scores are not tied with
    the one-process cut (the k-th best allowed score), over every query of every top-k taken."""
    bad = 0
    for (idx, ok, _), (ridx, rok, rscores) in zip(got, ref):
        cut = rscores.gather(-1, ridx).masked_fill(~rok, float("inf")).amin(-1, keepdim=True)
        a = torch.zeros_like(rscores, dtype=torch.bool).scatter_(-1, idx, ok)
        b = torch.zeros_like(rscores, dtype=torch.bool).scatter_(-1, ridx, rok)
        tied = (rscores - cut).abs() <= 1e-5 * cut.abs().clamp_min(1e-6)
        bad += int(((a ^ b) & ~tied).sum())
    return bad


def one_process(spec):
    res = {}
    for dtype in (torch.float32, torch.float64):
        m = zoo.build_model(spec, seed=5).to(dtype)
        taken = selections(m)
        loss = m.loss(ids, attention_mask=mask).loss
        loss.backward()
        res[dtype] = {"loss": loss.item(), "grads": {k: p.grad.clone() for k, p in m.named_parameters()},
                      "taken": taken}
    return res


def relative(got, ref):
    """Per tensor: ||got - ref|| / ||ref||, or over a millionth of the largest gradient's norm for a gradient
    that is zero in exact arithmetic (a key bias: softmax ignores what adds the same to every key)."""
    floor = 1e-6 * max(r.double().norm().item() for r in ref.values())
    return {k: (got[k].double() - r.double()).norm().item() / max(r.double().norm().item(), floor) for k, r in ref.items()}


report = {}
parallel = ParallelConfig(tp=2, dp_shard=1)
for name in models:
    spec = ModelSpec.from_dict(SPECS[name]())
    entry = report.setdefault(name, {})
    ref = one_process(spec) if rank == 0 else None
    for dtype in (torch.float32, torch.float64):
        net = start_model(spec, acc, seed=5, sharded=False, parallel=parallel).to(dtype)
        taken = selections(net)
        loss = net(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = {key(k): whole(p.grad) for k, p in net.named_parameters()}
        init = full_state_dict(net, sharded=True)  # no step was taken: still the initial weights
        if rank != 0:
            continue
        r32, r64 = ref[torch.float32], ref[torch.float64]
        mine = ref[dtype]
        entry.setdefault("loss", []).append(loss.item())
        entry.setdefault("topk", []).append({"taken": [len(taken), len(mine["taken"])],
                                             "mismatched": mismatched(taken, mine["taken"]),
                                             "equal": all(torch.equal(a[0], b[0]) for a, b in zip(taken, mine["taken"])),
                                             "sparse": all(t[0].shape[-1] < t[2].shape[-1] for t in taken)})
        entry.setdefault("missing_grads", []).extend(sorted(set(r64["grads"]) - set(grads)))
        if dtype == torch.float32:
            plain = zoo.build_model(spec, seed=5).state_dict()
            entry["init_keys"] = sorted(init) == sorted(plain)
            entry["init_differ"] = [k for k in plain if not torch.equal(init[k], plain[k])]
            entry["grads"] = compare(grads, r32["grads"], r64["grads"])
        else:
            entry["grads64"] = relative(grads, r64["grads"])
    if rank == 0:
        entry["loss"] += [r32["loss"], r64["loss"]]
if rank == 0:
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
'''

MODELS = ["deepseek-v3.2", "glm-5", "deepseek-v3-mtp", "gpt3", "transformer-2017"]
if importlib.util.find_spec("zoo_alibi_dyt") is not None:  # ALiBi lives in the plugin
    MODELS.append("alibi")
DSA = {"deepseek-v3.2": 2, "glm-5": 1}  # the top-k each forward takes: one per layer with its own indexer


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One launch of two processes for every model."""
    return launch(tmp_path_factory.mktemp("tp_parts"), "tp_parts", SCRIPT, MODELS, processes=2)["parts"]


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_equal_one_process(report, name):
    entry = report[name]
    got32, got64, r32, r64 = entry["loss"]
    assert_loss_within(got32, r32, r64, entry["loss"])
    assert entry["missing_grads"] == [] and len(entry["grads"]) > 8, entry
    bad = {k: v for k, v in entry["grads"].items() if not v <= 4}
    assert not bad, f"{name}: gradients off by these multiples of float32's own error: {bad}"
    # In float64 the parallel run is the one-process run to float64's rounding (measured: 3e-14 at most).
    assert abs(got64 - r64) <= 1e-12 * abs(r64), entry["loss"]
    bad = {k: v for k, v in entry["grads64"].items() if not v <= 1e-10}
    assert not bad, f"{name}: float64 gradients off by these relative errors: {bad}"


@pytest.mark.parametrize("name", MODELS)
def test_the_initial_weights_are_bit_equal_to_one_process(report, name):
    entry = report[name]
    assert entry["init_keys"] and entry["init_differ"] == [], entry


@pytest.mark.parametrize("name", list(DSA))
def test_the_indexer_selects_the_keys_one_process_selects(report, name):
    """Every top-k taken (one per layer with its own indexer; GLM-5's second layer shares the first's) is
    sparse (fewer keys than the sequence) and picks one process's keys, ties at the cut aside."""
    for topk in report[name]["topk"]:  # float32, float64
        assert topk["taken"] == [DSA[name]] * 2 and topk["sparse"], topk
        assert topk["mismatched"] == 0, topk


def test_the_mtp_modules_parameters_are_among_those_compared(report):
    """The MTP modules' own parameters are among those compared (their projection, norms and block)."""
    names = report["deepseek-v3-mtp"]["grads"]
    assert any(k.startswith("mtp.layers.1.eh_proj") for k in names), sorted(names)
