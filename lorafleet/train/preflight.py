"""Everything checked before a process of a run starts, and the run directory made the run's.

    prepare(options)         the workload (data for every task), the plan (re-planned on a resume with other
                             GPUs), its cost model and policy, the checkpoint resumed from, every place the
                             run will write (the run directory, the queue) and the trackers it will log to:
                             every input error before any process is spawned or any file written (but a
                             re-plan's)
    claim(options, prepared) the run directory locked and made this run's (a used one refused unless
                             resuming or told to overwrite, its own queue cleared with it), the data checked
                             against the checkpoint resumed from, the run's plan written, a stale queue
                             token removed

What the launcher can check up front it checks in ``prepare`` (or, an HTTP port, binds before ``claim``),
so that nothing fails once the directory is claimed and a half-made run is never left behind. What a start
takes over from the run before it (the step it resumes from, the tasks it trains, the plan it resumes by,
the ledger's turns) ``prepare`` asks ``train.resume``.

No torch import here: the data and checkpoint helpers a resume's checks import (``runtime``) are torch-free,
and imported inside the functions that need them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.assemble import PlannedRun
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.train.options import ARGS, TrainOptions
from lorafleet.train.own_plan import own_plan, with_plan_path
from lorafleet.train.phases import counted
from lorafleet.train.resume import in_flight, ledger_turns, restarted, resume_step, resumed_plan, training_workload
from lorafleet.workload import Workload, resolve_workload_paths

if TYPE_CHECKING:
    from lorafleet.plans import DeploymentPlan
    from lorafleet.rundir import RunDir, RunLock
    from lorafleet.specs.workload import WorkloadSpec
    from lorafleet.train.queue.pending import FleetState
    from lorafleet.train.revisions import Revision


@dataclass(frozen=True)
class Prepared:
    """Everything checked before a process starts."""

    workload: Workload
    run: PlannedRun
    """The plan (replanned on a resume with other GPUs; its policy as overridden), its cost model,
    and what to report of it."""
    cluster: ClusterSpec
    """The cluster the plan was checked against (the GPUs the run has)."""
    world_size: int
    """Processes the plan needs: one per rank it names."""
    resume_step: int | None
    """The step the run resumes from (None: a fresh start)."""
    turn_changes: dict[str, tuple] = field(default_factory=dict)
    """Tasks whose share or deadline a queued update changed, with their history (the task ledger's)."""
    departed: tuple = ()
    """The turns of the tasks that left the run (the task ledger's: ``DataStreams``'s ``departed``)."""
    revisions: dict[str, list[Revision]] = field(default_factory=dict)
    """Task hyperparameters this resume changes (``--allow-changes``: ``train.revisions``), by task."""


def _target_gpus(cluster: ClusterSpec) -> int:
    """The GPUs the run has: the processes torchrun started, else the cluster's."""
    started = os.environ.get("WORLD_SIZE")
    return int(started) if started is not None else cluster.n_gpus


def _replan(workload: Workload, cluster: ClusterSpec, options: TrainOptions) -> tuple[PlannedRun, ClusterSpec]:
    """A resumed run on another number of GPUs: the plan for the GPUs it now has, by the old plan's cost
    model and under its dispatch policy as this run overrides it (``train.replan``), then checked like any
    plan."""
    from lorafleet.assemble import prepare_run
    from lorafleet.planner import plan_deployment
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.specs.dispatch import flag_error
    from lorafleet.train.replan import replan_run

    old = DeploymentPlan.load(options.plan)
    if len(cluster.pools) > 1:
        raise InputError(
            ARGS,
            "--resume",
            f"the run has {_target_gpus(cluster)} GPUs, its plan {old.n_gpus}; which pool changed is not known: "
            "plan again for the pools the run has (--set cluster.pools.NAME.nodes=N) and resume with that --plan",
        )
    try:
        target = ClusterSpec.with_gpus(_target_gpus(cluster), cluster.gpu, cluster.gpus_per_node)
    except ValueError as err:
        raise InputError(ARGS, "--gpus", str(err).splitlines()[-1]) from None
    try:
        policy = old.policy.with_overrides(dict(options.policy_overrides))
    except InputError as err:
        raise flag_error(err) from None
    path, _ = replan_run(workload, target, old, policy, options, partial(plan_deployment, workload, target))
    run = prepare_run(workload, target, str(path), options.profile, dict(options.policy_overrides))
    note = (
        f"re-planned for {target.n_gpus} GPUs: {run.plan.describe()} (the plan was {old.describe()} on "
        f"{old.n_gpus}); checkpoints do not depend on the plan"
    )
    if old.n_gpus == target.n_gpus:  # the ledger's tasks lost their plan in a crash amid a change (``_stale``)
        names = ", ".join(t.name for t in workload.tasks)
        note = (
            f"re-planned for the ledger's tasks {names}: {run.plan.describe()} (a queued change was left half-applied)"
        )
    return replace(run, overrides=(*run.overrides, note)), target


def _stale(plan: DeploymentPlan, workload: Workload, cluster: ClusterSpec, options: TrainOptions) -> bool:
    """Whether a resume re-plans: the run has another number of GPUs, or a crash amid a change of its tasks left
    the ledger's tasks without their plan (the pending changes are still there: ``train.live``)."""
    from lorafleet.train.queue import has_pending

    names = tuple(t.name for t in workload.tasks)
    return plan.n_gpus != _target_gpus(cluster) or (plan.tasks != names and has_pending(options.queue_dir))


def prepare(options: TrainOptions) -> Prepared:
    """Every input check of a run, before any process is spawned or any file written (but a re-plan's)."""
    from lorafleet.assemble import prepare_run, workload_cluster
    from lorafleet.plan_check import with_plan_base
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.io import check_writable

    check_writable(options.out, directory=True)
    check_writable(options.queue_dir, directory=True)  # the watcher moves requests; the server writes them
    for root in options.queue_data_roots:
        if not Path(root).is_dir():
            raise InputError(ARGS, "--queue-data-root", f"{root}: not a directory")
    if os.environ.get("RANK", "0") == "0":  # the trackers log from rank 0 only
        check_trackers(options.loggers)
    options, plans_itself = with_plan_path(options)  # --plan, or the run's own (train.own_plan)
    start = resume_step(options)
    flight = in_flight(options, start) if start is not None else None
    if flight is not None:  # the fleet on the side of the change in flight the checkpoint is on (resume.in_flight)
        workload, revisions = flight.resolved(options.workload), {}
        chosen_by = str(options.run_dir.plan) if workload.spec.quantize_candidates is not None else None
        workload = with_plan_base(flight.plan, workload, str(options.run_dir.plan))  # quantize: auto: the plan's
        check_quantize(options, start, workload, chosen_by)
        cluster = workload_cluster(workload, options.gpus, options.gpu)
        check_in_flight_gpus(flight, cluster, options)
        plan_path = str(options.run_dir.plan)
        overrides = dict(options.policy_overrides)
        run = prepare_run(workload, cluster, plan_path, options.profile, overrides, plan=flight.plan)
        changes, departed = flight.turn_changes, flight.departed
    else:
        workload, revisions = training_workload(
            options.workload, options.out if start is not None else None, options.sets, start, options.allow_changes
        )
        if start is not None:
            options = replace(options, plan=resumed_plan(options, workload))
        chosen_by = None
        if not plans_itself:  # quantize: auto or a list: the plan's base (a resume's: the run's, kept on a re-plan)
            chosen_by = options.plan if workload.spec.quantize_candidates is not None else None
            workload = with_plan_base(DeploymentPlan.load(options.plan), workload, options.plan)
        check_quantize(options, start, workload, chosen_by)
        cluster = workload_cluster(workload, options.gpus, options.gpu)
        if start is not None and _stale(DeploymentPlan.load(options.plan), workload, cluster, options):
            run, cluster = _replan(workload, cluster, options)
        elif plans_itself:
            made = own_plan(workload, cluster, options)
            workload = with_plan_base(made, workload, options.plan)
            run = prepare_run(workload, cluster, options.plan, options.profile, dict(options.policy_overrides), made)
        else:
            run = prepare_run(workload, cluster, options.plan, options.profile, dict(options.policy_overrides))
        changes, departed = ledger_turns(options, start)
    world = run.plan.world_size
    started = os.environ.get("WORLD_SIZE")
    if started is not None and int(started) != world:
        raise InputError(
            options.plan,
            "replicas",
            f"the plan needs {world} processes (one per GPU it names); torchrun started {started}",
        )
    check_nodes(run.plan, options.plan)
    check_cpu_device(run.plan, options.device, options.plan)
    for r, _ in options.slowdown:
        if not 0 <= r < len(run.plan.replicas):
            raise InputError(
                ARGS,
                "--inject-slowdown",
                f"replica {r} does not exist: the plan has replicas 0..{len(run.plan.replicas) - 1}",
            )
    check_model(workload, options.workload)  # after the plan's checks: a plan for GPUs may be refused on its own
    from lorafleet.data.describe import check_task_data

    unused = check_task_data(workload.spec.tasks)  # every row read: bad data is one line here, not on a rank (#42)
    if os.environ.get("RANK", "0") == "0":
        for line in unused:  # never a split dropped without a word
            print(f"lorafleet train: {line}", flush=True)
    return Prepared(
        workload=workload,
        run=run,
        cluster=cluster,
        world_size=world,
        resume_step=start,
        turn_changes=changes,
        departed=departed,
        revisions=revisions,
    )


def check_in_flight_gpus(flight: FleetState, cluster: ClusterSpec, options: TrainOptions) -> None:
    """InputError when a resume with a change of the fleet in flight has other GPUs than its plan: the change is
    finished on the GPUs it was decided for, then the GPUs may change."""
    if flight.plan.n_gpus != _target_gpus(cluster):
        raise InputError(
            ARGS,
            "--gpus",
            f"a change of the running fleet is in flight ({options.run_dir.pending}), decided for "
            f"{flight.plan.n_gpus} GPUs: resume on those to finish it, then resume on {_target_gpus(cluster)}",
        )


def check_model(workload: Workload, path: str) -> None:
    """The weights the workers will load are there and whole: a preset without weights, a missing path, or a
    truncated or corrupt safetensors file is one line here, not an error in every worker."""
    from lorafleet.data.model_source import SourceKind, resolve_model_source
    from lorafleet.data.weights_index import check_weights

    source = resolve_model_source(workload.spec.model, source=path, field="model")
    if source.kind is SourceKind.HF_DIR:
        check_weights(Path(source.path))


def check_quantize(options: TrainOptions, start: int | None, workload: Workload, chosen_by: str | None = None) -> None:
    """The workload's ``quantize`` (``runtime.base_quantization``), before the plan is judged by it: InputError over
    a family with fused projections (Phi-3) or weights already quantized (a GGUF file), for its one base or any
    quantized one of its candidates (``quantize: auto`` or a list, before ``train`` plans for itself), or, on a
    resume from the checkpoint of step ``start``, when that checkpoint was trained over another base than the one
    the workload now trains over (nothing to compare before the first checkpoint commits; ``chosen_by``: the plan
    whose base a workload that lets the planner choose took, then the plan is named as the fix)."""
    from lorafleet.runtime.base_quantization import (
        check_base_choice,
        check_quantizable,
        check_resumed_quantize,
        check_unfused,
    )
    from lorafleet.runtime.checkpoint_files import read_manifest, step_dir_name

    if workload.spec.quantize_candidates is not None:
        model = workload.spec.model
        check_base_choice(model, workload.model.model_type, workload.spec.quantize_candidates, options.workload)
        return  # a fresh run that plans for itself: a resume always has the run's plan, and its base
    if workload.spec.quantize is not None:
        from lorafleet.data.model_source import resolve_model_source

        check_unfused(workload.model.model_type, workload.spec.quantize, options.workload)
        source = resolve_model_source(workload.spec.model, source=options.workload, field="model")
        check_quantizable(source, workload.spec.quantize, options.workload)
    step_dir = options.run_dir.checkpoints / step_dir_name(start) if start is not None else None
    if step_dir is not None and step_dir.is_dir():
        check_resumed_quantize(step_dir, read_manifest(step_dir), workload.spec.quantize, options.workload, chosen_by)


def check_trackers(loggers: tuple[str, ...]) -> None:
    """An InputError, before any process starts, when a ``--logger`` would fail as rank 0 starts it
    (``TrackerWriter.start_problem``: W&B online without an API key, an MLflow server that does not answer)."""
    from lorafleet.metrics import LOGGERS

    for name in loggers:
        problem = LOGGERS[name].start_problem(os.environ)
        if problem is not None:
            raise InputError(ARGS, "--logger", f"{name}: {problem}")


def queue_data_roots(options: TrainOptions, workload: Workload) -> tuple[str, ...]:
    """The folders a queued task's data must resolve inside: ``--queue-data-root``, else the folders that hold
    the workload's data (``train.queue.data_roots``), symlinks resolved."""
    from lorafleet.train.queue import data_roots

    if options.queue_data_roots:
        return tuple(os.path.realpath(root) for root in options.queue_data_roots)
    return data_roots(workload.spec.tasks)


def check_cpu_device(plan: DeploymentPlan, device: str, path: str) -> None:
    """``--device cpu`` runs every rank on a CPU, whose GPU kind is ``cpu``: a plan with a pool of another
    kind is refused before any process starts (on GPUs each rank checks its own device,
    ``executor.torch.launch.check_device_kinds``)."""
    if device != "cpu":
        return
    for k, pool in enumerate(plan.pools):
        if pool.gpu.lower() != "cpu":
            where = f"pool {pool.name!r}" if pool.name else "the cluster"
            raise InputError(
                path,
                f"pools[{k}].gpu",
                f"--device cpu runs every rank on a CPU, but the plan puts ranks in {where} of {pool.gpu} "
                "GPUs: plan for the devices the job runs on (--gpu cpu)",
            )


def check_nodes(plan: DeploymentPlan, path: str) -> None:
    """Under a multi-node torchrun (more ranks than one node's: ``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``), the
    node of this rank must be one of its pool's nodes as the plan numbers them: ``gpus_per_node`` ranks of the
    pool (torchrun gives a node the ranks after those of the nodes before it), since the plan put each TP
    group inside a node of its pool. One node (``--standalone``, or all ranks local) runs any plan.
    InputError otherwise, before any group forms."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is None or local is None or int(world) == int(local):
        return
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    k, pool = plan.pool_at(min(rank, plan.n_gpus - 1))  # a rank the plan has not: the world-size check's
    first, per_node = plan.first_gpu(pool.name), pool.gpus_per_node
    field = "gpus_per_node" if len(plan.pools) == 1 else f"pools[{k}].gpus_per_node"
    of = "" if len(plan.pools) == 1 else f" of pool {pool.name!r}"
    if int(local) != per_node:
        nodes = (
            -(-int(world) // per_node)
            if len(plan.pools) == 1
            else sum(-(-p.n_gpus // p.gpus_per_node) for p in plan.pools)
        )
        raise InputError(
            path,
            field,
            f"the plan puts {per_node} GPUs on a node{of}; torchrun started {local} processes a node "
            f"(--nproc-per-node {local}, {int(world) // int(local)} nodes): launch with --nproc-per-node "
            f"{per_node} --nnodes {nodes}, or re-plan for {local} GPUs a node",
        )
    if (rank - local_rank - first) % per_node:
        raise InputError(
            path,
            field,
            f"this node's ranks start at {rank - local_rank}, not at a node of pool {pool.name!r} "
            f"(its GPUs {first}..{first + pool.n_gpus - 1}, {per_node} a node): start the pools' nodes in "
            "the plan's pool order",
        )


def claim(options: TrainOptions, prepared: Prepared) -> RunLock:
    """Lock the run directory and make it this run's: refuse a used one unless resuming or told to
    overwrite (which clears the run's own queue too, and refuses requests waiting in a ``--queue`` elsewhere);
    check the data against the checkpoint resumed from; write the run's plan and its resolved workload
    (``workload.resolved.yaml``: :func:`save_resolved_workload`)."""
    from lorafleet.train.queue import clear_pending, clear_pending_replan, remove_stale_token

    run_dir = options.run_dir
    lock = run_dir.lock()
    try:
        used = run_dir.used()
        if prepared.resume_step is None and used and not restarted():
            if not options.overwrite:
                raise InputError(
                    options.out,
                    "",
                    f"holds a previous run ({', '.join(used)}); pass --resume to "
                    "continue it or --overwrite to replace it",
                )
            refuse_foreign_requests(run_dir)
            run_dir.clear()
            clear_own_queue(run_dir)
        if prepared.resume_step is None:
            clear_pending(options.queue_dir)  # a previous run's accepted requests are not this run's
            clear_pending_replan(options.queue_dir)
        remove_stale_token(options.queue_dir)  # its server is gone: this run holds the directory's lock
        if prepared.resume_step:
            check_data(options, prepared)
        if not prepared.run.plan == _saved_plan(run_dir.plan):
            prepared.run.plan.save(run_dir.plan)
        if prepared.revisions:
            record_revisions(options, prepared)
        save_resolved_workload(prepared.workload.spec, run_dir.resolved_workload, header=revisions_header(options))
    except BaseException:
        lock.release()
        raise
    return lock


def refuse_foreign_requests(run_dir: RunDir) -> None:
    """``--overwrite`` with a ``--queue`` outside the run directory that holds requests: an InputError. They may
    be the previous run's, which the fresh run would apply at its step 0, and ``--overwrite`` removes only the
    run directory's files."""
    from lorafleet.train.queue.requests import request_files

    if run_dir.owns_queue:
        return
    waiting = request_files(run_dir.queue)
    if waiting:
        raise InputError(
            str(run_dir.queue),
            "",
            f"holds {len(waiting)} request(s) not yet applied ({', '.join(p.name for p in waiting[:3])}"
            f"{', ...' if len(waiting) > 3 else ''}), perhaps the previous run's, which this fresh run would "
            "apply at its step 0; --overwrite removes only the run directory's files: move them away, or "
            "give another --queue",
        )


def clear_own_queue(run_dir: RunDir) -> None:
    """``--overwrite``: remove the run directory's own queue (``<out>/queue``: requests not yet applied, the
    accepted and rejected ones, a token file), saying so in one line when it held anything."""
    import shutil

    from lorafleet.train.queue.requests import request_files

    queue = run_dir.queue
    if not run_dir.owns_queue or not queue.is_dir():
        return
    waiting = request_files(queue)
    held = any(queue.iterdir())
    shutil.rmtree(queue)
    if held:
        print(
            f"lorafleet train: --overwrite: removed the previous run's queue {queue} "
            f"({counted(len(waiting), 'request')} not yet applied)",
            flush=True,
        )


def record_revisions(options: TrainOptions, prepared: Prepared) -> None:
    """This resume's revisions (``--allow-changes``) into the task ledger, made from the run's tasks when the
    run has none yet; from then on a resume trains the ledger's tasks."""
    from lorafleet.train.queue import Ledger
    from lorafleet.train.revisions import trained_specs

    ledger = Ledger.load(options.out)
    if ledger is None:
        ledger = Ledger.of(trained_specs(Path(options.out), None) or prepared.workload.spec.tasks)
    ledger.revise(prepared.workload.spec.tasks, prepared.revisions).save(options.out)


def revisions_header(options: TrainOptions) -> str:
    """The comment block of every revision the run's ledger records (empty when none)."""
    from lorafleet.train.queue import Ledger
    from lorafleet.train.revisions import resolved_header

    ledger = Ledger.load(options.out)
    return resolved_header(ledger.revisions()) if ledger is not None else ""


def save_resolved_workload(spec: WorkloadSpec, path: Path, header: str = "") -> None:
    """The validated workload ``spec`` as YAML (``defaults:`` merged into every task, presets' values filled
    in, no unset field), every path it names absolute (``workload.resolve_workload_paths`` against the working
    directory); written whole (a temporary file renamed over the old one), after ``header`` (comments). On a
    resume that took queued changes, the tasks are the ledger's active ones."""
    import yaml

    from lorafleet.specs.io import write_text_atomic

    raw = resolve_workload_paths(spec, Path.cwd()).model_dump(mode="json", exclude_none=True)
    write_text_atomic(path, header + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))


def _saved_plan(path: Path) -> DeploymentPlan | None:
    from lorafleet.plans import DeploymentPlan

    try:
        return DeploymentPlan.load(path) if path.is_file() else None
    except InputError:
        return None


def check_data(options: TrainOptions, prepared: Prepared) -> None:
    """InputError when the workload's data is not the data the checkpoint was trained on."""
    from lorafleet.runtime.checkpoint_files import read_manifest, resumable_checkpoint, stopped_tasks
    from lorafleet.runtime.data_stream import training_streams

    found = resumable_checkpoint(options.run_dir.checkpoints)
    if found is None:
        return
    manifest = read_manifest(found.step_dir)
    saved = [t["name"] for t in manifest["tasks"]]
    missing = [t.name for t in prepared.workload.tasks if t.name not in saved and t.spec.start_step < found.step]
    if missing:
        names = [t.name for t in prepared.workload.tasks]
        raise InputError(str(found.step_dir), "tasks", f"the checkpoint has tasks {saved}, the workload {names}")
    streams = training_streams(
        prepared.workload.spec, options.steps, turn_changes=prepared.turn_changes, departed=prepared.departed
    )
    try:
        streams.check_state(manifest["data"], stopped_tasks(manifest.get("extra", {})))
    except ValueError as err:
        raise InputError(str(found.step_dir), "data", str(err)) from None
