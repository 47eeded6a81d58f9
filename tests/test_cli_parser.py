"""The parser a command runs with: its own module's subparser alone (``cli.build_parser``), parsing as the full one."""

from __future__ import annotations

import argparse

import pytest

from lorafleet.cli import build_parser


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(subparsers.choices)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "two-tenants.yaml", "--gpus", "16", "--json", "plan.json"],
        ["sweep-report", "runs/one"],
        ["schema", "workload"],
    ],
)
def test_a_command_registers_its_module_alone_and_parses_as_the_full_parser(argv):
    """``plan`` registers ``plan.py``'s subparser only (``sweep-report``: ``sweep_report.py``), and its arguments
    parse to the namespace the full parser gives (the same ``func``, defaults and values)."""
    full, lazy = build_parser(), build_parser(argv[0])
    assert _commands(lazy) == {argv[0]}
    assert {"plan", "validate", "train", "fit", "sweep-report"} <= _commands(full)
    assert vars(lazy.parse_args(argv)) == vars(full.parse_args(argv))


@pytest.mark.parametrize("word", ["fit", "no-such-command", None])
def test_a_word_that_names_no_module_gets_every_command(word):
    """``fit`` (registered by ``profile.py``), a typo or no word: the full parser, whose usage and errors list
    every command."""
    assert _commands(build_parser(word)) == _commands(build_parser())


def test_a_plans_start_imports_no_other_commands_or_planner_modes():
    """The modules a plain plan's start imports (in a fresh process: this one has imported everything): the plan
    command's parser, the planner's package and the plan check import no other command's module, nor the re-plan's,
    the fleet sizing's or the joint MINLP's (loaded on first use of their names, ``planner.__init__``, or with their
    mode)."""
    import subprocess
    import sys

    probe = (
        "import sys; from lorafleet.cli import build_parser; build_parser('plan'); "
        "import lorafleet.planner, lorafleet.plan_check; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('lorafleet.'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    assert "lorafleet.commands.plan" in loaded and "lorafleet.planner.driver" in loaded
    unwanted = {
        "lorafleet.commands.validate",
        "lorafleet.commands.train",
        "lorafleet.planner.incremental",
        "lorafleet.planner.decision",
        "lorafleet.planner.joint_minlp",
        "lorafleet.planner.sizing",
        "lorafleet.planner.sizing_bases",
    }
    assert not loaded & unwanted, loaded & unwanted


def test_the_planners_lazy_names_are_its_type_checking_imports_and_resolve():
    """``planner._LAZY`` (the names loaded on first use) and the package's ``TYPE_CHECKING`` imports name the same
    (name, module) pairs, and each name is its module's object."""
    import ast
    import importlib
    from pathlib import Path

    import lorafleet.planner as planner

    tree = ast.parse(Path(planner.__file__).read_text(encoding="utf-8"))
    (guarded,) = (n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {a.name: i.module.rpartition(".")[2] for i in guarded.body for a in i.names}
    assert imported == planner._LAZY
    for name, module in planner._LAZY.items():
        assert getattr(planner, name) is getattr(importlib.import_module(f"lorafleet.planner.{module}"), name)
