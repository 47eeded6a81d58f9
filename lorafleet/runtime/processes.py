"""Process hygiene of a training run: how it is started (torchrun), that workers never outlive their
launcher and run its code, and that it stops at a step boundary when asked. Torch-free, so the
launcher checks and starts a run without importing torch.

- **Parent death.** On Linux every process of a run asks the kernel for SIGKILL when its parent
  dies (``prctl(PR_SET_PDEATHSIG)``): torchrun when ``lorafleet train`` dies (before it execs, with the
  launcher's pid to compare), each worker when torchrun dies (its first act, before any import that
  takes time: :func:`die_with_torchrun`). A SIGKILL of the launcher therefore takes the whole run with
  it, at any moment of its start-up; each also checks that its parent had not already gone before the
  request took effect.
- **The launcher's code.** Workers are started with ``PYTHONSAFEPATH=1`` (the current directory
  is not put on ``sys.path``) and the launcher's package root first on ``PYTHONPATH``, and each
  checks that the ``lorafleet`` it imported is the launcher's (``LORAFLEET_PACKAGE``): a
  different checkout in the current directory cannot run in their place.
- **Stopping.** The launcher runs torchrun in a session of its own, so a terminal's Ctrl-C
  reaches the launcher alone; it turns SIGINT or SIGTERM into a stop request, a file in the run
  directory (``rundir.RunDir.request_stop``) that rank 0 reads at every step boundary (a second
  signal kills the run). A signal to every process of the job (Slurm's ``scancel``, a shell's job
  control) stops it the same way: torchrun ignores SIGINT and SIGTERM (:func:`agent_preexec` and
  ``--signals-to-handle``, torch >= 2.9; its agent would otherwise kill the workers before the
  stop's checkpoint and print a traceback),
  and every worker records them from its first act (:func:`catch_stop_signals`) instead of dying:
  rank 0 takes one as the stop request, the other ranks go on until rank 0 stops them. Under a
  user's own torchrun, rank 0 takes SIGINT and SIGTERM as the same request.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import lorafleet
from lorafleet.errors import InputError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PACKAGE_ENV = "LORAFLEET_PACKAGE"
LAUNCHER_PID_ENV = "LORAFLEET_LAUNCHER_PID"
"""The launcher's pid, for its workers: their torchrun's parent (:func:`die_with_torchrun`)."""
START_TIMEOUT_S = 300.0
"""How long, by default, a rank waits for the others to form the process group (``train --start-timeout``;
``launch.form_group``)."""
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1 for torchrun: each rendezvous round (every restart) gets a TCPStore of its own."""
LOCKED_ENV = "LORAFLEET_RUN_LOCKED"
"""Set by the launcher, which holds the run directory's lock, for the workers it starts."""
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
"""The signals the launcher's torchrun turns into a shutdown of its workers (``--signals-to-handle``, torch >= 2.9;
torch's default adds SIGTERM and SIGINT, which the launcher and the workers handle instead)."""
_received: list[int] = []
"""The stop signals this process received, in order (:func:`catch_stop_signals`)."""


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or anything that sets its variables)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def torchrun_argv(
    agent: Sequence[str], nproc: int, module: str, argv: Sequence[str], max_restarts: int = 0
) -> list[str]:
    """The command that runs ``python -m <module> <argv>`` as ``nproc`` processes on this machine,
    restarting them up to ``max_restarts`` times after a failure: torchrun's elastic agent, run as
    ``python -m <agent...>`` (an entry that takes torchrun's arguments after its own)."""
    return [
        sys.executable,
        "-m",
        *agent,
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *([f"--signals-to-handle={AGENT_SIGNALS}"] if _torch_version() >= (2, 9) else []),
        "-m",
        module,
        *argv,
    ]


