"""``zoo lm-eval ARGS``: EleutherAI's lm-evaluation-harness with the ``zoo`` model registered."""

import sys


def add_parser(sub):
    # '+' as the prefix character: every --option after the command goes to lm_eval untouched.
    p = sub.add_parser(
        "lm-eval", add_help=False, prefix_chars="+",
        help="lm-evaluation-harness tasks on a zoo model: zoo lm-eval --model zoo --model_args pretrained=PATH --tasks T",
        description="Run lm_eval's command line (all of its arguments, `zoo lm-eval --help` for them) with the "
                    "`zoo` model registered; needs pip install 'zoo-lm[lmeval]'.")
    p.add_argument("args", nargs="*", help="lm_eval's arguments")
    return p


def run(args):
    try:
        from zoo.tools.harness import main
    except ImportError as exc:  # the lmeval extra is not installed
        print(f"zoo lm-eval: error: {exc}", file=sys.stderr)
        return 2

    return main(args.args)
