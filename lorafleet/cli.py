"""``lorafleet`` command line: subcommands are discovered from ``lorafleet.commands``.

Bad input raises :class:`lorafleet.errors.InputError` anywhere below; it is printed here as
one line on stderr and the process exits with code 2, with no traceback. So is a hard dependency that is
not installed, whether the parser's imports or a command's find it missing (``errors.missing_dependency``):
this module imports none itself.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from lorafleet import __version__, commands
from lorafleet.errors import EXIT_INPUT_ERROR, exit_code


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


GC_GEN0_THRESHOLD = 10_000
"""Allocations between two young-generation collections while a command runs (Python's default: 700).
The parser's imports and a plan make millions of short-lived objects (pydantic schemas, PuLP
expressions, micro-batches, step plans) that reference counting frees; at 700 the cyclic collector
ran ~260 times in a plan of lobra-70b on 64 GPUs for ~0.1 CPU s (2 % of the command) and freed
almost nothing; at 10,000, 12 times for 0.035 s (and the imports save 0.03 s more)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command, the cyclic garbage collector less often meanwhile (:data:`GC_GEN0_THRESHOLD`)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, *thresholds[1:])
    try:
        return exit_code(lambda: _run(argv))
    finally:
        gc.set_threshold(*thresholds)


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
