"""The entry of ``lorafleet train``: :func:`launch` checks and claims the run, writes the run file its
workers read (``train.run_file``), then starts them under ``torchrun --standalone`` (one process a rank,
``python -m lorafleet.train.rank <out>/run.json``) and supervises them: torchrun in a session of its
own that dies with this process, SIGINT/SIGTERM turned into a stop request at the next step boundary
(a second one kills), the exit code saying which. Already under a user's own torchrun, :func:`launch` is
this process's rank (:func:`lorafleet.train.trainer.train_rank`), which checks the run itself.

No torch import here: the launcher reaches the torch executor only through its torchrun helpers
(``runtime.processes``, torch-free) and, under torchrun, the rank it becomes.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from dataclasses import replace
from types import FrameType

from lorafleet.errors import InputError
from lorafleet.rundir import RunDir
from lorafleet.train.failures import clear_worker_errors, input_error, port_taken
from lorafleet.train.options import TrainOptions
from lorafleet.train.phases import counted, idle_gpus, phase, start_clock
from lorafleet.train.preflight import Prepared, claim, prepare, queue_data_roots
from lorafleet.train.queue import launcher_pending
from lorafleet.train.run_length import reshaped_schedules, with_run_steps

RANK_MODULE = "lorafleet.train.rank"
"""What torchrun runs in every worker process (with the run file's path)."""
AGENT_MODULE = "lorafleet.train.agent"
"""torchrun's agent as the launcher runs it (failures reported as data: ``train.failures``)."""
WATCH_S = 0.5
"""How often the launcher looks for a worker's refusal of bad input while torchrun runs."""
PORT_RETRIES = 3
"""Launches of the workers after the first whose process group's port another process took
(``failures.port_taken``): each draws a new free port."""


def launch(options: TrainOptions) -> int:
    """``lorafleet train``: check, lock, then run under torchrun (re-executing this command) or, already
    under one, as this process's rank. SIGINT/SIGTERM stop the run at a step boundary: exit 130/143."""
    from lorafleet.runtime.processes import catch_stop_signals, die_with_torchrun, under_torchrun

    start_clock()
    rank = under_torchrun()  # the user's own torchrun: this process is a rank
    if rank:
        die_with_torchrun()  # first, before the reads of start-up, as rank.main does under the launcher
        catch_stop_signals()
    prepared = prepare(options)
    if rank:
        from lorafleet.runtime.processes import shared_store_warning
        from lorafleet.train.trainer import train_rank

        warning = shared_store_warning()
        if warning is not None and os.environ.get("RANK") == "0":
            print(f"lorafleet train: warning: {warning}", file=sys.stderr, flush=True)
        return train_rank(with_run_steps(options, prepared), prepared)
    options = replace(options, queue_data_roots=queue_data_roots(options, prepared.workload))
    server = None
    if options.queue_http is not None:  # bound before the claim: a port in use leaves nothing written
        from lorafleet.train.queue import bind_queue_server

        server = bind_queue_server(options.queue_http)
    try:
        options = with_run_steps(options, prepared)  # --steps, or until the tasks are done (train.run_length)
        reshaped = options.resume and reshaped_schedules(options.run_dir, options.steps, prepared.workload.spec.tasks)
        if reshaped:
            print(f"lorafleet train: {reshaped}", flush=True)
        lock = claim(options, prepared)
    except BaseException:
        if server is not None:
            server.close()
        raise
    plan = prepared.run.plan
    tasks = counted(len(prepared.workload.tasks), "task")
    idle = idle_gpus(plan.used_gpus, prepared.cluster.n_gpus)  # a plan made for fewer GPUs than --gpus
    phase(f"checked: {tasks}, {plan.describe()} on {counted(plan.used_gpus, 'GPU')}{idle}")
    try:
        for line in prepared.run.overrides:
            print(f"lorafleet train: {line}", flush=True)
        if server is not None:
            server.serve(options.queue_dir, options.run_dir.root)
            print(
                f"lorafleet train: queue: {server.url} (token in {server.token_file}); live page: "
                f"{server.url}/#token=<the token>",
                flush=True,
            )
        named = options.plan or str(options.run_dir.plan)  # no --plan: the run's own (train.own_plan)
        return _run(replace(options, plan=str(options.run_dir.plan)), prepared, named=named)
    finally:
        if server is not None:
            server.close()
        lock.release()


def _run(options: TrainOptions, prepared: Prepared, named: str) -> int:
    """Launch the workers; each time they stop for queued requests (``train.queue``), apply them
    (``train.live``) and launch again, resuming from the checkpoint they left. A resume first applies
    what a launcher that died before applying them left. ``named``: the plan as the command named it (the
    workers read the run's copy, ``options.plan``)."""
    from lorafleet.train.live import apply_pending

    apply = prepared.resume_step is not None
    while True:
        applied = apply_pending(options, prepared) if apply else None
        if applied is not None:
            if applied.prepared is None:
                print(f"lorafleet train: every task has left the run at step {applied.step}", flush=True)
                return 0
            prepared = applied.prepared
            options = replace(options, resume=True, overwrite=False)
        code = _supervise(options, prepared, named)
        if code != 0 or launcher_pending(options.queue_dir) is None:
            return code
        apply = True


def _supervise(options: TrainOptions, prepared: Prepared, named: str) -> int:
    """Run torchrun in a session of its own, dying with this process; turn the first SIGINT/SIGTERM into a
    stop request, a second into a kill; the exit code says which (128 + signal) or torchrun's. A worker's
    refusal of bad input is raised here (the run's one line and exit 2), the run directory rolled back when
    nothing was trained (the error then names the plan as the command did: the run's copy is gone). Workers
    whose process group's port another process took (``failures.port_taken``) are started again, up to
    :data:`PORT_RETRIES` times, when that launch could not have trained a step the next one would repeat."""
    from lorafleet.runtime.processes import agent_preexec, torchrun_argv, worker_env
    from lorafleet.train.run_file import ResolvedRun

    run_dir = options.run_dir
    run_dir.clear_stop()
    run_dir.input_error.unlink(missing_ok=True)
    path = ResolvedRun.of(options, prepared).save(run_dir)
    phase(f"starting {counted(prepared.world_size, 'worker process', 'worker processes')} (torchrun)")
    agent = (AGENT_MODULE, str(run_dir.root))
    argv = torchrun_argv(agent, prepared.world_size, RANK_MODULE, [str(path)], max_restarts=options.max_restarts)
    received: list[int] = []
    child: subprocess.Popen | None = None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) == 1:
            run_dir.request_stop(signum)
            print(
                f"lorafleet train: {signal.Signals(signum).name}: stopping at the next step boundary (again to abort)",
                file=sys.stderr,
                flush=True,
            )
        elif child is not None:
            os.killpg(child.pid, signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(PORT_RETRIES + 1):
            child = subprocess.Popen(
                argv,
                env=worker_env(locked=True),
                start_new_session=True,
                preexec_fn=functools.partial(agent_preexec, os.getpid()),
            )
            code = _wait(child, run_dir)
            if code == 0 or received or attempt == PORT_RETRIES or not _port_race(options):
                break
            print(
                "lorafleet train: another process took the port of the workers' process group before rank 0 "
                f"listened on it; starting the workers again ({attempt + 1} of {PORT_RETRIES})",
                flush=True,
            )
            clear_worker_errors(run_dir)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        run_dir.clear_stop()
    if received:
        return 128 + received[0]
    refused = input_error(run_dir)
    if refused is not None:
        if _roll_back(options) and refused.path == str(run_dir.plan):
            raise InputError(named, refused.field, refused.msg)
        raise refused
    if code != 0:
        from lorafleet.train.failures import failure_line

        print(failure_line(run_dir, code, child.pid), file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code
    return code


def _port_race(options: TrainOptions) -> bool:
    """Whether the launch that just failed lost its process group's port to another process, and starting it
    again repeats nothing: it resumes from a checkpoint, or it is a fresh run that has trained no step."""
    run_dir = options.run_dir
    if input_error(run_dir) is not None or not port_taken(run_dir):
        return False
    return options.resume or not (run_dir.metrics_jsonl.exists() or run_dir.checkpoints.exists())


def _wait(child: subprocess.Popen, run_dir: RunDir) -> int:
    """torchrun's exit code; once a worker has refused bad input (``train.failures``), torchrun and its workers
    killed first: torchrun would restart them into the same refusal, ``--max-restarts`` times."""
    while True:
        try:
            return child.wait(timeout=WATCH_S)
        except subprocess.TimeoutExpired:
            if run_dir.input_error.exists():
                os.killpg(child.pid, signal.SIGKILL)  # the workers die with torchrun (processes.die_with_torchrun)
                return child.wait()


def _roll_back(options: TrainOptions) -> bool:
    """Whether the run directory was cleared: a fresh run refused before it trained a step leaves the directory
    as it found it (the next run there is not "used"); a resumed one, or one that trained, keeps its files."""
    run_dir = options.run_dir
    if options.resume or run_dir.metrics_jsonl.exists() or run_dir.checkpoints.exists():
        return False
    run_dir.clear()
    return True
