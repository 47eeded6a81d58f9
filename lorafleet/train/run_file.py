"""The run file: what the launcher resolved and checked, written once for the workers it starts.

``lorafleet train`` checks everything before any process starts (``train.preflight``): the workload
with its ``--set`` overrides and the task ledger's changes, the plan with its policy overrides, the
cost model the plan is priced by. It then writes ``<out>/run.json`` (atomically, before every launch
of its workers) and starts each rank as ``python -m lorafleet.train.rank <out>/run.json``. A rank
reads that file and nothing else of the command line: it runs the plan and policy the launcher
checked, the workload it resolved, by the cost model it built (whose profile, when there is one, must
still have the content hash the launcher saw). The fleet itself is one value, :class:`FleetState` (the plan,
the tasks, each dataset task's token-length histogram as the launcher tokenized it, so that a rank resolves the
workload without tokenizing any data for its lengths, and the turns of the tasks whose share changed or that
left); rank 0 writes it again when a change of the running fleet settles, where a torchrun restart of the
workers finds it. What a rank finds out for itself is what changes between its starts: the newest intact
checkpoint to resume from (after a torchrun restart) and, while a change is in flight, which side of it that
checkpoint is on (``resume.in_flight``).

The file is typed (``lorafleet schema run``): a pydantic adapter over :class:`ResolvedRun`, strict,
unknown keys refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.assemble import PlannedRun
from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.errors import InputError
from lorafleet.rundir import RunDir
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.field_docs import documented
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import Prepared
from lorafleet.train.queue.pending import FleetState

RUN_KIND = "lorafleet.ResolvedRun"


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """One launch of a run's workers, as its launcher resolved it."""

    __pydantic_config__ = documented(extra="forbid")

    kind: str = RUN_KIND
    options: TrainOptions
    """The run's options; ``plan`` is the run's own ``plan.json``, ``resume`` whether this launch resumes."""
    workload_path: str
    """The workload file the run was given (what errors name)."""
    state: FleetState
    """The fleet the ranks build: the plan the launcher checked (its policy as overridden), the tasks with their
    lengths, the turns of the tasks whose share changed or that left. Rank 0 writes it again when a change of the
    fleet settles; while one is in flight, a rank builds the fleet its pending file says (``resume.in_flight``)."""
    cluster: ClusterSpec
    """The cluster the plan was checked against."""
    cost_model: dict[str, CostModelOrigin]
    """Where the launcher's cost model of each pool came from, by pool name (a profile: its absolute path
    and SHA-256)."""

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
        state = FleetState.of(prepared.run.plan, prepared.workload, prepared.turn_changes, prepared.departed)
        return cls(
            options=options,
            workload_path=prepared.workload.path,
            state=state,
            cluster=prepared.cluster,
            cost_model=origins,
        )

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
        """This rank's view of the run: the fleet as the launcher resolved it (or, while a change is in flight, as
        its pending file says the checkpoint resumed from has it: ``resume.in_flight``), the cost model rebuilt from
        its origin (its profile unchanged), and where to resume from now."""
        from lorafleet.assemble import origins_cost_model
        from lorafleet.train.resume import in_flight, restarted, resume_step

        # The launcher named the broken checkpoints it passed over; after an elastic restart, rank 0 does.
        start = resume_step(self.options, warn=restarted() and os.environ.get("RANK") == "0")
        state = in_flight(self.options, start) or self.state
        workload = state.resolved(self.workload_path)
        profiles = {pool: o.profile if o.kind == "profile" else None for pool, o in self.cost_model.items()}
        cost_model = origins_cost_model(workload, self.cluster, profiles, sync_replicas=len(state.plan.replicas))
        for pool, origin in cost_model.origins().items():
            assert origin is not None
            if origin.sha256 != self.cost_model[pool].sha256:
                raise InputError(
                    origin.profile, "", "changed since the launcher checked the run (its SHA-256); start the run again"
                )
        return Prepared(
            workload=workload,
            run=PlannedRun(plan=state.plan, cost_model=cost_model, overrides=()),
            cluster=self.cluster,
            world_size=state.plan.world_size,
            resume_step=start,
            turn_changes=state.turn_changes,
            departed=state.departed,
        )


def run_json_schema() -> dict[str, Any]:
    """The JSON Schema of a run file (``lorafleet schema run``)."""
    from lorafleet.specs.typed import adapter

    return adapter(ResolvedRun).json_schema(mode="serialization")
