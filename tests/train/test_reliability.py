"""``lorafleet train`` under faults and mistakes (docs/reliability.md): each rule of the run directory,
checkpoints, signals, processes and numbers, as a user would meet it (real torchrun, gloo, tiny-llama)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorafleet.runtime.checkpoint_files import resumable_checkpoint
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO
from tests.helpers.train_cli import LAUNCHER, _job_processes, _steps, _wait_for_steps, _worker_pids, _worker_rank


def _workload(tmp_path: Path, tokenizer: Path, chat: str = "optimizer: {lr: 1.0e-3}", extra_task: str = "") -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tokenizer}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 2}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-3}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256}}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128, {chat}}}\n"
        + extra_task
    )
    return path


def _runner(tmp_path: Path, tokenizer: Path):
    """A two-task workload in ``tmp_path``, a two-replica plan for it, and a ``train(*args)`` that runs the CLI."""
    workload = _workload(tmp_path, tokenizer)
    plan = replace(h.plan_of((1, 1), (1, 1)), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    plan.save(tmp_path / "plan.json")

    def train(*args: str, workload_path: Path = workload, cwd: Path = tmp_path, timeout: float = 300):
        argv = [
            *LAUNCHER,
            "train",
            str(workload_path),
            "--plan",
            str(tmp_path / "plan.json"),
            "--out",
            str(tmp_path / "out"),
            "--device",
            "cpu",
            "--no-recalibrate",
            *args,
        ]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)

    return train, tmp_path


@pytest.fixture
def run(tmp_path, tiny_tokenizer_dir):
    """:func:`_runner` in this test's directory."""
    return _runner(tmp_path, tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, tiny_tokenizer_dir):
    """The run directory of 3 steps of :func:`_runner`'s workload and plan, a checkpoint after each, run once for
    the tests that resume it (each resumes its own copy)."""
    train, tmp = _runner(tmp_path_factory.mktemp("three-steps"), tiny_tokenizer_dir)
    first = train("--steps", "3", "--checkpoint-every", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    return tmp / "out"


@pytest.fixture
def resumable(run, three_steps):
    """:func:`run` whose ``out`` holds a copy of :func:`three_steps`' run directory."""
    shutil.copytree(three_steps, run[1] / "out")
    return run


def _refused(capsys, tmp: Path, words: str, *args: str, workload: Path | None = None) -> None:
    """``lorafleet train`` in this process (the launcher's checks need no worker): one line, exit 2."""
    from lorafleet.cli import main

    argv = [
        "train",
        str(workload or tmp / "w.yaml"),
        "--plan",
        str(tmp / "plan.json"),
        "--out",
        str(tmp / "out"),
        "--device",
        "cpu",
        "--no-recalibrate",
        *args,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err


@pytest.mark.slow
def test_run_directory_checkpoints_and_resume(resumable, capsys):
    train, tmp = resumable
    out = tmp / "out"
    _refused(capsys, tmp, "holds a previous run (metrics.jsonl, metrics.csv, tensorboard, checkpoints", "--steps", "3")
    _refused(capsys, tmp, "--steps: 2 is below the 3 steps the run has committed", "--steps", "2", "--resume")
    _refused(capsys, tmp, "--resume: nothing to resume", "--resume", "--out", str(tmp / "fresh"))
    (tmp / "file").write_text("x")
    _refused(capsys, tmp, "is a file, expected a directory", "--out", str(tmp / "file"))
    assert not (tmp / "fresh").exists()

    # The newest checkpoint is damaged: resume warns, takes the one before, and replays from it.
    newest = out / "checkpoints" / "step-000003" / "chat" / "adapter_model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-9])
    resumed = train("--steps", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warning = (
        "warning: checkpoint step-000003: chat/adapter_model.safetensors does not match its checksum; resuming "
        "from step-000002"
    )
    assert resumed.stderr.count(warning) == 1, resumed.stderr  # the launcher's, not again by each rank
    assert _steps(out) == [0, 1, 2, 3]  # step 2 replayed once, nothing counted twice
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("step,") and sum(r.startswith("step,") for r in rows) == 1

    # Data changed since the checkpoint: refused before any process starts.
    changed = tmp / "changed.jsonl"
    changed.write_text((DEMO / "chat.jsonl").read_text().replace(" the ", " THE ", 5))
    workload = Path(str(tmp / "w.yaml"))
    other = tmp / "w2.yaml"
    other.write_text(workload.read_text().replace(str(DEMO / "chat.jsonl"), str(changed)))
    _refused(capsys, tmp, "data: the data changed since the checkpoint", "--steps", "5", "--resume", workload=other)

    # Every checkpoint damaged: one line, exit 2.
    for manifest in (out / "checkpoints").glob("step-*/manifest.json"):
        manifest.write_text("{")
    _refused(capsys, tmp, "no intact checkpoint to resume from", "--steps", "5", "--resume")

    # --overwrite starts afresh: the launcher clears the previous run's files (in process here, as
    # `lorafleet train` does before it starts torchrun) and writes the new run's plan.
    from lorafleet.train.options import TrainOptions
    from lorafleet.train.preflight import claim as _claim
    from lorafleet.train.preflight import prepare

    (out / "notes.txt").write_text("mine")
    options = TrainOptions(workload=str(tmp / "w.yaml"), plan=str(tmp / "plan.json"), out=str(out), overwrite=True)
    lock = _claim(options, prepare(options))
    lock.release()
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt", "plan.json", "workload.resolved.yaml"]


def test_a_second_run_refuses_a_locked_directory(run, capsys):
    """The launcher's lock check, in this process (it needs no worker): one line, exit 2."""
    from lorafleet.rundir import lock_run

    _, tmp = run
    lock = lock_run(tmp / "out")
    try:
        _refused(capsys, tmp, "another run is using this directory", "--steps", "1")
    finally:
        lock.release()


def _start(run, *args: str) -> subprocess.Popen:
    train, tmp = run
    argv = [
        *LAUNCHER,
        "train",
        str(tmp / "w.yaml"),
        "--plan",
        str(tmp / "plan.json"),
        "--out",
        str(tmp / "out"),
        "--device",
        "cpu",
        "--no-recalibrate",
        *args,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130)])  # SIGTERM (143): test_recovery's resume on other GPUs
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint(run, sig, code):
    train, tmp = run
    process = _start(run, "--steps", "400", "--checkpoint-every", "1000")
    _wait_for_steps(tmp / "out", 2, process)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr
    (line,) = [x for x in stdout.splitlines() if x.startswith("lorafleet train: stopped by")]
    steps = int(line.split(" after ")[1].split()[0])
    assert line == (
        f"lorafleet train: stopped by {sig.name} after {steps} steps; checkpoint step-{steps:06d} committed, "
        "continue with --resume"
    )
    assert json.loads((tmp / "out" / "checkpoints" / "latest.json").read_text())["step"] == steps
    assert _steps(tmp / "out") == list(range(steps))
    assert not _worker_pids(str(tmp / "out"))


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143)])  # SIGINT (130): the launcher alone, above
def test_a_signal_to_every_process_of_the_job_stops_it_once_with_a_checkpoint(run, sig, code):
    """Slurm's scancel (SIGTERM; a shell's job control sends SIGINT the same way) signals every process of the
    job: the launcher, torchrun and each worker. The run stops as when the launcher alone is signalled: one stop
    line, a stop checkpoint, 143, no traceback (torchrun's agent neither kills the workers first nor raises)."""
    _, tmp = run
    process = _start(run, "--steps", "400", "--checkpoint-every", "1000", "--inject-slowdown", "0=5")
    _wait_for_steps(tmp / "out", 2, process)
    job = _job_processes(str(tmp / "out"))
    assert process.pid in job and len(job) == 4, job  # the launcher, torchrun, two workers
    for pid in job:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    (line,) = [x for x in stdout.splitlines() if x.startswith("lorafleet train: stopped by")]
    steps = int(line.split(" after ")[1].split()[0])
    assert f"checkpoint step-{steps:06d} committed, continue with --resume" in line
    assert json.loads((tmp / "out" / "checkpoints" / "latest.json").read_text())["step"] == steps
    assert _steps(tmp / "out") == list(range(steps))
    assert not _job_processes(str(tmp / "out"))


