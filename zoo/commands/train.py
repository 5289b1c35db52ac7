"""``zoo train NAME``: train a preset or recipe file (shrunk with ``--set``) on a text corpus.

One process: ``zoo train llama3-8b --set n_layers=2 --set d_model=64 --set vocab_size=256 ...``.
Several: ``accelerate launch [--config_file examples/accelerate/fsdp2-8gpu.yaml] -m zoo.cli train ...``
or ``torchrun --nproc_per_node N -m zoo.cli train ...``. Every :class:`~zoo.training.config.TrainConfig`
field is an option (``--global-batch 64``, ``--fsdp``, ``--data a.txt b.txt``), and so is every
:class:`~zoo.training.config.ParallelConfig` field (``--dp-replicate 2 --dp-shard 4 --ac block``);
``--config train.toml`` reads the fields (and ``[parallel]`` and ``[lora]`` tables) from a file.
LoRA: ``zoo train --init-from DIR --lora r=16,alpha=32,targets=q_proj,v_proj``.
Prepared data (``zoo data prepare``): ``--data DIR`` or a weighted mixture ``--data A@0.7 B@0.3``;
``--sft`` for chat data; ``--val fraction=0.05,every=50`` or ``--val path=VAL_DIR``.
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


def _add_fields(p, cls, prefix=""):
    """One option per field of the dataclass ``cls``; an option not given leaves the attribute unset."""
    import argparse

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(_option_type(hints[f.name])):
            continue  # a section of its own (parallel, lora)
        flag = "--" + f.name.replace("_", "-")
        tp = _option_type(hints[f.name])
        doc = f"{cls.__name__}.{f.name} (default: {f.default!r})"
        kw = dict(default=argparse.SUPPRESS, dest=prefix + f.name, help=doc)
        if tp is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(tp) is tuple:
            p.add_argument(flag, nargs="+", metavar="FILE", **kw)
        else:
            p.add_argument(flag, type=tp, metavar=f.name.upper(), **kw)


def add_parser(sub):
    from zoo.training.config import ParallelConfig, TrainConfig

    p = sub.add_parser("train", help="train a preset or recipe with Accelerate (one process, DDP or FSDP2)",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="preset name or recipe file (.toml/.json); may be omitted with --init-from")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a spec field, e.g. --set n_layers=2 --set layers.*.mixer.n_heads=4")
    p.add_argument("--config", metavar="FILE.toml",
                   help="a TOML file of TrainConfig fields with a [parallel] table; options given here override it")
    _add_fields(p, TrainConfig)
    _add_fields(p, ParallelConfig, prefix="parallel.")
    p.add_argument("--lora", nargs="?", const="", default=__import__("argparse").SUPPRESS, metavar="KEY=VALUE,...",
                   help="LoRA fine-tuning (with --init-from): only a low-rank adapter trains, written to "
                        "OUT_DIR/adapter as a PEFT adapter; settings r, alpha, dropout, targets, rslora, merge, "
                        "e.g. --lora r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj (none: the defaults, "
                        "every linear projection of the blocks)")
    p.add_argument("--val", default=__import__("argparse").SUPPRESS, metavar="KEY=VALUE,...",
                   help="validation during training: path=PREPARED_DIR or fraction=F (held out of the training "
                        "data), every=N steps (default 100), samples=N sequences (default 64)")
    return p


def _data_entry(text: str):
    """``PATH`` or ``PATH@WEIGHT`` (one source of a weighted mixture)."""
    path, at, weight = text.rpartition("@")
    if not at:
        return text
    try:
        return {"path": path, "weight": float(weight)}
    except ValueError:
        raise ValueError(f"--data {text!r}: the weight after @ must be a number (e.g. --data corpus@0.7)") from None


def _val_settings(text: str) -> dict:
    import typing

    from zoo.training.config import ValSettings

    hints = typing.get_type_hints(ValSettings)
    out = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, eq, value = item.partition("=")
        if not eq or key not in hints:
            raise ValueError(f"--val: {item!r} is not one of {', '.join(f'{k}=...' for k in hints)}")
        try:
            out[key] = value if key == "path" else (float(value) if key == "fraction" else int(value))
        except ValueError:
            raise ValueError(f"--val: {key}={value!r} is not a number") from None
    return out


def config_of(args):
    """The TrainConfig the parsed options describe: the defaults, then ``--config``'s file, then each option given."""
    from zoo.training.config import LoraSettings, TrainConfig

    given = {k: v for k, v in vars(args).items() if k not in ("model", "set", "config", "command", "_run")}
    base = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    parallel = {k.split(".", 1)[1]: given.pop(k) for k in list(given) if k.startswith("parallel.")}
    fields = {k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}}
    if "data" in fields:
        fields["data"] = tuple(_data_entry(d) for d in fields["data"])
    if "val" in fields:  # the file's [val] table, with the settings given here
        from zoo.training.config import ValSettings

        fields["val"] = dataclasses.replace(base.val or ValSettings(), **_val_settings(fields["val"]))
    if fields.get("resume") in ("none", "None", ""):
        fields["resume"] = None
    if "lora" in fields:  # the file's [lora] table, with the settings given here
        fields["lora"] = dataclasses.replace(base.lora or LoraSettings(), **LoraSettings.parse(fields["lora"]))
    return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **parallel), **fields)


def run(args):
    from zoo.training.loop import train

    result = train(args.model, config_of(args), overrides=parse_sets(args.set))
    if result.losses and result.main_process:
        print(f"step {result.step}: loss {result.losses[-1]:.4f}, z {result.z[-1]:.3g}, "
              f"{result.tokens_per_s:,.0f} tokens/s; checkpoint {result.checkpoint}"
              + (f"; adapter {result.adapter}" if result.adapter else ""))
    return 0
