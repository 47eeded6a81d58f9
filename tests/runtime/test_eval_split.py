"""A task's held-out rows (``runtime.eval_split``): deterministic, disjoint from training, by content."""

from __future__ import annotations

import json
import random

import pytest

from lorafleet.data.model_source import data_tokenizer
from lorafleet.errors import InputError
from lorafleet.runtime.data_stream import prepare_task_data
from lorafleet.runtime.eval_split import split_rows
from lorafleet.specs.workload import TaskSpec


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"question {i} about {i * 7 % 13}", "response": f"answer {i} is {i * i}"} for i in range(n)]


def _task(path, name="chat", **eval_spec) -> TaskSpec:
    return TaskSpec(name=name, data={"path": str(path)}, batch_size=2, context_length=64, eval=eval_spec)


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _tokens(examples) -> list[tuple]:
    return [(e.input_ids, e.labels) for e in examples]


@pytest.fixture
def tokenizer(tiny_tokenizer_dir):
    return data_tokenizer("tiny-llama", str(tiny_tokenizer_dir), source="test")


def test_the_split_is_disjoint_deterministic_and_independent_of_row_order(tmp_path, tokenizer):
    rows = _rows(60)
    rows += rows[:5]  # copies of five rows: each with its original, on one side
    _write(tmp_path / "a.jsonl", rows)
    shuffled = list(rows)
    random.Random(3).shuffle(shuffled)
    _write(tmp_path / "b.jsonl", shuffled)
    a = prepare_task_data(_task(tmp_path / "a.jsonl", split=0.2), tokenizer, "test")
    b = prepare_task_data(_task(tmp_path / "b.jsonl", split=0.2), tokenizer, "test")
    held, trained = set(_tokens(a.eval_examples)), set(_tokens(a.examples))
    assert not held & trained  # no row in both, copies included
    assert len(set(_tokens(a.eval_examples))) == 12  # round(0.2 x 60 distinct rows)
    assert _tokens(a.eval_examples) == _tokens(b.eval_examples)  # the same rows in the same order
    assert sorted(_tokens(a.examples)) == sorted(_tokens(b.examples))
    other = prepare_task_data(_task(tmp_path / "a.jsonl", name="summary", split=0.2), tokenizer, "test")
    assert set(_tokens(other.eval_examples)) != held  # seeded by the task's name


def test_an_appended_row_moves_at_most_the_marginal_row_and_max_rows_takes_a_prefix(tmp_path, tokenizer):
    _write(tmp_path / "a.jsonl", _rows(40))
    _write(tmp_path / "b.jsonl", _rows(41))
    a = prepare_task_data(_task(tmp_path / "a.jsonl", split=0.25), tokenizer, "test")
    b = prepare_task_data(_task(tmp_path / "b.jsonl", split=0.25), tokenizer, "test")
    assert len(set(_tokens(a.eval_examples)) & set(_tokens(b.examples))) <= 1  # the count is round(0.25 x D)
    assert len(set(_tokens(a.examples)) & set(_tokens(b.eval_examples))) == 0
    capped = prepare_task_data(_task(tmp_path / "a.jsonl", split=0.25, max_rows=3), tokenizer, "test")
    assert _tokens(capped.eval_examples) == _tokens(a.eval_examples)[:3]
    assert _tokens(capped.examples) == _tokens(a.examples)  # the rows past max_rows are still held out


def test_split_rows_by_key_order():
    from lorafleet.data.tokenize import Example

    examples = [Example((i, i + 1), (i, i + 1)) for i in range(10)]
    train, held = split_rows("t", examples, 0.3)
    assert len(held) == 3 and sorted(train + held) == list(range(10))
    assert split_rows("t", examples[::-1], 0.3)[1] == [9 - i for i in held]


def test_a_held_out_file_leaves_every_own_row_to_training(tmp_path, tokenizer):
    _write(tmp_path / "train.jsonl", _rows(10))
    _write(tmp_path / "held.jsonl", _rows(14)[10:])
    task = TaskSpec(
        name="chat", data={"path": str(tmp_path / "train.jsonl")}, batch_size=2, context_length=64,
        eval={"data": {"path": str(tmp_path / "held.jsonl")}},
    )  # fmt: skip
    data = prepare_task_data(task, tokenizer, "test")
    assert len(data.examples) == 10 and len(data.eval_examples) == 4


