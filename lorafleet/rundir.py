"""A run directory belongs to one run: its lock, what makes it used, and clearing it for ``--overwrite``.

:class:`RunDir` names every path a run reads or writes: under ``--out`` (the plan, the run file, metrics,
checkpoints, adapters, the task ledger, ``changes.jsonl``, the trackers' run-id files, ``logs/``) and in its
queue directory (``.apply.json``, ``.replan.json``, ``.http.json``); the other modules take their paths from it.

DESIGN ("A run directory belongs to one run"): a run holds an exclusive lock on its ``--out``
for its whole life (``fcntl.flock`` on ``.lock``: the kernel drops it when the holder dies, so a
killed run never leaves a stale lock); a fresh run refuses a directory another run has used
unless told ``--resume`` or ``--overwrite``; a resumed run's metrics end at the step it resumes
from before it appends (nothing replayed is counted twice: ``lorafleet.metrics.truncate_metrics``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from lorafleet.errors import InputError

LOCK = ".lock"
STOP_REQUEST = ".stop-request"
"""The signal number a stop of the run was asked with (the launcher writes it, rank 0 reads it)."""
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
LEDGER = "tasks.json"
"""The task ledger of a run that took queued changes (``train.queue.ledger``)."""
CHANGES = "changes.jsonl"
"""The run's fleet changes, a row each (``train.change_log``)."""
RUN_LENGTH = "run_length.json"
"""Each task's steps in the run and the rows its adapter sees, written as the run starts (``train.run_length``)."""
EVALUATIONS = "evaluations.json"
"""The tasks' evaluations so far and their early-stopping state, rewritten after each (``train.evaluation``)."""
PENDING = ".apply.json"
"""In the queue directory: the requests accepted at a boundary, until they are applied (``train.queue.pending``)."""
PENDING_REPLAN = ".replan.json"
"""In the queue directory: the re-plan running beside the steps, until its boundary (``train.queue.pending``)."""
HTTP_TOKEN = ".http.json"
"""In the queue directory: the HTTP front-end's address and bearer token while it serves (``train.queue.http``)."""
TRACKER_IDS = {"wandb": ".wandb-run-id", "mlflow": ".mlflow-run-id"}
"""Per experiment tracker, the file its run's id is kept in, so that a resume continues that run
(``metrics.trackers``)."""


