"""The environment a run's torchrun and workers start with (``runtime.processes.worker_env``)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import lorafleet
from lorafleet.runtime.processes import (
    FRESH_STORE_ENV,
    LOCKED_ENV,
    PACKAGE_ENV,
    shared_store_warning,
    worker_env,
)
from tests.helpers.ports import held_port


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
        "from lorafleet.runtime.processes import die_with_torchrun\n"
        "die_with_torchrun(); print('alive')"
    )
    # this process (pytest) is the parent of the child, and its own parent is the 'launcher' to compare with
    alive = subprocess.run([sys.executable, "-c", code.format(launcher=os.getppid())], capture_output=True, text=True)
    assert alive.returncode == 0 and alive.stdout.strip() == "alive"
    gone = subprocess.run([sys.executable, "-c", code.format(launcher=os.getpid())], capture_output=True, text=True)
    assert gone.returncode == -9 and gone.stdout == ""


FORM = """
import sys, time
from lorafleet.executor.torch.launch import init_distributed
start = time.monotonic()
try:
    init_distributed("cpu", start_timeout_s=1)
except Exception as err:
    print(type(err).__name__, err, sep=": ")
    print(round(time.monotonic() - start, 1))
"""


def test_a_held_port_is_refused_to_other_binds_and_served_by_a_store():
    """What the tests that start a torch store on a drawn port rely on (``tests.helpers.ports``): while the
    port is held, no other socket binds it, and a ``TCPStore`` server (libuv's, torch's default) binds it,
    listens and serves."""
    import torch.distributed as dist

    with held_port() as port:
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
        store.set("key", "value")
        assert store.get("key") == b"value"


def test_a_peer_that_never_arrives_ends_the_start_within_its_timeout(tmp_path):
    """Rank 0 of two, whose peer never starts (#25): torch would wait 30 minutes (gloo's default); the group
    must form within --start-timeout, here 1 s, or the worker ends with a StartTimeout that says so (and the
    launcher's one line names it, as a failure of its own, not a lost peer: the next test). Rank 0 hosts the
    group's store on a port held for it (``held_port``): one drawn and closed could be taken before it binds."""
    with held_port() as port:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0"}
        env |= {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(Path(lorafleet.__file__).parents[1])}
        done = subprocess.run([sys.executable, "-c", FORM], env=env, capture_output=True, text=True, timeout=120)
    said, seconds = done.stdout.strip().splitlines()
    assert said.startswith("StartTimeout: the process group did not form within 1 s (--start-timeout): ")
    assert "1/2 clients joined" in said and float(seconds) < 30, done.stdout + done.stderr


def test_a_start_timeout_is_the_runs_one_line(tmp_path):
    """The worker that waited records a StartTimeout as an error of its own (not a lost peer's, though its
    words say "Timed out"); the peer torchrun killed after it is not the cause, nor the SIGTERM that ends
    the worker itself if it comes while it exits."""
    from lorafleet.errors import StartTimeout
    from lorafleet.rundir import RunDir
    from lorafleet.train.failures import WorkerFailure, failure_line, record_worker_error, write_failures

    run_dir = RunDir(tmp_path)
    said = "the process group did not form within 2 s (--start-timeout): Timed out after 3 seconds waiting for clients"
    try:
        raise StartTimeout(said)
    except StartTimeout as err:
        record_worker_error(run_dir, 0, err)
    expected = (
        f"lorafleet train: the run stopped: worker rank 0 failed: StartTimeout: {said} (traceback in "
        f"{run_dir.logs / 'rank-0.txt'}); no checkpoint was committed: start it again (--overwrite)"
    )
    write_failures(run_dir.failures, [WorkerFailure(0, 11, 1, 100), WorkerFailure(1, 12, -9, 99)])
    assert failure_line(run_dir, 1, 10) == expected
    # torchrun's SIGTERM can reach a worker that recorded its own error and is still exiting, after its peer
    # (which lost it) ended first: its own error is the cause, not the signal (a race seen under load)
    try:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    except RuntimeError as err:
        record_worker_error(run_dir, 1, err)
    write_failures(run_dir.failures, [WorkerFailure(0, 11, -15, 100), WorkerFailure(1, 12, 1, 99)])
    assert failure_line(run_dir, 1, 10) == expected


_SKIPPING = """
import atexit, sys, threading, time
from lorafleet.runtime.processes import skip_teardown

exiting = skip_teardown()
atexit.register(lambda: print("a later handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("the thread ended", flush=True))).start()
print("buffered, unflushed", end="")
sys.exit(exiting(int(sys.argv[1])))
"""


def test_skip_teardown_ends_as_a_normal_exit_would_before_the_modules_teardown():
    """What a worker's normal exit does is kept (``train.rank``, ``train.agent``): its non-daemon threads end, every
    other atexit handler runs, stdout (a pipe, block-buffered) is flushed, and the exit code is the entry point's."""
    for code in (0, 3):
        run = subprocess.run([sys.executable, "-c", _SKIPPING, str(code)], capture_output=True, text=True, timeout=60)
        assert run.returncode == code, run.stderr
        assert run.stdout.splitlines() == ["buffered, unflushedthe thread ended", "a later handler ran"], run.stdout
