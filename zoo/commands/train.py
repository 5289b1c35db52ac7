"""``zoo train NAME``: train a preset or recipe file (shrunk with ``--set``) on a text corpus.

One process: ``zoo train llama3-8b --set n_layers=2 --set d_model=64 --set vocab_size=256 ...``.
Several: ``accelerate launch [--config_file examples/accelerate/fsdp2-8gpu.yaml] -m zoo.cli train ...``
or ``torchrun --nproc_per_node N -m zoo.cli train ...``. Every :class:`~zoo.train.config.TrainConfig`
field is an option (``--global-batch 64``, ``--fsdp``, ``--data a.txt b.txt``).
"""

import dataclasses
import typing

from zoo.commands.build import parse_sets


def _option_type(tp):
    """``Optional[X]`` -> X; other types as they are."""
    if typing.get_origin(tp) is tuple:
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return _option_type(args[0]) if args else tp


def add_parser(sub):
    from zoo.train.config import TrainConfig

    p = sub.add_parser("train", help="train a preset or recipe with Accelerate (one process, DDP or FSDP2)",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="preset name or recipe file (.toml/.json); may be omitted with --init-from")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a spec field, e.g. --set n_layers=2 --set layers.*.mixer.n_heads=4")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        tp = _option_type(hints[f.name])
        doc = f"TrainConfig.{f.name} (default: {f.default!r})"
        if tp is bool:
            p.add_argument(flag, action=__import__("argparse").BooleanOptionalAction, default=f.default, help=doc)
        elif typing.get_origin(tp) is tuple:
            p.add_argument(flag, nargs="+", default=f.default, metavar="FILE", help=doc)
        else:
            p.add_argument(flag, type=tp, default=f.default, help=doc)
    return p


def run(args):
    from zoo.train.config import TrainConfig
    from zoo.train.loop import train

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    fields["data"] = tuple(fields["data"])
    if fields["resume"] in ("none", "None", ""):
        fields["resume"] = None
    result = train(args.model, TrainConfig(**fields), overrides=parse_sets(args.set))
    if result.losses and result.main_process:
        print(f"step {result.step}: loss {result.losses[-1]:.4f}, z {result.z[-1]:.3g}, "
              f"{result.tokens_per_s:,.0f} tokens/s; checkpoint {result.checkpoint}")
    return 0
