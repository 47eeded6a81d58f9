"""The probe before the first step: the whole step untimed at its own shapes, then the timed cut passes,
and nothing trained (``train/probe.py``)."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lorafleet.costmodel import load_cost_model
from lorafleet.dispatch import dispatch_step
from lorafleet.dispatch.recalibration import Recalibrator
from lorafleet.eval_replay import dispatch_evaluation, forward_seconds
from lorafleet.executor.torch.worker import ExecutorConfig, TorchExecutor, check_step_plan
from lorafleet.runtime.data_stream import DataStreams
from lorafleet.specs.model import MODEL_PRESETS
from lorafleet.train.probe import PROBE_TIMINGS, probe, probe_forward, probe_plan
from tests.helpers import fleet_harness as h

REPO = Path(__file__).resolve().parents[2]


def _probe_in_a_world_of_one(_rank: int, init_file: str, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        plan = h.plan_of((1, 1), max_tokens=48)  # a step of several micro-batches
        cost_model = load_cost_model(REPO / "profiles" / "tiny-llama-cpu.json", MODEL_PRESETS["tiny-llama"], None, None)
        config = ExecutorConfig(plan=plan, tasks=h.TASKS, seed=0, base_model="tiny-llama")
        held_out = [replace(s.data, eval_examples=s.data.examples[:5]) for s in h.synthetic_streams().streams]
        streams = DataStreams(held_out, h.BATCH_SIZES, 7)
        executor = TorchExecutor(config, h.build_model(), streams, torch.device("cpu"))
        before = [p.detach().clone() for t in range(len(h.TASKS)) for p in executor.replica.task_params(t)]
        ran, evaluated = [], []
        run_probe, run_evaluation = executor.probe, executor.evaluate
        executor.probe = lambda step_plan, batch: ran.append(step_plan) or run_probe(step_plan, batch)
        executor.evaluate = lambda step_plan, batch: evaluated.append(step_plan) or run_evaluation(step_plan, batch)
        recalibrator = Recalibrator(1)
        probe(executor, plan, cost_model, recalibrator, 0)
        names = [t.name for t in h.TASKS]
        forward = probe_forward(executor, plan, cost_model, recalibrator.factors, 0, names)
        batch = executor.streams.global_batch(0)
        full = dispatch_step(batch, plan, cost_model)
        check_step_plan(ran[0], batch, 1)  # every sequence of the step, once
        after = [p.detach() for t in range(len(h.TASKS)) for p in executor.replica.task_params(t)]
        evaluation = dispatch_evaluation(executor.eval_batch(0, names), plan, cost_model, recalibrator.factors)
        result = {
            "warm-up": [w.microbatches for w in ran[0].work],
            "timed": [[w.microbatches for w in r.work] for r in ran[1:]],
            "full": [w.microbatches for w in full.work],
            "cut": [w.microbatches for w in probe_plan(full, plan, cost_model).work],
            "evaluation": [w.microbatches for w in evaluation.work],
            "forward timed": [[w.microbatches for w in r.work] for r in evaluated],
            "forward": forward,
            "step speed": recalibrator.factors,
            "forward predicted": forward_seconds(evaluated[0], plan, cost_model),
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "steps taken": [o.steps_taken for o in executor.optimizers],
        }
        executor.close()
        Path(result_file).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """What :func:`_probe_in_a_world_of_one` recorded (one process for the module's tests)."""
    tmp = tmp_path_factory.mktemp("probe")
    mp.start_processes(
        _probe_in_a_world_of_one, args=(str(tmp / "init"), str(tmp / "result.pkl")), nprocs=1, start_method="fork"
    )
    return pickle.loads((tmp / "result.pkl").read_bytes())


def test_the_probe_warms_up_on_the_whole_first_step_then_times_the_cut(probed):
    """The untimed pass is step 0's whole dispatch (every micro-batch at its shapes: what the first step
    would otherwise meet first), the timed ones its cut; no adapter moves and no optimizer steps."""
    result = probed
    assert result["warm-up"] == result["full"] and len(result["full"][0]) > 1
    assert result["timed"] == [result["cut"]] * PROBE_TIMINGS and len(result["cut"][0]) == 1
    assert result["unchanged"] and result["steps taken"] == [0] * len(h.TASKS)


def test_the_probe_times_the_first_micro_batch_of_an_evaluation_forward_only(probed):
    """The forward probe: each replica's first micro-batch of an evaluation of every task's held-out rows, timed
    ``PROBE_TIMINGS`` times by the executor's evaluation; it records the measured busy time against the cost model's
    forward-only time of that micro-batch, and trains nothing."""
    (evaluation,), forward = probed["evaluation"], probed["forward"]
    assert len(evaluation) > 1  # the cut is a part of the pass
    assert len(probed["forward timed"]) == PROBE_TIMINGS
    for ((mb,),) in probed["forward timed"]:
        assert (mb.task_ids, mb.lengths, mb.padded_len) == (evaluation[0].task_ids, evaluation[0].lengths, None)
    assert forward.predicted_s == probed["forward predicted"] and forward.predicted_s[0] > 0
    assert forward.measured_s[0] > 0 and forward.step_speed == probed["step speed"]  # the step probe's c_r
    assert forward.relative_speed == (forward.measured_s[0] / forward.predicted_s[0] / forward.step_speed[0],)
    assert probed["unchanged"] and probed["steps taken"] == [0] * len(h.TASKS)


def test_the_forward_probes_cut_is_each_replicas_first_rows_and_covers_its_own_batch():
    """``first_microbatches``: each replica's first micro-batch, its first rows within the tokens, and a batch of
    exactly those rows (an evaluation's plan must cover its batch), their tasks and sample ids kept."""
    from lorafleet.train.probe import first_microbatches

    batch = h.synthetic_streams().global_batch(0)
    full = h.make_step_plan(batch, 2, per_microbatch=3, packed=True)
    cut, rows = first_microbatches(full, batch, tokens=20)
    check_step_plan(cut, rows, 2)
    for whole, part in zip(full.work, cut.work, strict=True):
        (mb,) = part.microbatches
        first = whole.microbatches[0]
        assert mb.lengths == first.lengths[: len(mb.lengths)] and (sum(mb.lengths) <= 20 or len(mb.lengths) == 1)
        assert [int(rows.sample_ids[q]) for q in mb.seq_ids] == [
            int(batch.sample_ids[q]) for q in first.seq_ids[: len(mb.lengths)]
        ]
    assert sum(len(w.microbatches[0].lengths) for w in cut.work) < sum(
        len(w.microbatches[0].lengths) for w in full.work
    )