def _torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor), read from its metadata (no import of torch)."""
    from importlib.metadata import version

    major, minor = version("torch").split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def shared_store_warning() -> str | None:
    """A warning line when this worker runs under a torchrun that may restart it but shares one rendezvous
    store across restarts (a restarted group would read the dead group's addresses); None otherwise."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get(FRESH_STORE_ENV) != "1":
        return (
            f"torchrun may restart the workers (--max-restarts {restarts}) but shares one rendezvous store "
            f"across restarts: a restarted group can fail to connect or hang; start torchrun with "
            f"{FRESH_STORE_ENV}=1 (docs/multinode.md)"
        )
    return None


def die_with_parent(sig: int, parent: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere).

    Race-free because ``parent`` is the pid the parent had before this process was started (the launcher
    passes its own to torchrun's ``preexec_fn``; a worker, the parent it saw on entry): a parent that died
    before the request took effect is caught by comparing ``getppid()`` with it after the request, and one
    that dies later is the kernel's to signal."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def agent_preexec(launcher: int) -> None:
    """torchrun's ``preexec_fn`` under the launcher (pid ``launcher``): die with it, and ignore SIGINT and
    SIGTERM, which are the launcher's and the workers' to handle (module doc, "Stopping"); the workers inherit
    the ignoring until their first act replaces it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, launcher)


def catch_stop_signals() -> None:
    """Record SIGINT and SIGTERM instead of dying of them (:func:`stop_signal` reads the first): a worker's
    first act after :func:`die_with_torchrun`, so that a job-wide signal never ends a rank mid-step."""

    def on_signal(signum: int, _frame: object) -> None:
        _received.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def stop_signal() -> int | None:
    """The first stop signal this process received (:func:`catch_stop_signals`), None when none came."""
    return _received[0] if _received else None


def die_with_torchrun(sig: int = signal.SIGKILL) -> None:
    """A worker's first act: die with the torchrun agent that started it, race-free.

    Its parent is the agent; under ``lorafleet train``'s launcher the agent's parent is the launcher, whose
    pid the launcher put in the environment (:data:`LAUNCHER_PID_ENV`). After the parent-death request, a
    parent whose own parent is not the launcher (the agent died during the worker's start-up and the worker
    was reparented to init or a subreaper, or the agent lost its launcher) means the run is gone: the
    worker ends at once instead of living on, holding memory (and devices) under PID 1. Under a user's
    own torchrun there is no launcher to compare with (an agent may itself be PID 1 in a container): the
    parent seen on entry is the agent."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    die_with_parent(sig, parent)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None and _parent_of(parent) != int(launcher):
        os.kill(os.getpid(), sig)


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc/<pid>/stat``), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after the (command): state, ppid, ...


def skip_teardown() -> Callable[[int], int]:
    """Let this process end without the interpreter's teardown of its modules: a worker's torch and transformers
    cost ~1 CPU-s there, and a run's last line waits for it, on every rank and the agent of every launch.

    Call it first, before any other ``atexit`` handler is registered: its hook then runs last, after the
    interpreter joined the non-daemon threads and ran every other handler, as a normal exit does; it flushes
    stdout and stderr and ends the process with the code given to the returned function (what the entry point
    exits with). An exit that never gave one (an exception out of the entry point) tears down as usual."""
    ending: list[int] = []

    def end() -> None:
        if ending:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(ending[0])

    atexit.register(end)

    def exiting(code: int) -> int:
        ending.append(code)
        return code

    return exiting


def package_root() -> Path:
    """The directory the running ``lorafleet`` package was imported from the parent of."""
    return Path(lorafleet.__file__).resolve().parents[1]


OMP_WAIT = ("OMP_WAIT_POLICY", "PASSIVE")
"""What a worker's OpenMP threads do at a barrier unless the user chose: sleep, not spin. libgomp's default
spins a while first; on a machine whose cores other processes also want, a spinning thread burns the core
its peer needs to reach the barrier. Measured on the 2-core development machine at load 6-7, one demo rank
of 2 threads: 134, 162 and 99 s a step (61, 58 and 46 CPU-s) by default, 37, 28 and 19 s (16, 13 and 12
CPU-s) passive (issue #27)."""


def worker_env(locked: bool) -> dict[str, str]:
    """The environment torchrun and its workers start with: this code, whether the lock is held, and
    OpenMP threads that sleep at a barrier (:data:`OMP_WAIT`) unless the user's environment says otherwise."""
    env = dict(os.environ)
    env.setdefault(*OMP_WAIT)
    root = str(package_root())
    # A fresh rendezvous store for every restart: torchrun's agent otherwise keeps one TCPStore for all its
    # rounds, and a restarted group reads the dead group's addresses from it (gloo "Connection refused" to a
    # stale peer, or a hang in connectFullMesh; pytorch/pytorch#135712).
    env[FRESH_STORE_ENV] = "1"
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    env[PACKAGE_ENV] = str(Path(lorafleet.__file__).resolve())
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    if locked:
        env[LOCKED_ENV] = "1"
    return env


def check_code() -> None:
    """InputError when this worker imported another ``lorafleet`` than its launcher's."""
    expected = os.environ.get(PACKAGE_ENV)
    here = str(Path(lorafleet.__file__).resolve())
    if expected and expected != here:
        raise InputError(
            "<environment>",
            PACKAGE_ENV,
            f"this worker imported lorafleet from {here}, its launcher runs "
            f"{expected}; start the run from another directory",
        )


FAULT_ENV = "LORAFLEET_FAULT"
"""Fault injection for the change fault matrix (``tests/train/test_change_faults.py``, ``benchmarks/soak_changes.py``):
``<phase>@<step>`` or ``<phase>@<step>:<rank>`` (rank 0 by default). The process of that rank kills itself with
SIGKILL when it reaches ``phase`` of the fleet change at boundary ``step`` (:func:`fault_point`; the phases are
``train.changes``'s and ``executor.torch.change``'s), once: it first creates the file :data:`FAULT_ONCE_ENV` names, and
a restart that finds it goes on."""
FAULT_ONCE_ENV = "LORAFLEET_FAULT_ONCE"


def fault_point(phase: str, step: int, rank: int = 0) -> None:
    """Dies here (SIGKILL) when :data:`FAULT_ENV` names this phase, step and rank and its once-file is not there yet
    (creating it first); does nothing otherwise (the environment variable is read at each call: a test sets it for
    the run it starts)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    at, _, who = spec.partition(":")
    name, _, when = at.partition("@")
    if name != phase or int(when) != step or int(who or 0) != rank:
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)