def _stopped_line(stderr: str) -> str:
    (line,) = [x for x in stderr.splitlines() if x.startswith("lorafleet train: the run stopped: ")]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    return line


@pytest.mark.slow
def test_a_failure_without_restarts_is_one_line_that_says_how_to_resume(run):
    """Without ``--max-restarts``: a SIGKILLed worker, a SIGKILLed torchrun and a checkpoint that cannot
    be written each end in one lorafleet line naming what happened and the checkpoint to resume from,
    not in gloo's or torchrun's dumps; nothing of the run is left running."""
    _, tmp = run
    out = tmp / "out"
    slow = ("--steps", "400", "--checkpoint-every", "2", "--inject-slowdown", "0=5")

    def newest() -> str:  # what --resume would take: latest.json is written after a step directory commits
        return resumable_checkpoint(out / "checkpoints").step_dir.name

    process = _start(run, *slow)
    _wait_for_steps(out, 3, process)
    victim = next(pid for pid in _worker_pids(str(out)) if _worker_rank(pid) == 1)
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 1, stderr[-3000:]
    assert _stopped_line(stderr) == (
        f"lorafleet train: the run stopped: worker rank 1 (pid {victim}) was killed by SIGKILL; checkpoint "
        f"{newest()} is the newest committed: continue with --resume"
    )
    assert not _job_processes(str(out))

    process = _start(run, *slow, "--resume")
    _wait_for_steps(out, 6, process)
    (agent,) = [pid for pid, cmd in _job_processes(str(out)).items() if "lorafleet.train.agent" in cmd]
    os.kill(agent, signal.SIGKILL)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 137, stderr[-3000:]
    assert _stopped_line(stderr) == (
        f"lorafleet train: the run stopped: torchrun (pid {agent}) was killed by SIGKILL, and its workers with "
        f"it; checkpoint {newest()} is the newest committed: continue with --resume"
    )
    deadline = time.monotonic() + 30
    while _job_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _job_processes(str(out))

    resumed = resumable_checkpoint(out / "checkpoints").step
    for step in range(resumed + 1, 400):  # no checkpoint after the one resumed from can be written; set up
        partial = out / "checkpoints" / f".step-{step:06d}.partial"  # before the run races it
        if partial.is_dir():  # a write the kill cut short: a writer clears such a directory, not a file
            shutil.rmtree(partial)
        partial.write_text("in the way")
    process = _start(run, *slow, "--resume")
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 1, stderr[-3000:]
    line = _stopped_line(stderr)
    assert line.startswith("lorafleet train: the run stopped: worker rank 0 failed: ") and "Error: " in line, line
    assert line.endswith(
        f"(traceback in {out / 'logs' / 'rank-0.txt'}); checkpoint {newest()} is the newest committed: "
        "continue with --resume"
    ), line
    assert "Traceback" in (out / "logs" / "rank-0.txt").read_text()
    assert not _job_processes(str(out))