def test_a_split_that_leaves_a_side_empty_is_one_line_naming_the_file_and_field(tmp_path, tokenizer):
    _write(tmp_path / "few.jsonl", _rows(4))
    with pytest.raises(InputError) as caught:
        prepare_task_data(_task(tmp_path / "few.jsonl", split=0.05), tokenizer, "test")
    assert caught.value.field == "tasks.chat.eval.split" and "no held-out row" in str(caught.value)
    _write(tmp_path / "one.jsonl", _rows(1))
    with pytest.raises(InputError) as caught:
        prepare_task_data(_task(tmp_path / "one.jsonl", split=0.5), tokenizer, "test")
    assert "no training row" in str(caught.value)


def test_an_unreadable_eval_file_is_one_line_naming_it(tmp_path, tokenizer):
    _write(tmp_path / "train.jsonl", _rows(10))
    (tmp_path / "held.jsonl").write_text('{"prompt": "p"\n')
    task = TaskSpec(
        name="chat", data={"path": str(tmp_path / "train.jsonl")}, batch_size=2, context_length=64,
        eval={"data": {"path": str(tmp_path / "held.jsonl")}},
    )  # fmt: skip
    with pytest.raises(InputError) as caught:
        prepare_task_data(task, tokenizer, "test")
    assert str(tmp_path / "held.jsonl") in str(caught.value)


def test_no_held_out_row_is_trained_across_a_queue_add_and_a_resume(tmp_path, tiny_tokenizer_dir):
    """The issue's "no row in both, across resumes and queue adds": the launch's streams, the running fleet's after
    a task joins at step 3 (its data prepared as the queue prepares it), and a resume's, built from the workload as
    the run left it; every example any of them draws over 16 steps is outside its task's held-out rows, the held-out
    rows are the same in all three, and the resume draws the same rows at every step as the run it resumes."""
    from lorafleet.runtime import data_stream
    from lorafleet.workload import load_workload

    for name, n in (("chat", 40), ("docsum", 30), ("joined", 24)):
        _write(tmp_path / f"{name}.jsonl", [{**r, "prompt": f"{name}: {r['prompt']}"} for r in _rows(n)])
    head = f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\nseed: 5\ntasks:\n"
    task = "  - {{name: {0}, data: {{path: {1}}}, batch_size: 3, context_length: 64, eval: {{split: 0.2}}{2}}}\n"
    launch_yaml = "".join(task.format(n, tmp_path / f"{n}.jsonl", "") for n in ("chat", "docsum"))
    added_yaml = launch_yaml + task.format("joined", tmp_path / "joined.jsonl", ", start_step: 3")
    (tmp_path / "launch.yaml").write_text(head + launch_yaml)
    (tmp_path / "after.yaml").write_text(head + added_yaml)
    launch_spec, after_spec = (load_workload(tmp_path / f).spec for f in ("launch.yaml", "after.yaml"))
    tokenizer = data_stream.task_tokenizer(after_spec)

    launched = data_stream.training_streams(launch_spec, 16, tokenizer)
    live = launched.changed(after_spec.tasks, lambda t: prepare_task_data(t, tokenizer, "queue"), {}, (), {})
    resumed = data_stream.training_streams(after_spec, 16, tokenizer)
    resumed.check_state(live.state_dict(8))  # a checkpoint at step 8 of the live run: this data is where it left it
    held = {s.data.name: set(_tokens(s.data.eval_examples)) for s in live.streams}
    assert all(len(v) > 0 for v in held.values()) and set(held) == {"chat", "docsum", "joined"}
    for streams in (launched, resumed):
        assert {s.data.name: set(_tokens(s.data.eval_examples)) for s in streams.streams}.items() <= held.items()
    for step in range(16):
        drawn = []
        for streams in (live, resumed):
            batch = streams.global_batch(step)
            examples = streams.examples(batch.task_ids, batch.sample_ids)
            names = [streams.streams[t].data.name for t in batch.task_ids.tolist()]
            assert not any(token in held[n] for n, token in zip(names, _tokens(examples), strict=True)), step
            drawn.append(list(zip(names, _tokens(examples), strict=True)))
        assert drawn[0] == drawn[1], step  # the resume trains the rows the uninterrupted run does
        assert ("joined" in {n for n, _ in drawn[0]}) == (step >= 3)
