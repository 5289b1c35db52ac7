"""``zoo describe NAME``: a model's components and what it costs (parameters, FLOPs, KV cache,
training memory), computed on the meta device."""

import json

from zoo.commands.build import parse_sets


def add_parser(sub):
    p = sub.add_parser(
        "describe",
        help="a model's components table and cost figures (params, FLOPs, KV cache, memory)",
        description="Build NAME on the meta device (nothing is allocated) and print its components and figures: "
                    "parameters (embedding and non-embedding), FLOPs per token (forward 2N + attention, training), "
                    "KV-cache bytes per token and for --context x --batch in --dtype, aspect ratio, d_ff/d_model, "
                    "and the memory to train it with AdamW in mixed precision.",
    )
    p.add_argument("name", help="a preset name (see `zoo list`), an HF repo id of a preset, a recipe file, a GGUF file, "
                   "a checkpoint directory or its config.json, or a training run's directory")
    p.add_argument("--context", type=int, default=None, help="context length for KV cache and attention FLOPs (default: the model's max_seq_len)")
    p.add_argument("--batch", type=int, default=1, help="batch size for the KV cache (default 1)")
    p.add_argument("--dtype", default="bf16", help="storage dtype of weights and cache: bf16, fp16, fp32, fp8, int8, int4 (default bf16)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override a spec field, e.g. --set layers.*.mixer.n_kv_heads=64")
    p.add_argument("--backends", nargs="?", const="here", default=None, metavar="DEVICE",
                   help="also print which backend (Triton, FlexAttention or plain PyTorch) each component would run "
                        "and why, on DEVICE (cuda or cpu; default: this machine's), honouring ZOO_KERNELS")
    p.add_argument("--json", action="store_true", help="print JSON (components and figures)")
    m = p.add_argument_group("memory per device (zoo.tools.memory)")
    m.add_argument("--parallel", default=None, metavar="dp_shard=N,tp=N,ep=N[,dp_replicate=N]",
                   help="print what each process holds to train under this layout: its parameter shard, gradients, "
                        "AdamW states, the FSDP2 block in flight, activations and logits (--dtype is then the compute "
                        "dtype: bf16 mixed precision over float32 parameters, or fp32)")
    m.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's max_seq_len)")
    m.add_argument("--micro-batch", type=int, default=1, help="sequences per process per forward (default 1)")
    m.add_argument("--ac", default="none", help="activation checkpointing: none, block, or N (every N-th block)")
    m.add_argument("--processes", type=int, default=None, help="number of processes, for dp_shard=-1 (the rest)")
    m.add_argument("--rank", type=int, default=0, help="the process to report (shards of uneven size differ; default 0)")
    m.add_argument("--device-type", default="cuda", help="device the run uses, whose fast paths the parts count (default cuda)")
    return p


