"""The probe before the first step: the whole step untimed at its own shapes, then the timed cut passes,
and nothing trained (``train/probe.py``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lorafleet.costmodel import load_cost_model
from lorafleet.dispatch import dispatch_step
from lorafleet.dispatch.recalibration import Recalibrator
from lorafleet.executor.torch.worker import ExecutorConfig, TorchExecutor, check_step_plan
from lorafleet.specs.model import MODEL_PRESETS
from lorafleet.train.probe import PROBE_TIMINGS, probe, probe_plan
from tests.helpers import fleet_harness as h

REPO = Path(__file__).resolve().parents[2]


def _probe_in_a_world_of_one(_rank: int, init_file: str, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        plan = h.plan_of((1, 1), max_tokens=48)  # a step of several micro-batches
        cost_model = load_cost_model(REPO / "profiles" / "tiny-llama-cpu.json", MODEL_PRESETS["tiny-llama"], None, None)
        config = ExecutorConfig(plan=plan, tasks=h.TASKS, seed=0, base_model="tiny-llama")
        executor = TorchExecutor(config, h.build_model(), h.synthetic_streams(), torch.device("cpu"))
        before = [p.detach().clone() for t in range(len(h.TASKS)) for p in executor.replica.task_params(t)]
        ran = []
        run_probe = executor.probe
        executor.probe = lambda step_plan, batch: ran.append(step_plan) or run_probe(step_plan, batch)
        probe(executor, plan, cost_model, Recalibrator(1), 0)
        batch = executor.streams.global_batch(0)
        full = dispatch_step(batch, plan, cost_model)
        check_step_plan(ran[0], batch, 1)  # every sequence of the step, once
        after = [p.detach() for t in range(len(h.TASKS)) for p in executor.replica.task_params(t)]
        result = {
            "warm-up": [w.microbatches for w in ran[0].work],
            "timed": [[w.microbatches for w in r.work] for r in ran[1:]],
            "full": [w.microbatches for w in full.work],
            "cut": [w.microbatches for w in probe_plan(full, plan, cost_model).work],
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "steps taken": [o.steps_taken for o in executor.optimizers],
        }
        executor.close()
        Path(result_file).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def test_the_probe_warms_up_on_the_whole_first_step_then_times_the_cut(tmp_path):
    """The untimed pass is step 0's whole dispatch (every micro-batch at its shapes: what the first step
    would otherwise meet first), the timed ones its cut; no adapter moves and no optimizer steps."""
    result_file = tmp_path / "result.pkl"
    mp.start_processes(
        _probe_in_a_world_of_one,
        args=(str(tmp_path / "init"), str(result_file)),
        nprocs=1,
        start_method="fork",
    )
    result = pickle.loads(result_file.read_bytes())
    assert result["warm-up"] == result["full"] and len(result["full"][0]) > 1
    assert result["timed"] == [result["cut"]] * PROBE_TIMINGS and len(result["cut"][0]) == 1
    assert result["unchanged"] and result["steps taken"] == [0] * len(h.TASKS)
