"""``lorafleet`` command line: subcommands are discovered from ``lorafleet.commands``.

Bad input raises :class:`lorafleet.errors.InputError` anywhere below; it is printed here as
one line on stderr and the process exits with code 2, with no traceback. So is a hard dependency that is
not installed, whether the parser's imports or a command's find it missing (``errors.missing_dependency``):
this module imports none itself.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from lorafleet import __version__, commands
from lorafleet.errors import EXIT_INPUT_ERROR, exit_code


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand module's ``register`` applied in name order (modules
    whose name starts with ``_`` are shared helpers, not commands)."""
    parser = argparse.ArgumentParser(
        prog="lorafleet",
        description="Plan, simulate and train many LoRA adapters on a heterogeneous fleet of replicas.",
    )
    parser.add_argument("--version", action="version", version=f"lorafleet {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"{commands.__name__}.{info.name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return exit_code(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_INPUT_ERROR
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
