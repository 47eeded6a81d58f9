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
from lorafleet.runtime.gc_policy import fewer_collections


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with every subcommand module's ``register`` applied in name order (modules whose name starts
    with ``_`` are shared helpers, not commands); or, where ``command`` (the word an argument list starts with)
    names a module (``sweep-report``: ``sweep_report.py``), that module's alone: a command imports and registers
    no other command's modules and flags (~0.03 CPU s of a plan's start). A word that names no module (``fit``,
    which ``profile.py`` registers; a typo) gets every one, so the usage and the error are the full parser's."""
    parser = argparse.ArgumentParser(
        prog="lorafleet",
        description="Plan, simulate and train many LoRA adapters on a heterogeneous fleet of replicas.",
    )
    parser.add_argument("--version", action="version", version=f"lorafleet {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = sorted(info.name for info in pkgutil.iter_modules(commands.__path__) if not info.name.startswith("_"))
    module = (command or "").replace("-", "_")
    for name in [module] if module in names else names:
        importlib.import_module(f"{commands.__name__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command, the cyclic garbage collector less often meanwhile (``runtime.gc_policy``)."""
    with fewer_collections():
        return exit_code(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(words[0] if words and not words[0].startswith("-") else None)
    args = parser.parse_args(words)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_INPUT_ERROR
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
