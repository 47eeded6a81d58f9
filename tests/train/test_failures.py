"""The launcher's one line for a failed run (``train.failures``): which worker's failure is the cause."""

from __future__ import annotations

import errno
import json
import signal

import pytest

from lorafleet.rundir import RunDir
from lorafleet.train.failures import WorkerFailure, failure_line, record_worker_error, write_failures


def _failed(tmp_path, *failures: WorkerFailure, errors: dict[int, BaseException]) -> str:
    run_dir = RunDir(tmp_path / "out")
    for rank, err in errors.items():
        record_worker_error(run_dir, rank, err)
    write_failures(run_dir.failures, list(failures))
    return failure_line(run_dir, 1, agent_pid=4242)


def test_an_own_error_is_the_cause_even_when_torchrun_then_killed_its_worker(tmp_path):
    """Rank 0 failed writing a checkpoint and recorded it; its closed group failed rank 1 (a lost peer), and
    torchrun's shutdown then SIGTERMed rank 0: the line names rank 0's own error, not the signal."""
    line = _failed(
        tmp_path,
        WorkerFailure(0, 100, -signal.SIGTERM, 7),
        WorkerFailure(1, 101, 1, 5),
        errors={0: NotADirectoryError("checkpoints/.step-000008.partial"), 1: RuntimeError("Connection reset by peer")},
    )
    assert "worker rank 0 failed: NotADirectoryError: checkpoints/.step-000008.partial" in line, line
    assert line.endswith("no checkpoint was committed: start it again (--overwrite)")


@pytest.mark.parametrize("killed_first", [True, False])
def test_a_killed_worker_comes_before_the_peers_that_lost_it(tmp_path, killed_first):
    stamps = (3, 9) if killed_first else (9, 3)
    line = _failed(
        tmp_path,
        WorkerFailure(1, 101, -signal.SIGKILL, stamps[0]),
        WorkerFailure(0, 100, 1, stamps[1]),
        errors={0: RuntimeError("Read error: Connection reset by peer")},
    )
    assert "the run stopped: worker rank 1 (pid 101) was killed by SIGKILL;" in line, line


def test_a_lost_peer_comes_before_a_bare_exit_code(tmp_path):
    line = _failed(
        tmp_path,
        WorkerFailure(0, 100, 3, 1),
        WorkerFailure(1, 101, 1, 2),
        errors={1: RuntimeError("gloo: Connection closed by peer")},
    )
    assert "worker rank 1 failed: RuntimeError: gloo: Connection closed by peer" in line, line
    summary = json.loads((tmp_path / "out" / "logs" / "rank-1.json").read_text())
    assert summary["peer_lost"] is True


def test_the_first_workers_refusal_of_bad_input_is_the_runs_line(tmp_path):
    """Two ranks refuse bad input (each its own words): the first one recorded is the run's line, whole, and
    nothing else is left in ``logs/``; no refusal reads as None."""
    from lorafleet.errors import InputError
    from lorafleet.train.failures import input_error, record_input_error

    run_dir = RunDir(tmp_path / "out")
    assert input_error(run_dir) is None
    record_input_error(run_dir, InputError("plan.json", "pools[0].gpu", "rank 0 is in the cluster of A100s"))
    record_input_error(run_dir, InputError("plan.json", "pools[0].gpu", "rank 1 is in the cluster of A100s"))
    assert str(input_error(run_dir)) == "plan.json: pools[0].gpu: rank 0 is in the cluster of A100s"
    assert sorted(p.name for p in run_dir.logs.iterdir()) == ["input-error.json"]


def test_a_taken_group_port_is_told_from_other_failures_and_restarts_only_what_repeats_nothing(tmp_path):
    """``port_taken`` reads the workers' records: rank 0's TCPStore server that could not listen (torch's words,
    as the fresh-clone run recorded them) is the race; a lost peer or another bind error is not. The launcher
    starts such a launch again only when it repeats nothing: a resume, or a fresh run without a trained step."""
    from dataclasses import replace

    from lorafleet.train.failures import clear_worker_errors, port_taken
    from lorafleet.train.launcher import _port_race
    from lorafleet.train.options import TrainOptions

    run_dir = RunDir(tmp_path / "out")
    record_worker_error(run_dir, 1, RuntimeError("Connection reset by peer"))
    assert not port_taken(run_dir)
    taken = (
        "The server socket has failed to listen on any local network address. port: 38105, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"
    )
    record_worker_error(run_dir, 0, RuntimeError(taken))
    assert port_taken(run_dir)

    options = TrainOptions(workload="w.yaml", plan="plan.json", out=str(run_dir.root))
    assert _port_race(options)
    run_dir.metrics_jsonl.write_text('{"step": 0}\n')  # a fresh run that trained a step would train it again
    assert not _port_race(options)
    assert _port_race(replace(options, resume=True))  # a resume starts from its checkpoint again
    write_failures(run_dir.failures, [WorkerFailure(0, 100, 1, 5)])
    clear_worker_errors(run_dir)
    assert not port_taken(run_dir) and not list(run_dir.logs.glob("rank-*")) and not run_dir.failures.exists()


