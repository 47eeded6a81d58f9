"""Imports flow one way (STYLE.md §7): a module may import only the layers listed for it.

Deviation from the sketch, on purpose: ``planner`` may import ``dispatch``, because robust
planning replays the real per-step dispatch on sampled batches; ``dispatch`` never imports
``planner``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lorafleet"

L0 = ("lorafleet.errors", "lorafleet.specs")
L1 = L0 + ("lorafleet.costmodel", "lorafleet.solvers", "lorafleet.data")
L2 = L1 + ("lorafleet.plans", "lorafleet.workload", "lorafleet.sampling")
ALLOWED = {
    "lorafleet.errors": ("lorafleet.errors",),
    "lorafleet.specs": L0,
    "lorafleet.costmodel": L0 + ("lorafleet.costmodel",),
    "lorafleet.solvers": L0 + ("lorafleet.solvers",),
    "lorafleet.data": L0 + ("lorafleet.data",),
    "lorafleet.plans": L1 + ("lorafleet.plans",),
    "lorafleet.workload": L1 + ("lorafleet.workload",),
    "lorafleet.sampling": L2,
    "lorafleet.dispatch": L2 + ("lorafleet.dispatch",),
    "lorafleet.planner": L2 + ("lorafleet.planner", "lorafleet.dispatch"),
    "lorafleet.metrics": L2 + ("lorafleet.metrics",),
    "lorafleet.executor.torch": L0 + ("lorafleet.plans", "lorafleet.data", "lorafleet.executor"),
    "lorafleet.executor": L2 + ("lorafleet.executor",),
}
NO_TORCH = (
    "lorafleet.specs",
    "lorafleet.costmodel",
    "lorafleet.planner",
    "lorafleet.dispatch",
    "lorafleet.plans",
    "lorafleet.solvers",
    "lorafleet.workload",
    "lorafleet.sampling",
    "lorafleet.errors",
)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__"), path


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _rule(module: str):
    matches = [prefix for prefix in ALLOWED if module == prefix or module.startswith(prefix + ".")]
    return ALLOWED[max(matches, key=len)] if matches else None


@pytest.mark.parametrize("module,path", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_follow_layers(module, path):
    allowed = _rule(module)
    imports = _imports(path)
    if allowed is not None:
        upward = [
            m
            for m in imports
            if m.startswith("lorafleet")
            and m != "lorafleet"
            and not any(m == a or m.startswith(a + ".") for a in allowed)
        ]
        assert not upward, f"{module} imports {upward} from a layer above it"
    if any(module == p or module.startswith(p + ".") for p in NO_TORCH):
        heavy = [m for m in imports if m.split(".")[0] in ("torch", "triton", "transformers", "peft")]
        assert not heavy, f"{module} must not import {heavy}"
