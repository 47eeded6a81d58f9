"""When rank 0 evaluates (``train.evaluation.Evaluations``): due steps from the tasks' own steps, named ahead so the
loop's windows end there, and what an evaluation leads to (best kept, stop), with a fake fleet."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from lorafleet.data.tokenize import Example
from lorafleet.runtime.data_stream import DataStreams, TaskData
from lorafleet.specs.workload import TaskSpec
from lorafleet.train.change_log import STOPPED_EARLY
from lorafleet.train.evaluation import Evaluations

END = 60


def _spec(name: str, every: int, steps: int | None = None, share: float | None = None) -> TaskSpec:
    return TaskSpec(name=name, lengths={"values": [8]}, batch_size=2, context_length=16, steps=steps, share=share,
                    eval={"every_steps": every}, early_stopping={"patience": 2, "warmup_evals": 0})  # fmt: skip


def _data(name: str, length: int) -> TaskData:
    return TaskData(name, tuple(Example((1,) * length, (1,) * length) for _ in range(6)))


@dataclass
class FakePort:
    """The streams of three tasks: one unbounded, one that ends at 20 steps, one with a share."""

    streams: DataStreams
    names: tuple[str, ...] = ("a", "b", "c")

    def batches_taken(self, name, step):
        return self.streams.batches_taken(self.names.index(name), step)

    def max_batches(self, name):
        return self.streams.max_batches[self.names.index(name)]

    def eval_batch(self, step, names):
        raise AssertionError("the schedule evaluates nothing (run() is tested through the fleet)")

    evaluate = keep_best = eval_batch


@pytest.fixture
def port():
    specs = [_spec("a", 5), _spec("b", 3, steps=20), _spec("c", 4, share=0.3)]
    streams = DataStreams([_data("a", 4), _data("b", 8), _data("c", 12)], [2, 2, 2], 0, [None, 20, None],
                          shares=[None, None, 0.3])  # fmt: skip
    return specs, FakePort(streams)


def test_next_boundary_is_the_first_step_due_by_a_brute_force_scan(port):
    specs, fake = port
    evaluations = Evaluations(fake, END)
    due = {b: evaluations.due(b, specs) for b in range(1, END + 1)}
    assert (
        due[5] == ["a"] and due[3] == ["b"] and "b" in due[20] and not any("b" in d for b, d in due.items() if b > 20)
    )
    took_last = fake.batches_taken("c", END) > fake.batches_taken("c", END - 1)
    assert due[END] == (["a", "c"] if took_last else ["a"])  # the run's last step: each task that took a batch in it
    c_steps = [b for b, d in due.items() if "c" in d]
    assert fake.batches_taken("c", END) < END - 10  # its share skips steps
    assert len(c_steps) >= 3 and all(fake.batches_taken("c", b) % 4 == 0 or b == END for b in c_steps)
    for step in range(END):
        expected = min((b for b, d in due.items() if b > step and d), default=None)
        assert evaluations.next_boundary(step, specs) == expected, step


def test_a_stopped_task_is_due_no_more(port):
    specs, fake = port
    evaluations = Evaluations(fake, END)
    from lorafleet.stopping import Stopping
    from lorafleet.train.evaluation import TaskEvaluations

    evaluations.tasks["a"] = TaskEvaluations(Stopping(3, 1.0, 5, 2, True), ((5, 1.0, 0.5),), 15, 45)
    assert all("a" not in evaluations.due(b, specs) for b in range(1, END + 1))
    restored = Evaluations(fake, END)
    restored.load_state_dict(evaluations.state_dict())
    assert restored.tasks == evaluations.tasks and restored.stopped_early() == {"a": (15, STOPPED_EARLY)}
    assert np.isfinite(restored.tasks["a"].stopping.best_loss)


def test_a_sweeps_rungs_and_dropped_members_survive_a_checkpoint(port):
    """What a rung decided is in the checkpoint's state: a resumed run knows the dropped members (they are due no
    more and leave as dropped, not stopped early) and the rungs decided so far."""
    from lorafleet.stopping import Stopping
    from lorafleet.sweeps import decide_rung
    from lorafleet.train.change_log import SWEEP_DROPPED
    from lorafleet.train.evaluation import TaskEvaluations

    specs, fake = port
    evaluations = Evaluations(fake, END)
    rung = decide_rung("s", 1, 10, {"a": 2.0, "b": 1.0}, {"a": 0, "b": 1}, 2)
    evaluations.rungs.append(rung)
    evaluations.tasks["a"] = TaskEvaluations(Stopping(1, 2.0, 10, 0, False, True), ((10, 2.0, 0.1),), 10, 50, 1)
    restored = Evaluations(fake, END)
    restored.load_state_dict(evaluations.state_dict())
    assert restored.rungs == [rung] and restored.tasks == evaluations.tasks
    assert restored.stopped_early() == {"a": (10, SWEEP_DROPPED)}
    assert all("a" not in restored.due(b, specs) for b in range(1, END + 1))


@dataclass
class TimedPort:
    """Every task takes a batch every step; an evaluation of any rows is measured to take :attr:`seconds`."""

    seconds: float = 0.5

    def batches_taken(self, name, step):
        return step

    def max_batches(self, name):
        return None

    def eval_batch(self, step, names):
        from lorafleet.sampling import TaskDraw, global_batch

        return global_batch(step, [(k, 0, TaskDraw(np.array([12, 20, 9]), 0, 0)) for k in range(len(names))])

    def evaluate(self, step_plan, batch):
        from types import SimpleNamespace

        tasks = ("a", "b")
        return SimpleNamespace(loss=dict.fromkeys(tasks, 1.0), token_accuracy=dict.fromkeys(tasks, 0.5),
                               tokens=dict.fromkeys(tasks, 41), rows=dict.fromkeys(tasks, 3),
                               replica_busy_s=(self.seconds,), seconds=self.seconds)  # fmt: skip

    def keep_best(self, names):
        pass


def test_the_first_evaluation_is_predicted_at_the_probes_forward_speed(tmp_path):
    """The first evaluation's ``eval_predicted_s`` is the cost model's forward time at the steps' speed ``c`` times the
    launch probe's relative forward speed ``rho`` (``train.probe.ForwardProbe``), where without a probe it is at ``c``
    alone; the next is corrected by the first's measure either way; a probe of another deployment is not used."""
    import yaml

    from lorafleet.costmodel import load_cost_model
    from lorafleet.dispatch import Recalibrator
    from lorafleet.eval_replay import dispatch_evaluation, forward_seconds
    from lorafleet.plans import StepReport
    from lorafleet.specs.model import MODEL_PRESETS
    from lorafleet.train.probe import ForwardProbe
    from lorafleet.train.running import Running
    from lorafleet.workload import load_workload
    from tests.helpers import fleet_harness as h
    from tests.helpers.repo import REPO

    task = {"lengths": {"values": [12, 20, 9]}, "batch_size": 2, "context_length": 64, "eval": {"every_steps": 1}}
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny-llama", "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 1},
                                    "tasks": [{"name": "a", **task}, {"name": "b", **task}]}))  # fmt: skip
    plan = h.plan_of((1, 1), max_tokens=32)
    cost_model = load_cost_model(REPO / "profiles" / "tiny-llama-cpu.json", MODEL_PRESETS["tiny-llama"], None, None)
    port = TimedPort()
    step_plan = dispatch_evaluation(port.eval_batch(1, ["a", "b"]), plan, cost_model)
    (model_s,) = forward_seconds(step_plan, plan, cost_model)
    recalibrator = Recalibrator.for_plan(plan)
    recalibrator.observe(step_plan, StepReport(0, (1.25 * step_plan.base_estimate(0),), 0.0))  # c = 1.25
    running = Running(load_workload(path), plan, cost_model, recalibrator)

    def predictions(probed):
        evaluations = Evaluations(port, END, probed=probed)
        return [evaluations.run(b, running) == [] and evaluations.row_extra()["eval_predicted_s"] for b in (1, 2)]

    rho_2 = ForwardProbe(plan, measured_s=(0.3,), predicted_s=(0.1,), step_speed=(1.5,))  # phi 3, rho 2
    assert predictions(rho_2) == pytest.approx([1.25 * 2 * model_s, port.seconds])
    assert predictions(None) == pytest.approx([1.25 * model_s, port.seconds])
    assert predictions(replace(rho_2, plan=h.plan_of((1, 1), max_tokens=64))) == pytest.approx(
        [1.25 * model_s, port.seconds]
    )
