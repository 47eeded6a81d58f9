"""What a run means for its tasks (#42), at component level: a task's learning-rate schedule spans its own steps
whatever the run's ``--steps``."""

from __future__ import annotations

import json

import pytest

from lorafleet.executor.torch.launch import task_training
from lorafleet.executor.torch.optim import lr_at
from lorafleet.specs.workload import TaskSpec


def _task(**fields) -> TaskSpec:
    return TaskSpec(name="t", data={"path": "/x/t.jsonl"}, batch_size=4, context_length=64, **fields)


def test_a_tasks_schedule_spans_its_own_steps_whatever_the_runs():
    """``epochs: 1`` of 12 batches under ``--steps 5``: the schedule is the 12 steps' (cut at 5, never squeezed into
    them), and a resume told ``--steps 12`` runs the same rates; a task without steps or epochs spans the run's
    steps from its start."""
    task = _task(epochs=1.0)
    short, long = task_training(task, 12, run_steps=5), task_training(task, 12, run_steps=12)
    assert short.total_steps == long.total_steps == 12
    rates = [lr_at(task.optimizer, s, short.total_steps) for s in range(5)]
    assert rates == [lr_at(task.optimizer, s, long.total_steps) for s in range(5)] and rates[-1] > rates[0] / 2
    assert task_training(_task(steps=30), 30, run_steps=10).total_steps == 30
    assert task_training(_task(start_step=3), None, run_steps=10).total_steps == 7


def _streams(specs: list[TaskSpec], rows: list[int]):
    """The streams the ranks would draw for ``specs``, each task with ``rows`` one-token examples."""
    from lorafleet.data.tokenize import Example
    from lorafleet.runtime.data_stream import DataStreams, TaskData, task_batches

    data = [TaskData(s.name, tuple(Example((k, 1), (k, 1)) for k in range(n))) for s, n in zip(specs, rows)]
    limits = [task_batches(s, d) for s, d in zip(specs, data)]
    return DataStreams(data, [s.batch_size for s in specs], 0, limits, joined=[s.start_step for s in specs])


def test_a_run_that_ends_before_a_task_is_done_says_so_and_records_what_it_saw(tmp_path):
    """The issue's case: ``epochs: 1`` over 48 rows in batches of 4 (12 steps) under ``--steps 5``: it takes 5, its
    adapter sees 20 of its 48 rows, and the record and the line say so; a task that fits finishes; one that starts
    at step 3 with 4 steps takes 2."""
    from lorafleet.rundir import RunDir
    from lorafleet.train.run_length import RunLength

    specs = [_task(epochs=1.0).model_copy(update={"name": "ep"}), _task(steps=3).model_copy(update={"name": "fits"}),
             _task(steps=4, start_step=3).model_copy(update={"name": "late"})]  # fmt: skip
    length = RunLength.of(_streams(specs, [48, 10, 10]), specs, run_steps=5)
    by = {t.name: t for t in length.tasks}
    assert [(t.name, t.own_steps, t.in_run, t.finishes) for t in length.tasks] == [
        ("ep", 12, 5, False), ("fits", 3, 3, True), ("late", 4, 2, False),
    ]  # fmt: skip
    assert (by["ep"].rows_seen, by["ep"].rows, by["ep"].epochs_seen) == (20, 48, 20 / 48)
    assert [t.name for t in length.cut] == ["ep", "late"]
    assert length.cut[0].line(5).startswith("task ep takes 5 of its 12 steps (epochs 1 over 48 rows) in this run of 5: "
                                        "its adapter sees 20 of its 48 rows")  # fmt: skip
    length.save(RunDir(tmp_path))
    record = json.loads((tmp_path / "run_length.json").read_text())
    assert record["steps"] == 5 and record["tasks"][0] == {
        "name": "ep", "start_step": 0, "own_steps": 12, "in_run": 5, "rows": 48, "batch_size": 4, "epochs": 1.0,
        "finishes": False,
    }  # fmt: skip


def test_without_steps_the_run_lasts_until_its_tasks_are_done(tmp_path, tiny_tokenizer_dir, capsys):
    """No ``--steps``: the run's length is the step after the last one any task takes, drawn from its data as the
    ranks draw it (here ``chat``'s start 3 and its 4 steps; ``docsum``'s one epoch is fewer), and a line says so;
    a task with neither steps nor epochs is one line naming it and ``--steps``."""
    from types import SimpleNamespace

    from lorafleet.errors import InputError
    from lorafleet.train.options import TrainOptions
    from lorafleet.train.run_length import with_run_steps
    from lorafleet.workload import load_workload
    from tests.helpers.repo import DEMO

    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\ncluster: {{gpu: cpu, nodes: 1, gpus_per_node: 1}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 128, context_length: 256, "
        "epochs: 1}\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 4, context_length: 128, steps: 4, "
        "start_step: 3}\n"
    )
    prepared = SimpleNamespace(workload=load_workload(path), turn_changes={}, departed=())
    options = TrainOptions(workload=str(path), plan="p.json")
    assert options.steps is None
    assert with_run_steps(options, prepared).steps == 7
    assert "the run lasts until its tasks are done, 7 steps" in capsys.readouterr().out
    assert with_run_steps(TrainOptions(workload=str(path), plan="p.json", steps=5), prepared).steps == 5
    endless = SimpleNamespace(workload=SimpleNamespace(spec=SimpleNamespace(tasks=[_task()])))
    with pytest.raises(InputError, match="--steps: not given, and t has neither steps nor epochs: give --steps N"):
        with_run_steps(options, endless)


