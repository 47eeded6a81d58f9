"""The environment a run's torchrun and workers start with (``executor.torch.processes.worker_env``)."""

from __future__ import annotations

from pathlib import Path

import lorafleet
from lorafleet.executor.torch.processes import FRESH_STORE_ENV, LOCKED_ENV, PACKAGE_ENV, worker_env


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