@dataclass(frozen=True)
class RunDir:
    """A run directory's layout: every path a run reads or writes under ``--out``, named here once.

    The files a run writes are :data:`RUN_FILES` (what ``--overwrite`` removes); the lock and the stop
    request are the run's own bookkeeping. ``queue`` is ``--queue`` when given (it may live elsewhere).
    """

    root: Path
    queue_dir: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def plan(self) -> Path:
        """The plan the run trains on (the checked one, its policy as overridden)."""
        return self.root / "plan.json"

    @property
    def run_file(self) -> Path:
        """What the launcher resolved for its workers (``train.run_file``)."""
        return self.root / "run.json"

    @property
    def resolved_workload(self) -> Path:
        """The validated workload, every path absolute: with ``plan.json``, what reproduces the run."""
        return self.root / "workload.resolved.yaml"

    @property
    def metrics_jsonl(self) -> Path:
        return self.root / METRICS_JSONL

    @property
    def metrics_csv(self) -> Path:
        return self.root / METRICS_CSV

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        """The committed checkpoints, one directory a step (``runtime.checkpoint_files``)."""
        return self.root / "checkpoints"

    @property
    def adapters(self) -> Path:
        """Every task's exported PEFT adapter, a directory a task."""
        return self.root / "adapters"

    @property
    def tokenizer(self) -> Path:
        """The run's tokenizer, which every exported adapter ships with."""
        return self.root / "tokenizer"

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER

    @property
    def evaluations(self) -> Path:
        """Each evaluated task's evaluations and early-stopping state, as of the last (``train.evaluation``)."""
        return self.root / EVALUATIONS

    @property
    def run_length(self) -> Path:
        """Each task's steps in the run: its own, those ``--steps`` leave it, its rows (``train.run_length``)."""
        return self.root / RUN_LENGTH

    @property
    def changes(self) -> Path:
        """A row per fleet change and per re-plan answer (``train.change_log``)."""
        return self.root / CHANGES

    @property
    def pending(self) -> Path:
        """A boundary's requests until they are applied (in the queue directory)."""
        return self.queue / PENDING

    @property
    def pending_replan(self) -> Path:
        """The re-plan running beside the steps (in the queue directory)."""
        return self.queue / PENDING_REPLAN

    @property
    def http_token(self) -> Path:
        """The queue's HTTP address and token while it serves (in the queue directory)."""
        return self.queue / HTTP_TOKEN

    def tracker_id(self, tracker: str) -> Path:
        """The file the run id of experiment tracker ``tracker`` (``wandb``, ``mlflow``) is kept in."""
        return self.root / TRACKER_IDS[tracker]

    @property
    def logs(self) -> Path:
        """Each worker's error, when it failed (``logs/rank-<r>.txt``: its traceback; ``train.failures``)."""
        return self.root / "logs"

    @property
    def input_error(self) -> Path:
        """A worker's refusal of bad input, for the launcher to raise (``train.failures``)."""
        return self.logs / "input-error.json"

    @property
    def failures(self) -> Path:
        """The failed workers torchrun reported last (``train.failures``)."""
        return self.logs / "failures.json"

    @property
    def queue(self) -> Path:
        """The live task queue's directory: ``--queue``, or ``<out>/queue``."""
        return self.queue_dir if self.queue_dir is not None else self.root / "queue"

    @property
    def owns_queue(self) -> bool:
        """Whether the queue is the run directory's own (``<out>/queue``, the default), which ``--overwrite``
        clears with the run's files; a ``--queue`` elsewhere is not."""
        return self.queue.resolve() == (self.root / "queue").resolve()

    def lock(self) -> RunLock:
        """Take the directory's lock for this run's life (:func:`lock_run`)."""
        return lock_run(self.root)

    def used(self) -> list[str]:
        """The run files already here (:func:`used_by`)."""
        return used_by(self.root)

    def clear(self) -> None:
        """Remove a previous run's files (:func:`clear_run`)."""
        clear_run(self.root)

    def request_stop(self, sig: int) -> None:
        """Ask rank 0 of the run here to stop at its next step boundary."""
        (self.root / STOP_REQUEST).write_text(f"{sig}\n")

    def stop_requested(self) -> int | None:
        """The signal a stop of the run was asked with, or None."""
        try:
            return int((self.root / STOP_REQUEST).read_text().strip() or signal.SIGTERM)
        except (OSError, ValueError):
            return None

    def clear_stop(self) -> None:
        (self.root / STOP_REQUEST).unlink(missing_ok=True)


RUN_FILES = (
    METRICS_JSONL,
    METRICS_CSV,
    "tensorboard",
    "checkpoints",
    "adapters",
    "plan.json",
    "run.json",
    "summary.json",
    LEDGER,
    CHANGES,
    EVALUATIONS,
    RUN_LENGTH,
    "workload.resolved.yaml",
    "tokenizer",
    "logs",
    "wandb",
    TRACKER_IDS["wandb"],
    "mlruns",
    TRACKER_IDS["mlflow"],
)
"""What a run writes under its directory (``--overwrite`` removes exactly these, and the run's own queue with its
files; :class:`RunDir` names every path)."""


@dataclass
class RunLock:
    """An exclusive lock on a run directory, held until :meth:`release` or the process's end."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def lock_run(out: str | Path) -> RunLock:
    """Take ``out``'s lock (creating the directory); an InputError naming it when another run holds it."""
    root = Path(out)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise InputError(str(out), "", f"cannot use as the run directory ({err.strerror or err})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise InputError(
            str(out), "", f"another run is using this directory{holder}; wait for it, or use another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunLock(root / LOCK, fd)


def _read_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except OSError:
        return ""
    return f" (process {pid})" if pid.isdigit() else ""


def used_by(out: str | Path) -> list[str]:
    """The run files already in ``out`` (empty: a fresh directory)."""
    root = Path(out)
    return [name for name in RUN_FILES if (root / name).exists()]


def clear_run(out: str | Path) -> None:
    """Remove a previous run's files from ``out`` (``--overwrite``); other files are left alone."""
    root = Path(out)
    for name in RUN_FILES:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
