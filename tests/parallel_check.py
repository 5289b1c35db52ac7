"""What the torchrun tests of the parallel layouts (tests/train/test_tensor_parallel.py,
test_tensor_parallel_recurrent.py, test_moe_tensor_parallel.py, test_tensor_parallel_parts.py,
test_expert_parallel.py) share: helpers their
scripts define (:data:`HELPERS`, and :data:`MOE_HELPERS` for a mixture of experts: Python source put into each
script, which defines ``batches``), the checks of their reports (:func:`assert_within`,
:func:`assert_loss_and_gradients_match`) and the launch of one script on several CPU processes (:func:`launch`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

HELPERS = '''
def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def key(name):
    return name.replace("_checkpoint_wrapped_module.", "")


def compare(got, ref32, ref64):
    """Per tensor: ||got - ref64|| / (||ref32 - ref64|| + 2^-24 ||ref64||): the parallel run's error in units
    of the one-process float32 run's own (fp32's half ulp of the norm where that one is exact)."""
    out = {}
    for k in ref64:
        r64 = ref64[k].double()
        err = (got[k].double() - r64).norm().item()
        noise = (ref32[k].double() - r64).norm().item() + 2 ** -24 * r64.norm().item()
        out[k] = err / noise if noise > 0 else (0.0 if err == 0 else float("inf"))
    return out


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


def compare_layouts(models, layouts, specs):
    """For each layout (a ParallelConfig's sizes and ``fsdp``) and each of its models (a name in ``specs``,
    a function giving the spec): the model started on that layout against one process on the same global
    batch: the loss and every gradient of the first batch, the initial weights, and under FSDP2 the weights
    after three AdamW steps (rank 0's report); ``error``, a part's refusal to shard, instead."""
    report = {}
    for lname, layout in layouts.items():
        sharded = layout.pop("fsdp")
        parallel = ParallelConfig(**layout)
        sizes = parallel.sizes(world)
        tp, dp = sizes["tp"], (sizes["dp_shard"] if sharded else 1)
        dp_rank = (rank // tp) % sizes["dp_shard"] if sharded else 0
        for name in models[lname]:
            spec = specs[name]()
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
    return report


def report_and_train(report, out, model, parallel, train):
    """Rank 0 writes ``report`` to ``out``; then ``zoo.train(model)`` on the layout ``parallel``: three
    optimizer steps, then resumed from its step-2 checkpoint (each process's shards) into another
    directory, step 3 again; rank 0 writes both runs' losses to ``out.train``."""
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    result = zoo.train(model, parallel=parallel, save_every=2, **train)
    train.update(out_dir=train["out_dir"] + "-resumed", resume=train["out_dir"] + "/checkpoints/step-0000002")
    resumed = zoo.train(model, parallel=parallel, **train)
    if dist.get_rank() == 0:
        with open(out + ".train", "w") as f:
            json.dump({"losses": result.losses, "resumed": resumed.losses}, f)
'''


MOE_HELPERS = '''
from zoo.components.ffn.moe import MoE


def routers(model):
    """Record each MoE router's top-k indices, in call order."""
    seen = []
    for m in model.modules():
        if isinstance(m, MoE):
            m.router.register_forward_hook(lambda mod, args, r: seen.append(r.indices.detach().clone()))
    return seen


def moes(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def terms(o):
    """The loss terms and metrics of a loss output, less the loss, ce and z."""
    return {k: v.detach() for k, v in o.terms().items() if k not in ("loss", "ce", "z")}


def one_process(spec, steps, chunks):
    """Loss, loss terms, gradients and router choices of the first batch (float32 and float64; the batch's
    ``chunks`` micro-batches averaged), the summed expert load after it, and the weights after ``steps``
    AdamW steps (with the aux-loss-free bias update)."""
    res = {}
    for dtype in (torch.float32, torch.float64):
        m = zoo.build_model(spec, seed=5).to(dtype)
        m.train()
        chosen = routers(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(steps):
            total, parts = 0.0, {}
            for rows in batches[s].chunk(chunks):
                o = m(rows, labels=rows)
                (o.loss / chunks).backward()
                total += o.loss.item() / chunks
                for k, v in terms(o).items():
                    parts[k] = parts.get(k, 0.0) + v / chunks
            if s == 0:
                res[dtype] = {"loss": total, "terms": parts, "grads": {k: p.grad.clone() for k, p in m.named_parameters()},
                              "chosen": list(chosen), "load": [x.load.clone() for x in moes(m)]}
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            for x in moes(m):
                x.after_optimizer_step(reduce=lambda t: t)
        res[dtype]["after"] = {k: v.clone() for k, v in m.state_dict().items()}
    return res


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t
'''

# A tiny MoE model's overrides, and zoo.train's settings on it: 3 steps of 4 micro-batches of 2 sequences of 32
MOE_SETS = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
            "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 32, "layers.*.ffn.n_experts": 4,
            "layers.*.ffn.top_k": 2}
MOE_TRAIN = dict(overrides=MOE_SETS, steps=3, seq_len=32, global_batch=8, micro_batch=2, lr=3e-3, warmup_steps=1,
                 seed=1, cpu=True, progress=False, plot=False, export=False)


def assert_within(errors: dict, bound: float, what: str) -> None:
    """Every tensor of ``errors`` (a report's ``compare``) within ``bound`` multiples of float32's own error."""
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"{what} off by these multiples of float32's own error: {bad}"


def assert_loss_within(got: float, r32: float, r64: float, what) -> None:
    """A parallel run's float32 loss against one process's float64 one: within 4 times the one-process
    float32 run's own error, plus 16 float32 ulps relative (the processes' means averaged where one
    process takes one mean, the vocabulary's log-partition summed in pieces)."""
    assert abs(got - r64) <= 4 * abs(r32 - r64) + 16 * 2 ** -24 * abs(r64), (what, got, r32, r64)


def assert_moe_loss_and_gradients_match(entry: dict, what: str) -> None:
    """A mixture-of-experts entry (``MOE_HELPERS``) against one process: the routers' top-k choices
    identical first (in float32 and float64), then the loss (:func:`assert_loss_within`) and every
    gradient, the experts' included, within 4 times the one-process float32 run's own error."""
    assert entry["same_choices_fp32"] and entry["same_choices_fp64"], "the routers chose other experts"
    assert_loss_within(*entry["loss"], what)
    grads = entry["grads"]
    assert any(".experts.w_" in k for k in grads) and len(grads) > 12, grads  # every parameter, experts included
    assert_within(grads, 4, f"{what}: gradients")


def assert_loss_and_gradients_match(entry: dict, what: str) -> None:
    """A :func:`compare_layouts` entry (``HELPERS``) against one process: the loss (:func:`assert_loss_within`),
    every gradient within 4 times the one-process float32 run's own error."""
    assert_loss_within(*entry["loss"], what)
    grads = entry["grads"]
    assert len(grads) > 8, grads  # every parameter was compared
    bad = {k: v for k, v in grads.items() if not v <= 4}
    assert not bad, f"{what}: gradients off by these multiples of float32's own error: {bad}"


def launch(tmp: Path, name: str, script: str, *args, processes: int = 4) -> dict:
    """Run ``script`` on ``processes`` processes (``torchrun --standalone``, one thread each) with the report
    path and ``args`` (JSON) as its arguments; returns the report (``parts``) and the ``.train`` report
    (``train``, None if it wrote none) it wrote, and ``tmp``."""
    path, out = tmp / f"{name}.py", tmp / "report.json"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), str(path),
           str(out), *(json.dumps(a) for a in args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = tmp / "report.json.train"
    return {"parts": json.loads(out.read_text()), "train": json.loads(train.read_text()) if train.exists() else None,
            "tmp": tmp}
