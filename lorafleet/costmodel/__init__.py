"""Cost model: parallel configs, per-layer and replica time, max tokens, and their sources.

The rest of lorafleet builds one with :func:`fleet_cost_model` (per pool of the cluster: from
its profile file, or analytic from its GPU datasheet when it has none; :func:`load_cost_model` for
one kind) and consumes the :class:`CostModel` it returns. This package never imports torch; the profiler that
measures profiles lives in ``lorafleet.profiling``.

    parallel_config.py   ⟨TP, PP⟩ configs of one replica, with or without recomputation, and their validity
    time_model.py        a micro-batch's time on one layer and one pipeline stage, and the affine terms around it
    attention_span.py    what a sliding window saves of a block's attention: the key positions its queries meet
    memory_model.py      max tokens M of a config: how large a micro-batch one replica holds
    microbatch_size.py   a CPU's micro-batch knee: tokens past it cost more, and M stops there
    adapters.py          the adapter load a replica carries (tasks, ranks, targets, optimizer)
    dora_cost.py         what DoRA adds to a LoRA block's time (the analytic model's DoRA terms)
    schedule.py          the pipeline schedule of a PP replica over a window of steps, its timeline and bubble
    cost_model.py        :class:`CostModel`, what every stage consumes: stage, replica and step times, max tokens
    analytic.py          time and memory from model dimensions and a GPU datasheet (calibrated on LobRA's profile)
    fit.py               coefficients fitted to measurements (non-negative, relative-error least squares)
    fitted.py            the fitted source: coefficients from a measured profile's records
    profile_format.py    versioned JSON profiles (``profiles/*.json``)
    build.py             builders: a CostModel from a profile, a datasheet or either; a fleet's, one per pool
    check.py             predicted against measured on a profile's held-out records (``lorafleet costmodel check``)
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
