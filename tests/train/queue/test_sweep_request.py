"""A sweep added through the queue (``train.queue.watcher.read_requests``): one request file, its members added
together at one boundary and tokenized once (``train.joining``), or the whole file rejected with one reason."""

from __future__ import annotations

import pytest

from lorafleet.train.queue import Ledger, QueueWatcher
from lorafleet.train.running import Running
from lorafleet.work import counting
from tests.helpers.fake_fleet import due_when_ready, fleet_of
from tests.helpers.repo import DEMO

SWEEP = (
    "name: codegen\n"
    f"data: {{path: {DEMO / 'codegen.jsonl'}}}\n"
    "batch_size: 2\ncontext_length: 256\nat_step: 3\n"
    "eval: {split: 0.1, every_steps: 2}\n"
    "sweep: {grid: {optimizer.lr: [1.0e-3, 1.0e-2]EXTRA}, halving: {eta: 2, rung_steps: 2}}\n"
)


def test_a_sweep_request_adds_every_member_at_one_boundary_tokenized_once(tmp_path, tiny_tokenizer_dir):
    options, running, changes, fake = fleet_of(tmp_path, tiny_tokenizer_dir)
    (options.queue_dir / "sweep.yaml").write_text(SWEEP.replace("EXTRA", ", lora.rank: [2, 4]"))
    with counting() as work:
        assert due_when_ready(changes, 3, running)
        after = changes.at_boundary(3, running)
        changes.replan.running.answer()
    members = ["codegen.lr=1e-3.rank=2", "codegen.lr=1e-3.rank=4", "codegen.lr=0.01.rank=2", "codegen.lr=0.01.rank=4"]
    assert isinstance(after, Running) and after.names == ["docsum", "chat", *members]
    assert work["tokenizations"] == 1  # the members share their sweep's data
    assert sorted(fake.applied[0][3]) == sorted(members)
    assert {t.spec.member_of.sweep for t in after.workload.tasks if t.spec.member_of} == {"codegen"}
    assert (options.queue_dir / "accepted" / "sweep.yaml").is_file()


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (", lora.rank: [0]", "sweep.grid.lora.rank: value 0"),
        (", batch_size: [2]", "'batch_size' cannot be swept"),
    ],
)
def test_a_bad_sweep_request_is_rejected_whole(tmp_path, extra, reason):
    queue = tmp_path / "queue"
    queue.mkdir()
    (queue / "sweep.yaml").write_text(SWEEP.replace("EXTRA", extra))
    watcher = QueueWatcher(queue, {}, Ledger.of([]), log=lambda line: None)
    assert watcher.poll(5) == []
    assert reason in (queue / "rejected" / "sweep.yaml.reason").read_text()


def test_a_sweep_named_like_a_running_task_is_rejected(tmp_path, tiny_tokenizer_dir):
    queue = tmp_path / "queue"
    queue.mkdir()
    (queue / "sweep.yaml").write_text(SWEEP.replace("EXTRA", "").replace("name: codegen", "name: chat"))
    from lorafleet.specs.workload import TaskSpec

    chat = TaskSpec(name="chat", lengths={"values": [8]}, batch_size=2, context_length=16)
    watcher = QueueWatcher(queue, {}, Ledger.of([chat]), log=lambda line: None)
    assert watcher.poll(5) == []
    assert "task 'chat' is already in this run" in (queue / "rejected" / "sweep.yaml.reason").read_text()
