"""The run file: what the launcher resolved and checked, written once for the workers it starts.

``lorafleet train`` checks everything before any process starts (``train.preflight``): the workload
with its ``--set`` overrides and the task ledger's changes, the plan with its policy overrides, the
cost model the plan is priced by. It then writes ``<out>/run.json`` (atomically, before every launch
of its workers) and starts each rank as ``python -m lorafleet.train.rank <out>/run.json``. A rank
reads that file and nothing else of the command line: it runs the plan and policy the launcher
checked, the workload it resolved, by the cost model it built (whose profile, when there is one, must
still have the content hash the launcher saw). What a rank finds out for itself is what changes
between its starts: the newest intact checkpoint to resume from (after a torchrun restart) and the
task ledger's turn changes. The file carries each dataset task's token-length histogram as the launcher
tokenized it (``lengths``), so a rank resolves the workload without tokenizing any data for its lengths (it
tokenizes each task once, for its data streams); rank 0 rewrites the file at every change of the running fleet
(its tasks, their lengths, the plan), where a torchrun restart of the workers finds them.

The file is typed (``lorafleet schema run``): a pydantic adapter over :class:`ResolvedRun`, strict,
unknown keys refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ConfigDict

from lorafleet.assemble import PlannedRun
from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan
from lorafleet.rundir import RunDir
from lorafleet.specs._base import Int
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import Prepared
from lorafleet.workload import Workload

RUN_KIND = "lorafleet.ResolvedRun"


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """One launch of a run's workers, as its launcher resolved it."""

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    kind: str = RUN_KIND
    options: TrainOptions
    """The run's options; ``plan`` is the run's own ``plan.json``, ``resume`` whether this launch resumes."""
    plan: DeploymentPlan
    """The plan the launcher checked, its dispatch policy as overridden: the one policy the ranks run."""
    workload_path: str
    """The workload file the run was given (what errors name)."""
    workload: dict[str, Any]
    """The validated workload spec as JSON: ``--set`` applied, the ledger's tasks, every path absolute."""
    cluster: ClusterSpec
    """The cluster the plan was checked against."""
    cost_model: dict[str, CostModelOrigin]
    """Where the launcher's cost model of each pool came from, by pool name (a profile: its absolute path
    and SHA-256)."""
    lengths: dict[str, tuple[tuple[Int, Int], ...]] = field(default_factory=dict)
    """``(token length, rows)`` pairs of each task whose lengths read a dataset (``workload.reads_dataset``), as
    the launcher tokenized it, by task: a rank resolves the workload without tokenizing any data for its lengths."""

    @classmethod
    def of(cls, options: TrainOptions, prepared: Prepared) -> ResolvedRun:
        """The run file of a launch of ``options`` (already pointing at the run's ``plan.json``)."""
        origins = {}
        for pool, origin in prepared.run.cost_model.origins().items():
            assert origin is not None, "a run's cost model is always built from origins (assemble.plan_cost_model)"
            if origin.kind == "profile":
                origin = CostModelOrigin(
                    kind=origin.kind, gpu=origin.gpu, profile=str(Path(origin.profile).absolute()), sha256=origin.sha256
                )
            origins[pool] = origin
        return cls(
            options=options,
            plan=prepared.run.plan,
            workload_path=prepared.workload.path,
            workload={},
            cluster=prepared.cluster,
            cost_model=origins,
        ).with_workload(prepared.workload)

    def with_workload(self, workload: Workload) -> ResolvedRun:
        """This run file for ``workload``'s tasks (a change of the running fleet's): its spec and the lengths
        of the tasks that read them from a dataset."""
        spec = workload.spec.model_dump(mode="json", exclude_none=True)
        lengths = {t.name: tuple(t.histogram.items()) for t in workload.tasks if t.histogram is not None}
        return replace(self, workload=spec, lengths=lengths)

    def save(self, run_dir: RunDir) -> Path:
        """Write the run directory's ``run.json`` whole or not at all."""
        import json

        from lorafleet.specs.io import write_text_atomic
        from lorafleet.specs.typed import adapter

        path = run_dir.run_file
        write_text_atomic(path, json.dumps(adapter(ResolvedRun).dump_python(self, mode="json"), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ResolvedRun:
        """The run file at ``path``; an InputError naming the field when it is not one."""
        from lorafleet.specs.io import read_json_object
        from lorafleet.specs.typed import validate_strict

        data = read_json_object(path)
        if data.get("kind") != RUN_KIND:
            raise InputError(str(path), "kind", f"not a lorafleet run file (expected {RUN_KIND!r})")
        return validate_strict(cls, data, str(path), "")

    def prepared(self) -> Prepared:
        """This rank's view of the run: the resolved workload and the checked plan as they are, the cost model
        rebuilt from its origin (its profile unchanged), and where to resume from now."""
        from lorafleet.assemble import origins_cost_model
        from lorafleet.specs.workload import WorkloadSpec
        from lorafleet.train.resume import ledger_turns, restarted, resume_step
        from lorafleet.workload import resolve_workload

        known = {name: dict(pairs) for name, pairs in self.lengths.items()}
        workload = resolve_workload(WorkloadSpec.model_validate(self.workload), self.workload_path, known)
        profiles = {pool: o.profile if o.kind == "profile" else None for pool, o in self.cost_model.items()}
        cost_model = origins_cost_model(workload, self.cluster, profiles, sync_replicas=len(self.plan.replicas))
        for pool, origin in cost_model.origins().items():
            assert origin is not None
            if origin.sha256 != self.cost_model[pool].sha256:
                raise InputError(
                    origin.profile, "", "changed since the launcher checked the run (its SHA-256); start the run again"
                )
        # The launcher named the broken checkpoints it passed over; after an elastic restart, rank 0 does.
        start = resume_step(self.options, warn=restarted() and os.environ.get("RANK") == "0")
        changes, departed = ledger_turns(self.options, start)
        return Prepared(
            workload=workload,
            run=PlannedRun(plan=self.plan, cost_model=cost_model, overrides=()),
            cluster=self.cluster,
            world_size=self.plan.world_size,
            resume_step=start,
            turn_changes=changes,
            departed=departed,
        )


def run_json_schema() -> dict[str, Any]:
    """The JSON Schema of a run file (``lorafleet schema run``)."""
    from lorafleet.specs.typed import adapter

    return adapter(ResolvedRun).json_schema(mode="serialization")