@pytest.mark.slow
def test_bad_input_a_worker_finds_is_the_runs_one_line_without_restarts(run):
    """Issues #25/#29: bad input only a worker can see (here a rank whose device is not its pool's kind: an
    A100 plan under ``--device auto`` on a machine without GPUs) is the run's one line and exit 2, as the
    launcher's own checks are: said once (not once per rank, not torchrun's or the launcher's failure lines),
    no restart although ``--max-restarts 2`` allows two (a restart cannot mend input), nothing of the job left
    running, and the fresh run directory rolled back (the command, once fixed, is not refused as "used")."""
    from lorafleet.rundir import used_by

    train, tmp = run
    a100 = replace(h.plan_of((1, 1), (1, 1), gpu="A100-40GB"), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    a100.save(tmp / "plan.json")
    workload = tmp / "w.yaml"
    workload.write_text(workload.read_text().replace("gpu: cpu", "gpu: A100-40GB"))
    result = train("--device", "auto", "--max-restarts", "2", "--steps", "4")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"lorafleet: error: {tmp / 'plan.json'}: pools[0].gpu: rank 0 is in the cluster of A100-40GB GPUs, but "
        "its device is cpu: plan for the devices the job runs on (--gpu cpu)"
    )
    assert result.stdout.count("process group up") == 1, result.stdout
    assert not _job_processes(str(tmp / "out"))
    assert used_by(tmp / "out") == []


