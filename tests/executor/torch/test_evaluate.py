"""An evaluation on the running fleet (``executor.torch.evaluate``) equals PEFT's on the same rows, and changes nothing.

One gloo world of 4 ranks holds a TP2 replica and a PP2 replica; every task's held-out rows are split across both
(sequence ``i`` to replica ``i mod 2``), in padded and in packed micro-batches. After two steps each task is
evaluated and its adapter kept as its best, then it trains a third step. In the parent process, PEFT loads each
task's kept adapter (``<task>/best/`` of the last checkpoint) over the same base, and its mean token loss over the
same rows is the fleet's to 1e-5 (fp32, relative): joint evaluation does not change a tenant's number. A run without
the evaluation ends with bitwise the same adapters: an evaluation moves no training state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file
from torch.nn import functional as F

from lorafleet.data.tokenize import IGNORE_INDEX
from lorafleet.executor.torch.worker import ExecutorConfig, TorchExecutor
from lorafleet.runtime.data_stream import DataStreams
from tests.helpers.fleet_harness import (
    BATCH_SIZES,
    TASKS,
    Run,
    build_model,
    make_step_plan,
    plan_of,
    run_world,
    synthetic_task,
)

pytestmark = pytest.mark.slow

# One task with adapter dropout: an evaluation runs without it, as PEFT's model in eval mode does.
EVAL_TASKS = (replace(TASKS[0], lora=TASKS[0].lora.model_copy(update={"dropout": 0.2})), *TASKS[1:])
LENGTHS = [(4, 12), (10, 24), (6, 16), (4, 12)]


def _streams() -> DataStreams:
    tasks = [
        replace(
            synthetic_task(t.name, 20, LENGTHS[i], 7 + i),
            eval_examples=synthetic_task(t.name, 5 + i, LENGTHS[i], 100 + i).examples,
        )
        for i, t in enumerate(EVAL_TASKS)
    ]
    return DataStreams(tasks, BATCH_SIZES, 7)


@dataclass(frozen=True)
class Case:
    run: Run
    evaluate: bool


def _body(case: Case):
    run = case.run
    config = ExecutorConfig(plan=run.plan, tasks=EVAL_TASKS, seed=run.seed, base_model="tiny-llama")
    executor = TorchExecutor(config, build_model(), _streams(), torch.device("cpu"))
    if dist.get_rank() != 0:
        executor.serve()
        return None
    n = len(run.plan.replicas)

    def steps(first: int, last: int) -> None:
        for s in range(first, last):
            batch = executor.next_global_batch(s)
            executor.run_steps([make_step_plan(batch, n, per_microbatch=run.per_microbatch, packed=run.packed)])

    steps(0, 2)
    outcome = None
    if case.evaluate:
        names = [t.name for t in EVAL_TASKS]
        batch = executor.eval_batch(2, names)
        outcome = executor.evaluate(
            make_step_plan(batch, n, per_microbatch=run.per_microbatch, packed=run.packed), batch
        )
        executor.keep_best(names)
    steps(2, 3)
    executor.save_checkpoint(Path(run.out), 3, wait=True)
    executor.close()
    return outcome


def _peft_eval(adapter: Path, task: int) -> tuple[float, float]:
    """PEFT's mean token loss and token accuracy over task ``task``'s held-out rows, one row at a time."""
    model = PeftModel.from_pretrained(build_model(), adapter).eval()
    loss = correct = tokens = 0.0
    for example in _streams().streams[task].data.eval_examples:
        ids = torch.tensor([example.input_ids])
        targets = torch.tensor(example.labels[1:])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].double()
        keep = targets != IGNORE_INDEX
        loss += float(F.cross_entropy(logits[keep], targets[keep], reduction="sum"))
        correct += float((logits[keep].argmax(-1) == targets[keep]).sum())
        tokens += int(keep.sum())
    return loss / tokens, correct / tokens


def test_the_fleets_evaluation_is_peft_s_on_the_same_rows_and_moves_nothing(tmp_path):
    plan = plan_of((2, 1), (1, 2))  # a TP2 replica on ranks 0-1, a PP2 replica on ranks 2-3
    cases = [
        Case(Run(plan, 3, packed=packed, out=str(tmp_path / f"{packed}-{evaluate}")), evaluate)
        for packed in (False, True)
        for evaluate in (True, False)
    ]
    outcomes = run_world(4, cases, tmp_path, body=_body)
    for case, outcome in zip(cases, outcomes, strict=True):
        if not case.evaluate:
            continue
        out = Path(case.run.out) / "step-000003"
        for t, task in enumerate(EVAL_TASKS):
            loss, accuracy = _peft_eval(out / task.name / "best", t)
            assert outcome.loss[task.name] == pytest.approx(loss, rel=1e-5), (case.run.packed, task.name)
            assert abs(outcome.token_accuracy[task.name] - accuracy) <= 1 / outcome.tokens[task.name]
            assert outcome.rows[task.name] == 5 + t
            best = load_file(out / task.name / "best" / "adapter_model.safetensors")
            last = load_file(out / task.name / "adapter_model.safetensors")
            assert any(not torch.equal(best[k], last[k]) for k in best)  # the third step moved it on
            without = Path(str(case.run.out).replace("-True", "-False")) / "step-000003" / task.name
            trained_alone = load_file(without / "adapter_model.safetensors")
            assert all(torch.equal(last[k], trained_alone[k]) for k in last)  # the evaluation moved nothing
        assert len(outcome.replica_busy_s) == 2 and min(outcome.replica_busy_s) > 0
