"""The environment a run's torchrun and workers start with (``executor.torch.processes.worker_env``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lorafleet
from lorafleet.executor.torch.processes import (
    FRESH_STORE_ENV,
    LOCKED_ENV,
    PACKAGE_ENV,
    shared_store_warning,
    worker_env,
)


def test_every_restart_gets_a_fresh_rendezvous_store_and_the_launchers_code(monkeypatch):
    """torchrun shares one TCPStore across its rendezvous rounds unless told not to; a restarted group then
    reads the dead group's peer addresses (issue #25: 7 of 9 restarts failed or hung)."""
    monkeypatch.delenv(LOCKED_ENV, raising=False)
    env = worker_env(locked=True)
    assert env[FRESH_STORE_ENV] == "1"
    assert env["PYTHONSAFEPATH"] == "1" and env[LOCKED_ENV] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(Path(lorafleet.__file__).resolve().parents[1])
    assert env[PACKAGE_ENV] == str(Path(lorafleet.__file__).resolve())
    assert LOCKED_ENV not in worker_env(locked=False)


def test_workers_openmp_threads_sleep_at_barriers_unless_the_user_chose(monkeypatch):
    """A spinning OpenMP thread takes the core its peer needs on a shared machine (issue #27: a demo step
    4-5x slower by default at load 6-7): workers wait passively, unless the environment names a policy."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env(locked=True)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert worker_env(locked=True)["OMP_WAIT_POLICY"] == "active"


def test_a_users_own_torchrun_that_shares_its_store_across_restarts_is_warned_about(monkeypatch):
    monkeypatch.delenv(FRESH_STORE_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert shared_store_warning() is None  # no restarts, nothing to share
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert FRESH_STORE_ENV in shared_store_warning() and "\n" not in shared_store_warning()
    monkeypatch.setenv(FRESH_STORE_ENV, "1")
    assert shared_store_warning() is None


def test_a_worker_whose_torchrun_lost_its_launcher_ends_itself():
    """The start-up window of issue #25: a worker checks, after its parent-death request, that its parent's
    parent is still the launcher that started the run, and ends itself otherwise."""
    code = (
        "import os; os.environ['LORAFLEET_LAUNCHER_PID'] = '{launcher}'\n"
        "from lorafleet.executor.torch.processes import die_with_torchrun\n"
        "die_with_torchrun(); print('alive')"
    )
    # this process (pytest) is the parent of the child, and its own parent is the 'launcher' to compare with
    alive = subprocess.run([sys.executable, "-c", code.format(launcher=os.getppid())], capture_output=True, text=True)
    assert alive.returncode == 0 and alive.stdout.strip() == "alive"
    gone = subprocess.run([sys.executable, "-c", code.format(launcher=os.getpid())], capture_output=True, text=True)
    assert gone.returncode == -9 and gone.stdout == ""
