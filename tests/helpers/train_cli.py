"""``lorafleet train`` run as a user runs it, in a subprocess: the command, and watching the run's steps and
its worker processes from outside (the training tests of ``tests/train``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = [sys.executable, "-m", "lorafleet"]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _job_processes(marker: str) -> dict[int, str]:
    """Pid -> command line of every process whose command line names ``marker`` (the run directory: the
    launcher, torchrun and the workers), this test's excepted."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found[int(entry.name)] = cmdline
    return found


def _worker_pids(marker: str) -> list[int]:
    """The workers among :func:`_job_processes` (torchrun runs them ``python -u -m lorafleet...``)."""
    return [
        pid
        for pid, cmdline in _job_processes(marker).items()
        if "lorafleet.train.agent" not in cmdline and " -u -m lorafleet" in cmdline
    ]


def _wait_for_steps(out: Path, n: int, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _worker_rank(pid: int) -> int | None:
    """The torch.distributed rank of a worker process (its ``RANK``), or None when it is gone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    return int(env[b"RANK"]) if b"RANK" in env else None
