"""The ``zoo`` command line. Each subcommand is a module in :mod:`zoo.commands` that defines
``add_parser(subparsers)`` (returning its parser) and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import zoo.commands
from zoo.core.registry import PluginError, RegistryError
from zoo.core.spec import SpecError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zoo-lm")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zoo",
        description="A plugin-based model zoo for decoder-only language models.",
    )
    parser.add_argument("--version", action="version", version=f"zoo {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(zoo.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"zoo.commands.{info.name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except (SpecError, RegistryError, PluginError, FileNotFoundError, ValueError) as exc:
        print(f"zoo {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