def human(n, unit="B"):
    """1234567 -> '1.23 MB' (decimal prefixes, as the lecture notes write them)."""
    for prefix in ("", "k", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or prefix == "E":
            return f"{n:.3g} {prefix}{unit}" if prefix else f"{n:g} {unit}"
        n /= 1000


def figure_rows(a):
    p, f, kv, m, s = a["params"], a["flops"], a["decode_state"], a["memory"], a["shape"]

    def per_kind(x, fmt):
        return ", ".join(f"{k}: {fmt(v)}" for k, v in x.items()) if isinstance(x, dict) else fmt(x)

    pub = f"  (published {p['published']:,})" if p["published"] else ""
    return [
        ("parameters", f"{p['total']:,}  ({human(p['total'], '')}){pub}"),
        ("  embedding", f"{p['embedding']:,}"),
        ("  non-embedding", f"{p['non_embedding']:,}"),
        *([("  + multi-token prediction", f"{p['mtp']:,}  (not counted elsewhere here)")] if p.get("mtp") else []),
        *([("  active per token", f"{p['active']:,}  (with embeddings and head)"),
           ("    without the input embedding", f"{p['active_conventions']['without_input_embedding']:,}"),
           ("    without embeddings and head", f"{p['active_conventions']['without_embeddings_and_head']:,}")]
          if p["active"] != p["total"] else []),
        ("aspect ratio d_model/n_layers", f"{s['aspect_ratio']:.1f}"),
        ("d_ff / d_model", per_kind(s["d_ff_over_d_model"], lambda v: f"{v:.3f}" if v else "-")),
        *([("attention", per_kind(s["attention"], str))] if "attention" in s else []),
        ("forward FLOPs/token (2N)", f"{human(f['forward_per_token_2n'], 'FLOP')}  (N = {f['active_matmul_params']:,} multiplied weights"
                                     f"{' active' if f['active_matmul_params'] != f['matmul_params'] else ''})"),
        (f"  + token mixing at context {f['context']:,}", human(f["mixing_per_token_at_context"], "FLOP")),
        ("  = forward at that context", human(f["forward_per_token_at_context"], "FLOP")),
        ("training FLOPs/token", f"{human(f['training_per_token'], 'FLOP')}  (6N = {human(f['training_per_token_6n'], 'FLOP')})"),
        (f"KV cache/token ({kv['dtype']})", f"{kv['bytes_per_token']:,} B  ({human(kv['bytes_per_token'])})"),
        *([("  MHA with the same heads", f"{kv['mha_bytes_per_token']:,} B  ({human(kv['mha_bytes_per_token'])}, "
                                         f"{kv['mha_bytes_per_token'] / kv['bytes_per_token']:.1f}x)")]
          if kv.get("mha_bytes_per_token") else []),
        (f"KV cache {kv['context']:,} x batch {kv['batch']}", human(kv["bytes"])),
        *([("  of which fixed (recurrent) state", human(kv["fixed_bytes"]))] if kv["fixed_bytes"] else []),
        (f"weights ({m['dtype']})", human(m["weights_bytes"])),
        ("AdamW mixed-precision training", f"{human(m['adamw_mixed_precision_bytes'])}  (16 B/param, activations not included)"),
    ]


def print_table(rows, title=None):
    width = max(len(k) for k, _ in rows)
    if title:
        print(title)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def run(args):
    from zoo.tools.accounting import account, components

    from zoo.model.recipes import build

    from zoo.checkpoints.sources import spec_of

    # a GGUF file, a checkpoint or training run directory, an HF config.json: its spec (no tensor is read)
    source = spec_of(args.name) or args.name
    model = build(source, device="meta", overrides=parse_sets(args.set))
    if args.parallel is not None:
        return run_memory(model, args)
    figures = account(model, context=args.context, batch=args.batch, dtype=args.dtype)
    figures["name"] = args.name
    parts = components(model)
    backends = backend_rows(model, args) if args.backends else None
    if args.json:
        print(json.dumps({"components": dict(parts), **figures, **({"backends": backends} if backends else {})}, indent=2))
        return 0
    print_table(parts, f"{args.name}: components")
    print()
    print_table(figure_rows(figures), f"{args.name}: figures")
    if backends:
        from zoo.core.kernels import format_table

        print(f"\n{args.name}: backends on {backends[0]['device']}, {backends[0]['dtype']}")
        print("  " + format_table(backends).replace("\n", "\n  "))
    return 0


def backend_rows(model, args):
    """``zoo.core.kernels.backend_table`` for the device asked for, in the compute dtype of --dtype."""
    import torch

    from zoo.core.kernels import backend_table

    device = args.backends if args.backends != "here" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(device)
    except RuntimeError:
        raise ValueError(f"--backends {device!r} is not a device; use cuda or cpu") from None
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(args.dtype, torch.bfloat16)
    rows = backend_table(model, device=device, dtype=dtype) + expert_rows(model, torch.device(device), dtype)
    for r in rows:
        r.update(device=device, dtype=str(dtype).removeprefix("torch."))
    return rows


def expert_rows(model, device, dtype):
    """One row per path the MoE layers' routed experts take on ``device``/``dtype`` (GroupedExperts.choose_path)."""
    from zoo.components.ffn.moe import GroupedExperts

    rows: dict[tuple, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            path, why = module.choose_path(device, dtype)
            row = rows.setdefault((type(module).__name__, path, why), {
                "component": "experts", "class": type(module).__name__, "modules": [], "backend": path,
                "fast": path == "grouped", "reason": why})
            row["modules"].append(name)
    return list(rows.values())


def run_memory(model, args):
    """``--parallel``: the memory of one process under the layout (zoo.tools.memory.plan)."""
    import dataclasses

    from zoo.tools.memory import parse_layout, plan

    layout = dataclasses.replace(parse_layout(args.parallel), ac=args.ac)
    seq_len = args.seq_len or model.spec.max_seq_len
    dtype = args.dtype if args.dtype in ("bf16", "fp16", "fp32") else "bf16"
    m = plan(model, layout, seq_len=seq_len, micro_batch=args.micro_batch, dtype=dtype, processes=args.processes,
             rank=args.rank, device=args.device_type)
    m["name"] = args.name
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    print_table(memory_rows(m), f"{args.name}: memory of process {m['rank']} of {m['processes']}")
    return 0


def memory_rows(m):
    """The rows ``zoo describe --parallel`` prints."""
    b, layout = m["bytes"], m["layout"]
    per_layer = m["activation_bytes_per_token"]
    flight = ", ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in m["in_flight_parts"].items() if v)
    rows = [
        ("layout", " x ".join(f"{k} {v}" for k, v in layout.items()) + f"  (mesh coordinates {m['coordinates']})"),
        ("micro-batch", f"{m['micro_batch']} x {m['seq_len']:,} tokens, compute {m['dtype']}, ac {m['ac']}, "
                        f"{'FSDP2' if m['fsdp'] else 'no FSDP2'}"),
        ("parameters (fp32 shard)", f"{human(b['parameters'])}  ({m['local_parameters']:,} parameters)"),
        ("gradients (fp32)", human(b["gradients"])),
        ("AdamW moments (fp32)", human(b["optimizer"])),
        ("in flight", f"{human(b['in_flight'])}" + (f"  ({flight})" if flight else "")),
        ("activations", f"{human(b['activations'])}  (kept {human(m['activations_kept'])}, one block recomputed "
                        f"{human(m['activations_recomputed'])})" if m["activations_recomputed"] else human(b["activations"])),
        ("  per token and layer", f"{human(max(per_layer, default=0))} (largest), "
                                  f"{human(sum(per_layer) / max(len(per_layer), 1))} (mean)"),
        ("logits and loss", human(b["logits"])),
        ("total", human(m["total"])),
    ]
    if m["not_reported"]:
        rows.append(("  not counted", "parts that do not report activations: " + ", ".join(m["not_reported"][:4])
                     + (f" and {len(m['not_reported']) - 4} more" if len(m["not_reported"]) > 4 else "")))
    return rows
