"""A run directory belongs to one run: its lock, what makes it used, and clearing it for ``--overwrite``.

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
from dataclasses import dataclass
from pathlib import Path

from lorafleet.errors import InputError

LOCK = ".lock"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
RUN_FILES = (
    METRICS_JSONL,
    METRICS_CSV,
    "tensorboard",
    "checkpoints",
    "adapters",
    "plan.json",
    "run.json",
    "summary.json",
    "tasks.json",
    "workload.resolved.yaml",
    "tokenizer",
    "wandb",
    ".wandb-run-id",
    "mlruns",
    ".mlflow-run-id",
)
"""What a run writes under its directory (``--overwrite`` removes exactly these)."""


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