def test_train_says_what_validate_says_of_the_chat_template(tiny_tokenizer_dir):
    """The lines ``train`` prints as it starts (``data.describe.template_lines``, rank 0's tokenizer) are ``validate``'s
    chat-template lines: prompt rows wrapped in the template, and nothing of the rows' sources or splits."""
    from transformers import AutoTokenizer

    from lorafleet.data.describe import data_lines, template_lines
    from tests.helpers.repo import DEMO

    tasks = [
        TaskSpec(name=name, data={"path": str(DEMO / f"{name}.jsonl")}, batch_size=2, context_length=256)
        for name in ("docsum", "chat")
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    said = template_lines(tasks, lambda: tokenizer)
    assert said == [line for line in data_lines(tasks, lambda: tokenizer) if "template" in line]
    assert said[0].startswith("docsum: prompt rows wrapped in the tokenizer's chat template as a user turn")


def test_a_plan_for_fewer_gpus_than_the_run_has_says_how_many_stay_idle():
    from lorafleet.train.phases import idle_gpus

    assert idle_gpus(1, 2) == "; 1 of the 2 GPUs stays idle: the plan uses 1 (plan again with --gpus 2 to use them)"
    assert idle_gpus(4, 16).startswith("; 12 of the 16 GPUs stay idle") and idle_gpus(2, 2) == ""


def test_a_resume_with_other_steps_says_whose_schedule_it_reshapes(tmp_path):
    """Only a task whose cosine or linear schedule spans the run's steps (neither steps nor epochs) changes with
    ``--steps``: the resume says so, naming it; with the run's own ``--steps`` or for tasks with their own steps,
    nothing."""
    from lorafleet.rundir import RunDir
    from lorafleet.train.run_length import reshaped_schedules

    run_dir = RunDir(tmp_path)
    run_dir.run_file.write_text(json.dumps({"options": {"steps": 10}}))
    constant = _task(optimizer={"schedule": "constant"}).model_copy(update={"name": "flat"})
    tasks = [_task(steps=30).model_copy(update={"name": "own"}), _task().model_copy(update={"name": "spans"}), constant]
    assert reshaped_schedules(run_dir, 20, tasks) == (
        "--steps 20, where the run had 10: the learning-rate schedule of spans (over the run's steps) spans 20 steps "
        "from the resumed step on, not 10; give a task its own steps to keep its schedule whole"
    )
    assert reshaped_schedules(run_dir, 10, tasks) is None and reshaped_schedules(run_dir, 20, tasks[::2]) is None


def test_without_a_plan_train_plans_for_itself_on_one_machine(tmp_path, tiny_tokenizer_dir, capsys, monkeypatch):
    """No ``--plan``: ``prepare`` plans as ``lorafleet plan`` would, says so, and writes nothing before the claim
    (which keeps the plan as ``<out>/plan.json``); a resume trains by that file; several nodes, a torchrun of the
    user's own or a resume with no plan of its own are one line naming ``--plan``."""
    from lorafleet.assemble import workload_cluster
    from lorafleet.errors import InputError
    from lorafleet.train.options import TrainOptions
    from lorafleet.train.own_plan import own_plan, with_plan_path
    from lorafleet.train.preflight import prepare
    from lorafleet.workload import load_workload
    from tests.helpers.repo import DEMO

    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\ncluster: {{gpu: cpu, nodes: 1, gpus_per_node: 1}}\n"
        f"tasks:\n  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 4, context_length: 128, "
        "steps: 3}\n"
    )
    out = tmp_path / "out"
    options = TrainOptions(workload=str(path), out=str(out))
    prepared = prepare(options)
    said = capsys.readouterr().out
    assert said.startswith(f"lorafleet train: no --plan: planned {prepared.run.plan.describe()} on 1 x cpu")
    assert f"the run keeps it as {out / 'plan.json'}" in said and not out.exists()
    own = TrainOptions(workload=str(path), out=str(out), plan=str(out / "plan.json"))
    assert with_plan_path(options) == (own, True)
    given = TrainOptions(workload=str(path), out=str(out), plan="mine.json")
    assert with_plan_path(given) == (given, False)
    with pytest.raises(InputError, match="--plan: not given, and the run resumed has no plan of its own"):
        with_plan_path(TrainOptions(workload=str(path), out=str(out), resume=True))
    path.write_text(path.read_text().replace("nodes: 1", "nodes: 2"))
    two = load_workload(path)
    with pytest.raises(InputError, match="--plan: not given, and the cluster has 2 nodes: train plans for itself"):
        own_plan(two, workload_cluster(two), options)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="--plan: under a torchrun of your own, give every node the same --plan"):
        with_plan_path(options)


def test_a_task_that_left_keeps_its_run_length_entry(tmp_path):
    """run_length.json is rewritten at each change of the tasks; a task that left since (a finish, an early stop, a
    sweep's drop) keeps its entry as last written, so the live page still knows its total (#42, #39's run)."""
    from lorafleet.rundir import RunDir
    from lorafleet.train.run_length import RunLength, TaskLength

    run_dir = RunDir(tmp_path)
    chat, docsum = (TaskLength(name, 0, 12, 12, 48, 4) for name in ("chat", "docsum"))
    RunLength(steps=12, tasks=(docsum, chat)).save(run_dir)
    RunLength(steps=12, tasks=(docsum,)).save(run_dir)  # chat stopped early
    record = json.loads(run_dir.run_length.read_text())
    assert sorted(t["name"] for t in record["tasks"]) == ["chat", "docsum"]
