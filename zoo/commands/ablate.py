"""``zoo ablate FILE``: train every variant x learning rate x seed of an ablation file, then write
the summary table (markdown and JSON) and the plots.

One process: ``zoo ablate examples/ablations/qk-norm.toml``. Several (each run DDP):
``accelerate launch -m zoo.cli ablate FILE``. Runs already done (a ``result.json`` made with the
same settings) are skipped, so running again only finishes what is missing and redraws the report.
See docs/reports/ablations.md.
"""

import argparse


def add_parser(sub):
    p = sub.add_parser("ablate", help="run an ablation file (variants x learning rates x seeds) and plot the result",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="an ablation file (.toml), e.g. examples/ablations/qk-norm.toml")
    p.add_argument("--out-dir", default=None, help="where runs, tables and plots go (default: runs/ablations/NAME)")
    p.add_argument("--larger", action="store_true", help="apply the file's [larger] table (the documented larger setting)")
    p.add_argument("--log-with", nargs="+", default=[], metavar="TRACKER",
                   help="also log every run to these Accelerate trackers (tensorboard, wandb, mlflow, ...); "
                        "metrics.jsonl is always written")
    p.add_argument("--dry-run", action="store_true", help="check the file and list the runs; train nothing")
    return p


def run(args):
    from zoo.tools import ablate

    ablation = ablate.load(args.file, larger=args.larger)
    out_dir = args.out_dir or f"runs/ablations/{ablation.name}"
    if args.dry_run:
        specs = ablate.check(ablation)
        ablate.check_trackers(args.log_with)
        for variant, lr, seed, _, state, _ in ablate.plan(ablation, specs, out_dir):
            print(f"{variant:<24} lr={lr:<10g} seed={seed:<4} {state}")
        print(f"{len(ablation.runs())} runs of {len(specs)} variants; output in {out_dir}")
        return 0
    summary = ablate.sweep(ablation, out_dir, log_with=args.log_with)
    if not ablate.is_main_process():
        return 0
    for name, v in summary["variants"].items():
        best = "-" if v["best_lr"] is None else f"{v['best_lr']:g}"
        loss = "-" if v["best_loss"] is None else f"{v['best_loss']:.4f}"
        sens = "-" if v["lr_sensitivity"] is None else f"{v['lr_sensitivity']:.4f}"
        print(f"{name:<24} best lr {best:<8} final loss {loss:<8} LR sensitivity {sens:<8} "
              f"diverged {v['diverged_runs']}/{v['runs']}")
    return 0
