"""What-if sweeps: the workload re-planned and re-simulated under each variation.

A variation changes one axis of the question "what would this cost?":

- ``gpus=16,32,64``: the GPU count (same GPUs per node);
- ``gpu=A100-40GB,H100-80GB``: the GPU kind (the analytic model of that datasheet);
- ``model=llama2-7b,llama2-13b``: the base model;
- ``tasks=none,+xsum,-billsum,+billsum+pubmedqa``: tasks added (a dataset preset, named
  after it) or removed (by name); ``none`` keeps the workload's tasks;
- ``R=4,8,16``: the dispatcher's bucket count;
- ``recompute=off,auto``: whether replicas may recompute activations (``on``: all must);
- ``quantize=none,nf4,int8``: the shared base in the run's dtype or stored quantized (QLoRA), priced analytically
  (memory and dequantization): what quantizing the base buys, plan beside plan;
- ``pools.h100.nodes=0,1,2``: a field of one pool of the cluster (any pool key but ``name``: ``nodes``,
  ``gpu``, ``gpus_per_node``, ``price_per_gpu_hour``, ``profile``); ``nodes=0`` leaves the pool out.

Several ``--vary`` options form their Cartesian product. Each point is planned with the
same planner and simulated with the same sampled batches as ``lorafleet simulate``; a workload that lets the planner
choose its base (``quantize: auto`` or a list) and does not vary ``quantize`` gets, at each point, the base
``plan`` and ``simulate`` choose (``planner.base_choice.choose_base``), in the rows' ``base`` column.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import yaml
from pydantic import ValidationError

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.errors import InputError
from lorafleet.executor.simulated import SimulationOptions
from lorafleet.planner import PlannerOptions, PlanResult
from lorafleet.planner.base_choice import base_name, plan_over_base, with_base
from lorafleet.simulate import simulate_schedule
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.dispatch import DispatchPolicy
from lorafleet.specs.length_presets import find_preset
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import resolve_model
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.specs.workload import describe_validation_error
from lorafleet.workload import Workload, resolve_workload

AXES = ("gpus", "gpu", "model", "tasks", "R", "recompute", "quantize", "window")
"""``window``: the pipeline window (steps a pipelined replica streams before it drains; 1 is 1F1B
flushed every step, LobRA's), for the plan and for its baselines."""


@dataclass(frozen=True)
class Variation:
    """One axis and its values, parsed from ``AXIS=V1,V2,...``."""

    axis: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Variation:
        axis, eq, values = text.partition("=")
        axis = axis.strip()
        if not eq or (axis not in AXES and not POOL_AXIS.fullmatch(axis)):
            raise InputError(
                "<args>",
                "--vary",
                f"expected AXIS=V1,V2 with AXIS one of {', '.join(AXES)} or pools.NAME.KEY, got {text!r}",
            )
        items = tuple(v.strip() for v in values.split(",") if v.strip())
        if not items:
            raise InputError("<args>", "--vary", f"{axis} needs at least one value")
        if axis in ("gpus", "R", "window") and not all(v.isdigit() and int(v) > 0 for v in items):
            raise InputError("<args>", "--vary", f"{axis} values must be positive integers, got {values!r}")
        if axis == "quantize" and not set(items) <= {"none", *(q.value for q in Quantization)}:
            raise InputError(
                "<args>",
                "--vary",
                f"quantize values are none, {', '.join(q.value for q in Quantization)}, got {values!r}",
            )
        if axis == "recompute" and not set(items) <= {p.value for p in RecomputePolicy}:
            raise InputError(
                "<args>",
                "--vary",
                f"recompute values are {', '.join(p.value for p in RecomputePolicy)}, got {values!r}",
            )
        return cls(axis, items)


def _edit_tasks(workload: Workload, edit: str) -> Workload:
    """``+preset`` adds a task from a dataset preset, ``-name`` removes one; ``none`` changes nothing."""
    if edit == "none":
        return workload
    if not re.fullmatch(r"([+-][^+-]+)+", edit):
        raise InputError("<args>", "--vary", f"tasks: cannot apply {edit!r} (write none, +preset or -name)")
    tasks = list(workload.spec.tasks)
    for sign, name in re.findall(r"([+-])([^+-]+)", edit):
        if sign == "-":
            if not any(t.name == name for t in tasks):
                raise InputError("<args>", "--vary", f"tasks: no task named {name!r} to remove")
            tasks = [t for t in tasks if t.name != name]
        else:
            if find_preset(name) is None:
                raise InputError("<args>", "--vary", f"tasks: unknown dataset preset {name!r}")
            template = tasks[0] if tasks else None
            new = {"name": name, "preset": name}
            if template is not None:
                new |= {"lora": template.lora, "optimizer": template.optimizer}
            tasks.append(type(workload.spec.tasks[0]).model_validate(new))
    if not tasks:
        raise InputError("<args>", "--vary", f"tasks: {edit!r} removes every task")
    return resolve_workload(workload.spec.model_copy(update={"tasks": tuple(tasks)}), workload.path)


POOL_AXIS = re.compile(r"pools\.([^.]+)\.(gpu|nodes|gpus_per_node|price_per_gpu_hour|profile)")
"""A pool's field as a sweep axis: ``pools.NAME.KEY``."""


def _edit_pool(workload: Workload, axis: str, value: str) -> Workload:
    """The workload with pool NAME's KEY set to ``value`` (YAML), validated as the file's would be; ``nodes=0``
    leaves the pool out of the cluster."""
    match = POOL_AXIS.fullmatch(axis)
    assert match is not None
    name, key = match.groups()
    cluster = workload.cluster
    if name not in cluster.pool_names:
        raise InputError(
            "<args>", "--vary", f"{axis}: the cluster has no pool {name!r} ({', '.join(cluster.pool_names)})"
        )
    parsed = yaml.safe_load(value)
    if key == "nodes" and parsed == 0:
        pools = [p for p in cluster.pools if p.name != name]
        if not pools:
            raise InputError("<args>", "--vary", f"{axis}=0 leaves the cluster no pool")
    else:
        pools = [p if p.name != name else {**p.model_dump(), key: parsed} for p in cluster.pools]
    try:
        spec = workload.spec.model_copy(update={"cluster": ClusterSpec.model_validate({"pools": pools})})
    except ValidationError as err:
        raise InputError(
            "<args>", "--vary", f"{axis}={value}: {describe_validation_error(err.errors()[0])[1]}"
        ) from None
    return resolve_workload(spec, workload.path)


def _point(workload: Workload, point: dict[str, str]) -> tuple[Workload, dict]:
    """The workload and the planner/cluster arguments of one sweep point."""
    for axis, value in point.items():
        if POOL_AXIS.fullmatch(axis):
            workload = _edit_pool(workload, axis, value)
    if "model" in point:
        resolve_model(point["model"], "<args>", "--vary")
        workload = resolve_workload(workload.spec.model_copy(update={"model": point["model"]}), workload.path)
    if "recompute" in point:
        workload = resolve_workload(
            workload.spec.model_copy(update={"recompute": RecomputePolicy(point["recompute"])}), workload.path
        )
    if "quantize" in point:
        quantize = None if point["quantize"] == "none" else Quantization(point["quantize"])
        workload = with_base(workload, quantize)  # also over a workload that lets the planner choose (auto)
    if "tasks" in point:
        workload = _edit_tasks(workload, point["tasks"])
    gpus = int(point["gpus"]) if "gpus" in point else None
    policy = {key: int(point[axis]) for axis, key in POLICY_AXES.items() if axis in point}
    return workload, {"gpus": gpus, "gpu": point.get("gpu"), "policy": policy}


POLICY_AXES = {"R": "n_buckets", "window": "pipeline_window"}
"""Sweep axes that vary the dispatch policy the plans are judged under -> the policy field (``specs.dispatch``)."""


def _planned(
    workload: Workload, cluster: ClusterSpec, profile: str | None, options: PlannerOptions
) -> tuple[PlanResult, Workload, dict[str, str]]:
    """A point's plan, its workload over the base planned and its rows' ``base`` column: over the workload's one base
    (no column), or, for ``quantize: auto`` or a list, the base ``plan`` and ``simulate`` choose for this fleet."""
    result, choice = plan_over_base(
        workload, cluster, lambda over: workload_cost_model(over, cluster, profile), options
    )
    if choice is None:
        return result, workload, {}
    return result, with_base(workload, choice.option.base), {"base": base_name(choice.option.base)}


def _describe_point(point: dict[str, str]) -> str:
    return " ".join(f"{axis}={value}" for axis, value in point.items())


def sweep(
    workload: Workload,
    variations: Sequence[Variation],
    steps: int = 8,
    profile: str | None = None,
    sim: SimulationOptions = SimulationOptions(),
    on_skip: Callable[[str], None] | None = None,
) -> list[dict[str, object]]:
    """One row per (sweep point, method): mean step time and GPU-seconds per step, simulated over ``steps``.

    Every point's workload and cluster are built before any is planned. A point whose GPU count
    does not fill whole nodes (10 GPUs in nodes of 8) is skipped: ``on_skip`` gets one line naming
    the point and why (without it, a :class:`UserWarning` says so). When every point would be
    skipped the sweep raises an InputError (``--vary``) instead, and reports no skip.
    """
    points, skipped = [], []
    for values in itertools.product(*(v.values for v in variations)):
        point = dict(zip((v.axis for v in variations), values, strict=True))
        varied, args = _point(workload, point)
        try:
            points.append((point, varied, args, workload_cluster(varied, args["gpus"], args["gpu"])))
        except InputError as err:
            if err.field != "--gpus":
                raise
            skipped.append(f"{_describe_point(point)}: {err.msg}")
    if not points:
        raise InputError("<args>", "--vary", f"no sweep point can be run ({'; '.join(skipped)})")
    for reason in skipped:
        if on_skip is not None:
            on_skip(f"skipped {reason}")
        else:
            warnings.warn(f"skipped {reason}", UserWarning, stacklevel=2)
    rows = []
    for point, varied, args, cluster in points:
        try:
            options = PlannerOptions(policy=DispatchPolicy().with_overrides(args["policy"]))
        except InputError as err:
            raise InputError("<args>", "--vary", f"{_describe_point(point)}: {err.field}: {err.msg}") from None
        result, varied, chosen = _planned(varied, cluster, profile, options)
        for schedule in (result.schedule, *result.baselines):
            run = simulate_schedule(varied, schedule, result.cost_model, steps, sim)
            rows.append(
                {
                    **{f"vary_{k}": v for k, v in point.items()},
                    "gpus_total": cluster.n_gpus,
                    "gpu_kind": " + ".join(cluster.kinds),
                    "model": varied.model.name,
                    "tasks": len(varied.tasks),
                    **chosen,
                    "method": schedule.name,
                    "plan": schedule.phases[0].plan.describe()
                    if len(schedule.phases) == 1
                    else f"{len(schedule.phases)} phases",
                    "step_s": float(run.makespan_s.mean()),
                    "gpu_s_per_step": float(run.gpu_seconds.mean()),
                }
            )
    return rows
