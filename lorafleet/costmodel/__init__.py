"""Cost model: parallel configs, per-layer and replica time, max tokens, and their sources.

The rest of lorafleet builds one with :func:`fleet_cost_model` (per pool of the cluster: from
its profile file, or analytic from its GPU datasheet when it has none; :func:`load_cost_model` for
one kind) and consumes the :class:`CostModel` it returns. This package never imports torch; the profiler that
measures profiles lives in ``lorafleet.profiling``.
"""

from lorafleet.costmodel.adapters import AdapterLoad, TaskAdapter
from lorafleet.costmodel.build import (
    analytic_cost_model,
    analytic_profile,
    fleet_cost_model,
    load_cost_model,
    profile_cost_model,
)
from lorafleet.costmodel.cost_model import CostModel, CostModelOrigin, Interconnect
from lorafleet.costmodel.parallel_config import ParallelConfig, config_problems, enumerate_configs
from lorafleet.costmodel.profile_format import Profile, read_profile, write_profile
from lorafleet.costmodel.time_model import LayerTimeCoeffs, MicroBatchShape

__all__ = [
    "AdapterLoad",
    "CostModel",
    "CostModelOrigin",
    "Interconnect",
    "LayerTimeCoeffs",
    "MicroBatchShape",
    "ParallelConfig",
    "Profile",
    "TaskAdapter",
    "analytic_cost_model",
    "analytic_profile",
    "config_problems",
    "enumerate_configs",
    "fleet_cost_model",
    "load_cost_model",
    "profile_cost_model",
    "read_profile",
    "write_profile",
]