def _committed(run_dir: RunDir, step: int) -> str:
    """A committed (empty) checkpoint of ``step`` in ``run_dir``: what a resume would start from."""
    from lorafleet.runtime.checkpoint_files import FORMAT_VERSION, MANIFEST, step_dir_name

    step_dir = run_dir.checkpoints / step_dir_name(step)
    step_dir.mkdir(parents=True)
    (step_dir / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "files": {}}))
    return step_dir.name


def _raised(err: BaseException) -> BaseException:
    """``err`` as a worker meets it: raised, with its traceback."""
    try:
        raise err
    except BaseException as caught:
        return caught


NO_SPACE = "No space left on device"


@pytest.mark.parametrize(
    "err, what",
    [
        (OSError(errno.ENOSPC, NO_SPACE, "/out/checkpoints/.step-000008.partial/chat/adapter.safetensors"), "path"),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "/out/metrics.jsonl"), "quota"),
        (OSError(errno.ENOSPC, NO_SPACE), "no path"),  # a write() or flush() that failed: no file name
        (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), "safetensors"),
    ],
)
def test_a_full_disk_is_the_runs_line_and_the_checkpoints_are_intact(tmp_path, err, what):
    """#38: a full disk under ``--out`` (a small tmpfs) ended in a line that named an error type and, where
    the records could not be written, only "torchrun exited with code 1". A worker's error that is a full
    disk (ENOSPC or EDQUOT, an OSError or its words; the cause of another error too) is the run's line: what
    was being written, and that the committed checkpoints are intact: free space and resume."""
    run_dir = RunDir(tmp_path / "out")
    step = _committed(run_dir, 6)
    if what == "safetensors":
        err = _raised(RuntimeError("saving the checkpoint of step 8 failed"))
        err.__cause__ = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    record_worker_error(run_dir, 1, RuntimeError("Connection closed by peer"))
    record_worker_error(run_dir, 0, _raised(err))
    write_failures(run_dir.failures, [WorkerFailure(1, 101, 1, 3), WorkerFailure(0, 100, 1, 5)])
    line = failure_line(run_dir, 1, agent_pid=4242)
    full = "disk quota exceeded" if what == "quota" else "no space left on device"
    where = f" writing {err.filename}" if what in ("path", "quota") else ""
    assert line == (
        f"lorafleet train: the run stopped: {full}{where} (worker rank 0, traceback in {run_dir.logs / 'rank-0.txt'}); "
        f"the run's checkpoints are intact: free space and continue with --resume (from {step})"
    ), line


def test_a_full_disk_without_a_checkpoint_says_to_start_again(tmp_path):
    run_dir = RunDir(tmp_path / "out")
    record_worker_error(run_dir, 0, _raised(OSError(errno.ENOSPC, NO_SPACE, "/out/run.json")))
    write_failures(run_dir.failures, [WorkerFailure(0, 100, 1, 5)])
    line = failure_line(run_dir, 1, agent_pid=4242)
    assert line.endswith(
        "no space left on device writing /out/run.json (worker rank 0, traceback in "
        f"{run_dir.logs / 'rank-0.txt'}); no checkpoint was committed: free space and start it again (--overwrite)"
    ), line


def test_records_on_a_full_disk_never_raise_and_the_line_still_names_it(tmp_path, monkeypatch):
    """Where the disk is still full when the worker records its error (another process filled it), every record
    fails: the worker's (``record_worker_error``, ``record_input_error``) and torchrun's
    (``write_failures``). Each used to raise inside the handler of the error it recorded: torchrun's pages of
    tracebacks, then "torchrun exited with code 1". Now nothing raises, nothing half-written is left, and the
    launcher finds the disk of ``--out`` full."""
    import pathlib
    import shutil

    from lorafleet.errors import InputError
    from lorafleet.train.failures import record_input_error

    run_dir = RunDir(tmp_path / "out")
    step = _committed(run_dir, 4)
    run_dir.logs.mkdir(parents=True)
    real_write = pathlib.Path.write_text

    def full(self: pathlib.Path, *args: object, **kw: object) -> int:
        with open(self, "w"):  # the file is made (an inode is free), its bytes are not
            pass
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    record_worker_error(run_dir, 0, _raised(OSError(errno.ENOSPC, NO_SPACE)))
    record_input_error(run_dir, InputError("/out/metrics.csv", "", f"cannot write ({NO_SPACE})"))
    write_failures(run_dir.failures, [WorkerFailure(0, 100, 1, 5)])
    monkeypatch.setattr(pathlib.Path, "write_text", real_write)
    assert sorted(p.name for p in run_dir.logs.iterdir()) == []

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4096))
    line = failure_line(run_dir, 1, agent_pid=4242)
    assert line == (
        f"lorafleet train: the run stopped: no space left on device under {run_dir.root} (4,096 bytes free); "
        f"the run's checkpoints are intact: free space and continue with --resume (from {step})"
    ), line
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=10 << 30))
    assert "torchrun (pid 4242) exited with code 1" in failure_line(run_dir, 1, agent_pid=4242)