@pytest.mark.slow
def test_workers_never_outlive_their_launcher(run):
    _, tmp = run
    process = _start(run, "--steps", "4000", "--checkpoint-every", "1000")
    _wait_for_steps(tmp / "out", 1, process)
    assert len(_worker_pids(str(tmp / "out"))) == 2
    process.kill()  # SIGKILL: no handler runs
    process.communicate()
    deadline = time.monotonic() + 20
    while _worker_pids(str(tmp / "out")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _worker_pids(str(tmp / "out"))


@pytest.mark.slow
def test_no_worker_outlives_a_launcher_killed_during_start_up(run):
    """Issue #25: the launcher SIGKILLed after torchrun started the workers and before their process group is
    up (importing, reading the run file, tokenizing, loading the model): torchrun dies with it, and every
    worker with torchrun, at each point of the window."""
    _, tmp = run
    for delay in (0.0, 0.6, 3.0):
        process = _start(run, "--steps", "4000", "--checkpoint-every", "1000", "--overwrite")
        deadline = time.monotonic() + 120
        while not _worker_pids(str(tmp / "out")) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()
            time.sleep(0.005)
        time.sleep(delay)
        started = _worker_pids(str(tmp / "out"))
        process.kill()  # SIGKILL: no handler runs
        process.wait()  # not communicate(): an orphan would hold the pipes open and hang the test
        deadline = time.monotonic() + 20
        while _worker_pids(str(tmp / "out")) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = _worker_pids(str(tmp / "out"))
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()
        assert started and not orphans, f"workers {orphans} outlived a launcher killed {delay} s in"


SANE_CHAT, BLOWN_CHAT = "optimizer: {lr: 1.0e-3}", "lora: {alpha: 1.0e+30}, optimizer: {lr: 10}"
"""``chat`` sane, and blown up (lr 10, alpha 1e30: the issue's case; its gradient overflows, and any update it took
would overflow its activations)."""
FROZEN_AND_SHORT = (
    f"  - {{name: frozen, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 2, context_length: 256,"
    " optimizer: {name: sgd, lr: 1.0e-45}}\n"
    f"  - {{name: short, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 2, context_length: 128,"
    " steps: 2, share: 0.5}\n"
)
"""Beside docsum and chat: ``frozen``, whose SGD step underflows to nothing (lr 1e-45), and ``short``, with its own
``steps`` and a ``share``."""
FOUR_TASKS = ("docsum", "chat", "frozen", "short")
TEN_STEPS = ("--steps", "10", "--no-recalibrate", "--device", "cpu")


def _four_task_plan(tmp: Path) -> Path:
    plan = replace(h.plan_of((1, 1), (1, 1)), tasks=FOUR_TASKS, bucket_boundaries=(256,))
    plan.save(tmp / "plan.json")
    return tmp / "plan.json"


def _run_as_a_user(folder: Path, tokenizer: Path, plan: Path, chat: str) -> tuple[subprocess.CompletedProcess, Path]:
    """10 steps of the four tasks (``chat`` as given) into ``folder/out``, started as a user would: the installed
    ``lorafleet`` console script, from a directory that holds another ``lorafleet`` package (the workers must run
    the launcher's code, not that one). The run's result and its directory."""
    fake = folder / "elsewhere" / "lorafleet"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise SystemExit('the wrong lorafleet was imported')\n")
    (fake / "__main__.py").write_text("raise SystemExit('the wrong lorafleet was run')\n")
    workload = _workload(folder, tokenizer, chat, FROZEN_AND_SHORT)
    argv = [str(Path(sys.executable).parent / "lorafleet"), "train", str(workload), "--plan", str(plan), "--out",
            str(folder / "out"), *TEN_STEPS]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=fake.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrong lorafleet" not in result.stderr + result.stdout
    assert "task 'frozen': its adapter has not moved after its warm-up" in result.stderr
    return result, folder / "out"


@pytest.fixture(scope="module")
def blown(tmp_path_factory, tiny_tokenizer_dir):
    """The four tasks run straight through 10 steps with ``chat`` blown up (:func:`_run_as_a_user`): the run the
    non-finite test compares with a sane one and the resume test with a stopped and resumed one. Its plan, result
    and directory."""
    tmp = tmp_path_factory.mktemp("blown")
    plan = _four_task_plan(tmp)
    return (plan, *_run_as_a_user(tmp / "straight", tiny_tokenizer_dir, plan, BLOWN_CHAT))


@pytest.mark.slow
def test_a_nonfinite_task_is_skipped_then_stopped_and_the_others_are_bitwise_untouched(
    blown, tmp_path, tiny_tokenizer_dir
):
    """``chat`` blows up: its updates are skipped and it stops after three in a row; ``docsum`` trains bitwise
    as in a run where chat is sane. ``frozen`` is warned about in both runs (:func:`_run_as_a_user`)."""
    plan, blown, out = blown
    sane = _run_as_a_user(tmp_path, tiny_tokenizer_dir, plan, SANE_CHAT)[1]
    assert "task 'chat' has a non-finite loss or gradient; its update is skipped (3 in a row)" in blown.stderr
    assert "task 'chat' stopped after 3 non-finite steps in a row" in blown.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    flagged = ["chat" in r["nonfinite_tasks"] for r in records]
    assert sum(flagged) >= 3 and all(not r["nonfinite_tasks"] or r["nonfinite_tasks"] == ["chat"] for r in records)
    chat = load_file(out / "adapters" / "chat" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in chat.values())
    sane = load_file(sane / "adapters" / "docsum" / "adapter_model.safetensors")
    ours = load_file(out / "adapters" / "docsum" / "adapter_model.safetensors")
    assert sane.keys() == ours.keys() and all(torch.equal(sane[k], ours[k]) for k in sane)


@pytest.mark.slow
def test_a_run_resumes_past_a_stopped_task_and_a_finished_share_task_bitwise(blown, tmp_path, tiny_tokenizer_dir):
    """A task stopped for non-finite updates took fewer batches than the steps run, and one with its own
    ``steps`` and a ``share`` fewer still (it finished through the queue, a relaunch): a resume must draw the
    data cursors as the run did (they are not every task's every step) and carry on the non-finite streaks.
    Run straight through 10 steps (:func:`blown`), and stopped by SIGINT after step 6 then ``--resume``: the second
    ends bitwise as the first. The stopped task is dispatched up to the documented step: its third non-finite
    report (step 2) arrives once step 3 is dispatched ahead, so steps 0-3 hold it, in both runs."""
    plan, _, straight = blown
    workload = _workload(tmp_path, tiny_tokenizer_dir, BLOWN_CHAT, FROZEN_AND_SHORT)
    argv = [*LAUNCHER, "train", str(workload), "--plan", str(plan), "--out", str(tmp_path / "out"), *TEN_STEPS]
    # slowed down, so that SIGINT lands before the last steps (the numbers are unchanged)
    process = subprocess.Popen([*argv, "--inject-slowdown", "0=20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path)  # fmt: skip
    _wait_for_steps(tmp_path / "out", 6, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert _steps(tmp_path / "out")[-1] < 9
    result = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    resumed = tmp_path / "out"
    for out in (straight, resumed):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(10))
        assert [r["step"] for r in records if "chat" in r["losses"]] == [0, 1, 2, 3]
        assert [r["step"] for r in records if "short" in r["losses"]] == [0, 1]
    for task in FOUR_TASKS:
        a = load_file(straight / "adapters" / task / "adapter_model.safetensors")
        b = load_file(resumed / "adapters" / task / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), task


@pytest.mark.slow
def test_a_resume_refuses_changed_hyperparameters_unless_allowed_and_records_them(resumable, capsys):
    """A changed learning rate on ``--resume`` is refused (one line naming the field, nothing written);
    with ``--allow-changes`` the run trains on with it and records the change with its step in the ledger,
    the resolved workload and the adapter's card; a later resume with the same file is no change."""
    train, tmp = resumable
    out = tmp / "out"
    resolved = (out / "workload.resolved.yaml").read_text()
    workload = tmp / "w.yaml"
    workload.write_text(workload.read_text().replace("128, optimizer: {lr: 1.0e-3}", "128, optimizer: {lr: 5.0e-3}"))
    _refused(
        capsys,
        tmp,
        "w.yaml: tasks.chat.optimizer.lr: 0.005 now, 0.001 in the run being resumed; a resume trains on as the run "
        "did: pass --allow-changes to train with the new values from step 3 on",
        "--steps",
        "4",
        "--resume",
    )
    assert (out / "workload.resolved.yaml").read_text() == resolved and not (out / "tasks.json").exists()
    changed = train("--steps", "4", "--resume", "--allow-changes")
    assert changed.returncode == 0, changed.stderr[-2000:]
    ledger = json.loads((out / "tasks.json").read_text())
    chat = next(e for e in ledger["tasks"] if e["spec"]["name"] == "chat")
    assert chat["revisions"] == [{"step": 3, "field": "optimizer.lr", "before": 0.001, "after": 0.005}]
    assert chat["spec"]["optimizer"]["lr"] == 0.005
    assert "#   tasks.chat.optimizer.lr 0.001 -> 0.005 from step 3" in (out / "workload.resolved.yaml").read_text()
    card = (out / "adapters" / "chat" / "README.md").read_text()
    assert "learning rate 0.005" in card and "- Changed on resume: optimizer.lr 0.001 -> 0.005 from step 3" in card
    assert "Changed on resume" not in (out / "adapters" / "docsum" / "README.md").read_text()
    from lorafleet.train.options import TrainOptions  # a later resume with the same file: the launcher's checks
    from lorafleet.train.preflight import prepare  # (in process) find nothing to refuse and no change to record

    again = TrainOptions(workload=str(workload), plan=str(tmp / "plan.json"), out=str(out), steps=5, resume=True)
    assert prepare(again).revisions == {}
    assert json.loads((out / "tasks.json").read_text())["tasks"] == ledger["tasks"]


_TAKE_THE_PORT = """
import os, sys
if "lorafleet.train.agent" in sys.orig_argv and not os.path.exists(os.environ["LORAFLEET_TEST_PORT_TAKEN"]):
    import torch.distributed.elastic.rendezvous.api as api

    def get_free_port():  # the first launch's agent draws the port the test holds: the race, made certain
        open(os.environ["LORAFLEET_TEST_PORT_TAKEN"], "w").close()
        return int(os.environ["LORAFLEET_TEST_BUSY_PORT"])

    api.get_free_port = get_free_port
"""


@pytest.mark.slow
def test_workers_whose_group_port_another_process_took_start_again(run):
    """torchrun draws a free port for rank 0's store and closes it; rank 0 listens on it seconds later, and
    another process may hold it by then (a fresh-clone test run lost a resume to ``EADDRINUSE`` so). Here the
    first launch's agent draws a port this test listens on (a ``sitecustomize`` in the agent only: torchrun,
    gloo and the workers are real): the launcher says so in one line, starts the workers again on a new port,
    and the run trains every step once. One replica on one rank: the port is rank 0's, whatever the world size."""
    import socket

    _, tmp = run
    one = replace(h.plan_of((1, 1), gpus_per_node=2), tasks=("docsum", "chat"), bucket_boundaries=(256,))
    one.save(tmp / "plan.json")
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_TAKE_THE_PORT)
    out = tmp / "out"
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
            "LORAFLEET_TEST_BUSY_PORT": str(held.getsockname()[1]),
            "LORAFLEET_TEST_PORT_TAKEN": str(tmp / "taken"),
        }
        argv = [*LAUNCHER, "train", str(tmp / "w.yaml"), "--plan", str(tmp / "plan.json"), "--out", str(out),
                "--device", "cpu", "--no-recalibrate", "--steps", "3"]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp / "taken").exists()
    said = (
        "lorafleet train: another process took the port of the workers' process group before rank 0 "
        "listened on it; starting the workers again (1 of 3)"
    )
    assert result.stdout.count(said) == 1, result.stdout
    assert result.stdout.count("process group up") == 1 and "Traceback" not in result.stderr
    assert _steps(out) == [0, 1, 2]
    assert not list((out / "logs").glob("rank-*")) and not (out / "logs" / "failures.json").exists()
