"""``zoo verify``: prove with logits that zoo computes what transformers computes on a checkpoint."""

import json
import sys
import tempfile


def add_parser(sub):
    p = sub.add_parser("verify", help="compare zoo with the transformers reference on an HF checkpoint",
                       description="Run transformers' model and zoo's on the same inputs and report max |Δlogits|, "
                                   "mean KL, top-1 agreement and per-layer hidden-state deltas. Exits 1 on failure.")
    p.add_argument("path", nargs="?", metavar="PATH_OR_REPO", help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--tiny", metavar="MODEL_TYPE", help="make a tiny random checkpoint of each supported HF "
                   "model_type ('all') or of one (a model_type such as llama or gemma2, not a family or preset "
                   "name), with transformers itself, and verify it (offline)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fp8", choices=["dequantize", "keep"], default="dequantize",
                   help="an FP8 checkpoint's linear weights: dequantised on load (default) or kept in FP8")
    p.add_argument("--reference", metavar="FILE", help="verify against a stored reference (no transformers needed)")
    p.add_argument("--save-reference", metavar="FILE", help="store the inputs and reference outputs in FILE")
    p.add_argument("--revision", help="hub revision (branch, tag or commit)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--atol", type=float, help="pass bound on max |Δlogits| (default: 1e-3 in float32)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _tolerances(args):
    return {"max_abs": args.atol} if args.atol is not None else None


def run_tiny(args):
    from zoo.checkpoints.tiny import make_tiny, tiny_formats
    from zoo.tools.verification import verify

    known = tiny_formats()
    families = known if args.tiny == "all" else [args.tiny]
    if args.tiny != "all" and args.tiny not in known:
        raise ValueError(f"no tiny checkpoint for {args.tiny!r}; choose 'all' or one of: {', '.join(known)}")
    reports = []
    if not args.json:
        print(f"{'model_type':<12} {'params':>8} {'max |Δlogits|':>14} {'mean KL':>10} {'top-1':>6} "
              f"{'worst layer Δ':>14}  result", flush=True)
    for model_type in families:
        with tempfile.TemporaryDirectory() as tmp:
            make_tiny(model_type, tmp)
            r = verify(tmp, dtype=args.dtype, seq_len=args.seq_len, batch_size=args.batch_size,
                       tolerances=_tolerances(args), fp8=args.fp8)
        r.source = f"tiny {model_type}"
        reports.append(r)
        if not args.json:
            worst = max(r.hidden) if r.hidden else float("nan")
            print(f"{model_type:<12} {r.params:>8,} {r.max_abs:>14.2e} {r.mean_kl:>10.1e} {r.top1:>6.3f} "
                  f"{worst:>14.2e}  {'PASS' if r.passed else 'FAIL'}", flush=True)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        n = sum(r.passed for r in reports)
        print(f"{n}/{len(reports)} model_types match transformers {reports[0].reference.split()[-1]}"
              if reports else "nothing verified")
    return 0 if all(r.passed for r in reports) else 1


def run(args):
    try:  # transformers' progress bars would drown the table
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass  # a stored --reference needs no transformers
    if args.tiny:
        return run_tiny(args)
    if not args.path:
        print("zoo verify: give a checkpoint (PATH_OR_REPO) or --tiny all", file=sys.stderr)
        return 2
    from zoo.tools.verification import verify

    report = verify(args.path, dtype=args.dtype, reference=args.reference, save_reference=args.save_reference,
                    revision=args.revision, seq_len=args.seq_len, batch_size=args.batch_size,
                    tolerances=_tolerances(args), fp8=args.fp8)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 0 if report.passed else 1
