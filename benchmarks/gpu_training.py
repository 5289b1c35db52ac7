"""Parallel training on one GPU node: throughput, peak memory against the plan, and parity with one process.

For each layout that the processes present allow (FSDP2, TP, FSDP2 x TP, FSDP2 x EP, and one process),
on models of real width and few layers (Llama-3-8B's blocks; Qwen3-30B-A3B's MoE blocks for EP):

- parity: the loss and every parameter's gradient of one batch in float32, against one process in float32
  and float64 on the same weights (``||got - fp64|| / ||fp32 - fp64||``, the multiple of the one-process
  float32 run's own error; the tests allow 4);
- tokens/s: the median step (forward and backward under bf16 autocast, AdamW) after warm-up steps, over
  every process's tokens;
- peak memory: ``torch.cuda.max_memory_allocated`` of rank 0 over those steps, beside what
  ``zoo describe --parallel`` plans for that process (``zoo.tools.memory.plan``).

    python benchmarks/gpu_training.py                         # torchrun over every GPU present (NCCL)
    python benchmarks/gpu_training.py --dry-run               # 2 CPU processes (gloo), tiny widths: checks it runs

Writes JSON (``--json``) and a markdown table (``--markdown``). Without a GPU only the dry run runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="2 CPU processes on gloo, tiny widths, 2 steps: checks that the script runs")
    p.add_argument("--processes", type=int, default=None, help="processes to launch (default: the GPUs present; 2 in a dry run)")
    p.add_argument("--layouts", default=None, help="comma-separated subset of: one,fsdp,tp,fsdp_tp,fsdp_ep")
    p.add_argument("--layers", type=int, default=2, help="layers of each model (default 2)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per process and step (default 1)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary (default 32768)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per layout, median reported (default 5; 2 in a dry run)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before (default 2)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the results as a markdown table")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set for the launched processes
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.dry_run else 5)
    if args.dry_run:
        args.seq, args.vocab = min(args.seq, 32), min(args.vocab, 256)
    return args


# name -> (preset, mesh sizes for W processes or None where W does not allow it)
LAYOUTS = {
    "one": ("llama3-8b", lambda W: {"dp_shard": 1}),
    "fsdp": ("llama3-8b", lambda W: {"dp_shard": W} if W > 1 else None),
    "tp": ("llama3-8b", lambda W: {"dp_shard": 1, "tp": W} if W in (2, 4, 8) else None),
    "fsdp_tp": ("llama3-8b", lambda W: {"dp_shard": W // 2, "tp": 2} if W >= 4 and W % 2 == 0 else None),
    "fsdp_ep": ("qwen3-30b-a3b", lambda W: {"dp_shard": 1, "ep": W} if W in (2, 4, 8) else None),
}


def spec_of(preset, args):
    """The preset at its real width (heads, d_ff, experts cut to 16 for one GPU node), ``args.layers`` layers;
    a dry run shrinks it to tiny widths."""
    from zoo.core.spec import ModelSpec
    from zoo.model.recipes import get_spec
    from zoo.testing import one_of_each

    if args.dry_run:
        data = one_of_each(preset, vocab_size=args.vocab).to_dict()
    else:
        data = get_spec(preset).to_dict()
        data["vocab_size"] = args.vocab
        for layer in data["layers"].values():
            if layer["ffn"]["name"] == "moe":
                layer["ffn"]["n_experts"] = 16
    kind = next(iter(data["layers"]))
    data.update(n_layers=args.layers, layer_pattern=[kind] * args.layers, max_seq_len=max(args.seq, 64), mtp=None)
    data.pop("label", None)
    return ModelSpec.from_dict(data)


def worker(args):
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    import zoo
    from zoo.tools.memory import plan
    from zoo.training.config import ParallelConfig
    from zoo.training.loop import start_model

    cuda = torch.cuda.is_available() and not args.dry_run
    acc = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    rows = []
    for name in names:
        preset, sizes = LAYOUTS[name][0], LAYOUTS[name][1](world)
        if sizes is None:
            rows.append({"layout": name, "skipped": f"not on {world} processes"})
            continue
        if name == "one":  # rank 0 alone; the others wait
            group_world, parallel = 1, None
        else:
            group_world, parallel = world, ParallelConfig(**sizes)
        spec = spec_of(preset, args)
        row = {"layout": name, "model": preset, "sizes": sizes, "layers": args.layers, "seq": args.seq}
        gen = torch.Generator().manual_seed(0)
        tp = sizes.get("tp", 1)
        dp = group_world // tp
        batch = torch.randint(0, args.vocab, (args.micro_batch * dp, args.seq), generator=gen)
        rows_of = batch.chunk(dp)[(rank // tp) % dp].to(acc.device) if group_world > 1 else batch.to(acc.device)
        if name == "one" and rank != 0:
            dist.barrier()
            continue

        def build(accelerator):
            if parallel is None:
                return zoo.build_model(spec, device=acc.device, seed=5)
            sharded = sizes.get("dp_shard", 1) > 1 or "ep" in sizes
            return start_model(spec, accelerator, seed=5, sharded=sharded, parallel=parallel)

        # parity: one batch in float32 (FSDP2 gathering float32, not the bf16 of training) against one
        # process (float32 and float64), on rank 0
        fp32 = types.SimpleNamespace(device=acc.device, num_processes=acc.num_processes, mixed_precision="no",
                                     state=acc.state)
        net = build(fp32)
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
        loss = net(rows_of, labels=rows_of).loss
        loss.backward()
        mean = loss.detach().clone()
        if group_world > 1:
            dist.all_reduce(mean)
        grads = {k.replace("_checkpoint_wrapped_module.", ""): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 for k, p in net.named_parameters()}
        del net
        if rank == 0:
            ref = {}
            for dtype in (torch.float32, torch.float64):
                m = zoo.build_model(spec, device=acc.device, seed=5).to(dtype)
                m.loss(batch.to(acc.device)).loss.backward()
                ref[dtype] = {k: p.grad for k, p in m.named_parameters()}
                del m
            worst = 0.0
            for k, r64 in ref[torch.float64].items():
                err = (grads[k].double() - r64).norm().item()
                noise = (ref[torch.float32][k].double() - r64).norm().item() + 2 ** -24 * r64.norm().item()
                worst = max(worst, err / noise if noise else 0.0)
            row["loss"] = mean.item() / group_world
            row["worst_gradient_error"] = worst  # in units of the one-process float32 run's own error
            del ref
        del grads
        # throughput and memory: bf16 autocast (CUDA), AdamW
        net = build(acc)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with acc.autocast():
                loss = net(rows_of, labels=rows_of).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        tokens = args.micro_batch * args.seq * dp
        row["tokens_per_s"] = tokens / statistics.median(times)
        row["step_s"] = statistics.median(times)
        if cuda:
            row["peak_bytes"] = torch.cuda.max_memory_allocated()
            layout = ",".join(f"{k}={v}" for k, v in sizes.items())
            row["planned_bytes"] = plan(spec, layout, seq_len=args.seq, micro_batch=args.micro_batch, dtype="bf16",
                                        device="cuda")["total"]
        del net, opt
        rows.append(row)
        if name == "one" and world > 1:
            dist.barrier()
    if rank == 0:
        device = torch.cuda.get_device_name() if cuda else "cpu (dry run, gloo)"
        result = {"device": device, "processes": world, "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(result))
        print(markdown(result))


def markdown(result) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB" if b is not None else "-"  # noqa: E731
    lines = [f"{result['device']}, {result['processes']} processes", "",
             "| layout | model | sizes | loss | worst gradient error (x fp32's own) | tokens/s | peak memory | planned | peak / planned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['layout']} | - | {r['skipped']} | | | | | | |")
            continue
        peak, planned = r.get("peak_bytes"), r.get("planned_bytes")
        ratio = f"{peak / planned:.2f}" if peak and planned else "-"
        sizes = ", ".join(f"{k} {v}" for k, v in r["sizes"].items())
        lines.append(f"| {r['layout']} | {r['model']} x{r['layers']} | {sizes} | {r.get('loss', float('nan')):.4f} | "
                     f"{r.get('worst_gradient_error', float('nan')):.2f} | {r['tokens_per_s']:.0f} | {gb(peak)} | {gb(planned)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(args):
    """Launch the workers (torchrun, one process per GPU; gloo CPU processes in a dry run) and return the
    JSON they wrote."""
    import tempfile

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_training.py needs CUDA devices (or --dry-run for the CPU check)")
    n = args.processes or (2 if args.dry_run else torch.cuda.device_count())
    out = args.json or os.path.join(tempfile.mkdtemp(), "gpu_training.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), __file__, "--worker",
           "--json", out, *[a for a in sys_args(args) if a]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        return json.load(f)


def sys_args(args):
    """The options to hand the workers (all but --json, given separately, and --processes)."""
    out = ["--dry-run" if args.dry_run else "", f"--layers={args.layers}", f"--seq={args.seq}",
           f"--micro-batch={args.micro_batch}", f"--vocab={args.vocab}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    if args.layouts:
        out.append(f"--layouts={args.layouts}")
    if args.markdown:
        out.append(f"--markdown={args.markdown}")
    return out


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        worker(ARGS)
    else:
        main(ARGS)
