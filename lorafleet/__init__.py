"""lorafleet: plan, simulate and train many LoRA adapters on a heterogeneous fleet.

The public API is imported lazily, so ``import lorafleet`` (and ``lorafleet --version``)
stays fast::

    from lorafleet import load_workload, plan_deployment, simulate_schedule, sweep
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "load_workload": "lorafleet.workload",
    "plan_deployment": "lorafleet.planner",
    "size_fleet": "lorafleet.planner",
    "dispatch_step": "lorafleet.dispatch",
    "simulate_schedule": "lorafleet.simulate",
    "sweep": "lorafleet.whatif",
    "load_cost_model": "lorafleet.costmodel",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'lorafleet' has no attribute {name!r}")
