"""A run that failed, said in one line: which worker failed and how, and where the run resumes from.

Under ``lorafleet train``'s launcher:

- a worker that refuses bad input (an ``InputError``: a device of another kind than its pool's, a checkpoint
  that does not fit the run, ...) records it in ``<out>/logs/input-error.json``
  (:func:`record_input_error`; the first rank's stands: its peers often refuse the same input) and exits 2
  without printing it. The launcher, watching for that file, stops the job at once (a restart cannot mend
  bad input) and raises it: the run's one line, exit 2 (``train.launcher``);
- a worker that raises any other error writes its traceback to
  ``<out>/logs/rank-<r>.txt`` and a summary to ``rank-<r>.json`` (:func:`record_worker_error`), and exits 1
  without printing it: its peers' errors are consequences, not news. It records before its process group
  closes (``train.trainer.train_rank``), so the record exists before any peer can fail of the loss;
- torchrun (``train.agent``) writes the ranks that failed, with their exit codes or signals, to
  ``<out>/logs/failures.json`` instead of its table and traceback;
- the launcher prints :func:`failure_line`: the cause, or torchrun's own death, and the newest committed
  checkpoint to ``--resume`` from. The cause is, in this order: a worker that raised an error of its own
  (not a lost peer's), even if torchrun's shutdown then killed it while it was exiting (its peer, which lost
  it, can end first); one killed by a signal; one that lost a peer; any other (torchrun's shutdown of the
  rest follows the first failure, and its SIGKILLs come later than the cause).

**A full disk** (ENOSPC, or EDQUOT: :func:`full_disk`) is said as such: a worker's own error that is one (an
OSError, its words in another error's, or the error it was raised from) names what was being written, and the
line says that the committed checkpoints are intact (a checkpoint is committed whole or not at all) and to
resume once there is space. The records are written on that disk too, so none of them raises: a record that
cannot be written is left out. Without a worker's own error to tell (no record, a lost peer, an exit code),
the launcher looks at the disk of ``--out`` itself: under :data:`MIN_FREE_BYTES` free is a full disk.

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

from lorafleet.errors import FULL_DISK, InputError, StartTimeout, full_disk
from lorafleet.rundir import RunDir

PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|communicator was aborted|"
    r"Socket Timeout|Timed out"
)
"""What a collective's error says when another rank died (gloo's and NCCL's words)."""
PORT_TAKEN = re.compile(r"failed to listen on any local network address.*(EADDRINUSE|address already in use)")
"""What rank 0's error says when its process group's port was taken (torch's TCPStore server)."""
MIN_FREE_BYTES = 1 << 20
"""Less free space than this on the disk of ``--out``, after a failure no worker explained, is a full disk."""


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker, as torchrun saw it."""

    rank: int
    pid: int
    exitcode: int
    """Negative: killed by signal ``-exitcode``."""
    timestamp: int


def record_worker_error(run_dir: RunDir, rank: int, err: BaseException) -> None:
    """A worker's failure into ``logs/``: its one-line summary (what the launcher reads; a full disk's errno and
    path, :func:`full_disk`), then its traceback. Never raises OSError: a record that cannot be written (the
    disk is full) is left out."""
    text = "".join(traceback.format_exception(err))
    message = str(err).strip().splitlines()[:1]
    lost = not isinstance(err, StartTimeout) and bool(PEER_LOST.search(text))  # a start timeout is its own news
    summary: dict = {"error": ": ".join([type(err).__name__, *message]), "peer_lost": lost}
    full = full_disk(err)
    if full is not None:
        summary["full_disk"] = {"errno": full[0], "path": full[1]}
    _record(run_dir.logs / f"rank-{rank}.json", json.dumps(summary))
    _record(run_dir.logs / f"rank-{rank}.txt", text)


def record_input_error(run_dir: RunDir, err: InputError) -> None:
    """A worker's refusal of bad input into ``logs/input-error.json`` (its path, field and message), whole
    (written aside, then linked: the launcher never reads half of it), unless a peer's is there already.
    Never raises OSError: on a full disk it is not recorded (the worker's exit code stands)."""
    aside = run_dir.logs / f".input-error.{os.getpid()}"
    if not _record(aside, json.dumps({"path": err.path, "field": err.field, "msg": err.msg})):
        return
    try:
        os.link(aside, run_dir.input_error)
    except FileExistsError:
        pass  # a peer refused first: its error is the run's
    except OSError:
        pass  # not recorded: as above
    finally:
        _remove(aside)


def _record(path: Path, text: str) -> bool:
    """``text`` written to ``path`` (its folder made); False, and no half-written file left, when it cannot be
    (a full disk: the caller is reporting an error already, and must not raise another inside its handler)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError:
        _remove(path)
        return False
    return True


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def input_error(run_dir: RunDir) -> InputError | None:
    """The error a worker refused bad input with, or None."""
    try:
        return InputError(**json.loads(run_dir.input_error.read_text(encoding="utf-8")))
    except OSError:
        return None


def port_taken(run_dir: RunDir) -> bool:
    """Whether a worker failed to form its process group because another process held the group's port.

    torchrun picks a free port for rank 0's store, closes it, and rank 0 listens on it only after its
    imports, seconds later: a process that binds the port meanwhile (another job's, another test's) takes it.
    That is the path of ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which the launcher sets so that a restart
    gets a store of its own (``runtime.processes``). Nothing has trained in that launch, so the
    launcher starts the workers again (``train.launcher``)."""
    return any(
        PORT_TAKEN.search(error.get("error", ""))
        for path in run_dir.logs.glob("rank-*.json")
        if (error := _worker_error(run_dir, int(path.stem.removeprefix("rank-")))) is not None
    )


def clear_worker_errors(run_dir: RunDir) -> None:
    """The failed launch's records gone (``logs/rank-*``, ``failures.json``), before the workers start again: a
    later failure's line then reads its own."""
    for path in [*run_dir.logs.glob("rank-*.json"), *run_dir.logs.glob("rank-*.txt")]:
        path.unlink(missing_ok=True)
    run_dir.failures.unlink(missing_ok=True)


def write_failures(path: Path, failures: list[WorkerFailure]) -> None:
    """torchrun's failed workers into ``logs/failures.json`` (``train.agent``); left out when it cannot be written
    (a full disk: the launcher then looks at the disk, :func:`failure_line`), never an error of torchrun's."""
    _record(path, json.dumps([f.__dict__ for f in failures]))


def _worker_error(run_dir: RunDir, rank: int) -> dict | None:
    try:
        return json.loads((run_dir.logs / f"rank-{rank}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _cause(run_dir: RunDir, failures: list[WorkerFailure]) -> tuple[str, bool | None]:
    """What the first failed worker did (module doc: which is first), and whether it was a full disk: True, False
    for another error of its own or a signal, None when it does not say (a lost peer, an exit code)."""

    errors = {f.rank: _worker_error(run_dir, f.rank) for f in failures}

    def order(f: WorkerFailure) -> tuple[int, int, int]:
        error = errors[f.rank]
        if error is not None:
            rank = 2 if error.get("peer_lost") else 0
        else:
            rank = 1 if f.exitcode < 0 else 3
        return rank, f.timestamp, f.rank

    first = min(failures, key=order)
    error = errors[first.rank]
    own = error is not None and not error.get("peer_lost")
    if first.exitcode < 0 and not own:  # an error of its own stands: torchrun may SIGTERM a worker still exiting
        return f"worker rank {first.rank} (pid {first.pid}) was killed by {signal.Signals(-first.exitcode).name}", False
    if error is None:
        return f"worker rank {first.rank} (pid {first.pid}) exited with code {first.exitcode}", None
    where = run_dir.logs / f"rank-{first.rank}.txt"
    full = error.get("full_disk") if own else None
    if isinstance(full, dict) and full.get("errno") in FULL_DISK:
        writing = f" writing {full['path']}" if full.get("path") else ""
        return f"{FULL_DISK[full['errno']]}{writing} (worker rank {first.rank}, traceback in {where})", True
    return f"worker rank {first.rank} failed: {error['error']} (traceback in {where})", False if own else None


def _free_bytes(run_dir: RunDir) -> int | None:
    """The free space of the disk that holds the run directory (or its nearest folder that exists)."""
    folder = run_dir.root.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def failure_line(run_dir: RunDir, code: int, agent_pid: int) -> str:
    """The launcher's one line for a run whose torchrun ended with ``code`` (not 0, and no signal to the
    launcher): the cause, and how to go on."""
    from lorafleet.runtime.checkpoint_files import resumable_checkpoint

    try:
        failures = [WorkerFailure(**f) for f in json.loads(run_dir.failures.read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError):
        failures = []
    full: bool | None = None
    if failures:
        cause, full = _cause(run_dir, failures)
    elif code < 0:
        cause = f"torchrun (pid {agent_pid}) was killed by {signal.Signals(-code).name}, and its workers with it"
        full = False
    else:
        cause = f"torchrun (pid {agent_pid}) exited with code {code}"
    if full is None:  # nothing says what failed: the records may be missing because the disk is full
        free = _free_bytes(run_dir)
        if free is not None and free < MIN_FREE_BYTES:
            cause, full = f"no space left on device under {run_dir.root} ({free:,} bytes free)", True
    try:
        found = resumable_checkpoint(run_dir.checkpoints)
    except InputError:
        found = None
    if full and found is None:
        after = "no checkpoint was committed: free space and start it again (--overwrite)"
    elif full:
        after = f"the run's checkpoints are intact: free space and continue with --resume (from {found.step_dir.name})"
    elif found is None and run_dir.run_file.is_file():  # the launcher wrote it: --resume starts again from step 0
        after = "no checkpoint was committed: continue with --resume (from step 0, its queued changes kept)"
    elif found is None:
        after = "no checkpoint was committed: start it again (--overwrite)"
    else:
        after = f"checkpoint {found.step_dir.name} is the newest committed: continue with --resume"
    return f"lorafleet train: the run stopped: {cause}; {after}"
