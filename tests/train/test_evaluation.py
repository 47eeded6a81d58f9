"""Evaluation and early stopping end to end (``train.evaluation``): ``lorafleet train`` on two tasks of the tiny
Llama, ``docsum`` evaluated every 4 of its steps and ``chat`` (16 rows, a high learning rate: it gets worse on its
held-out rows) every 2, with early stopping (patience 2).

- ``chat`` stops within ``patience`` evaluations of its minimum; it leaves the run at that boundary through the
  departure path (``changes.jsonl``), its best adapter is the one exported, and PEFT measures on it the loss the run
  recorded as the minimum;
- the run is killed once (rank 0, between an evaluation and its checkpoint, during the patience) and resumed, and
  ends with the same stop step and bitwise the same adapters (best and last) as an uninterrupted run in which
  ``chat`` left by a queued finish at that step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.nn import functional as F

from lorafleet.cli import main
from lorafleet.data.model_source import data_tokenizer, resolve_model_source
from lorafleet.data.tokenize import IGNORE_INDEX
from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.runtime.data_stream import prepare_task_data
from lorafleet.runtime.processes import FAULT_ENV, FAULT_ONCE_ENV
from lorafleet.train.change_log import STOPPED_EARLY, ChangeKind, read_changes
from lorafleet.workload import load_workload
from tests.helpers.repo import DEMO

pytestmark = pytest.mark.slow

STEPS = 12
PATIENCE = 2


def _workload(root: Path, tokenizer: Path, *, early: bool = True) -> Path:
    few = root / "few.jsonl"
    few.write_text("".join((DEMO / "chat.jsonl").read_text().splitlines(keepends=True)[:16]))
    stopping = f", early_stopping: {{patience: {PATIENCE}, warmup_evals: 1}}" if early else ""
    path = root / ("early.yaml" if early else "plain.yaml")
    path.write_text(
        "model: tiny-llama\n"
        f"tokenizer: {tokenizer}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 1}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-2}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256, "
        f"steps: {STEPS}, eval: {{split: 0.05, every_steps: 4}}}}\n"
        f"  - {{name: chat, data: {{path: {few}}}, batch_size: 4, context_length: 128, steps: {STEPS}, "
        f"optimizer: {{lr: 3.0e-2}}, eval: {{split: 0.25, every_steps: 2}}{stopping}}}\n"
    )
    return path


def _train(workload: Path, out: Path, *extra: str, env: dict | None = None, ok: bool = True):
    plan = workload.with_suffix(".plan.json")
    if not plan.exists():
        assert main(["plan", str(workload), "--json", str(plan)]) == 0
    argv = ["train", str(workload), "--plan", str(plan), "--steps", str(STEPS), "--out", str(out), "--no-progress",
            "--checkpoint-every", "2", "--no-recalibrate", *extra]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "lorafleet", *argv], cwd=out.parent, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})  # fmt: skip
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


def _evals(out: Path, task: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"] + 1, r["eval_loss"][task]) for r in rows if task in r.get("eval_loss", {})]


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def _same(a: Path, b: Path) -> bool:
    x, y = _adapter(a), _adapter(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def early(tmp_path_factory, tiny_tokenizer_dir):
    """The early-stopping run, killed once (rank 0, between an evaluation and its checkpoint, during the patience)
    and resumed; and the same run uninterrupted, with ``chat`` leaving by a queued finish at the step it stopped at
    and no early stopping (its stop step found from the first run: the evaluations are the same in both)."""
    root = tmp_path_factory.mktemp("early")
    workload = _workload(root, tiny_tokenizer_dir)
    out = root / "out"
    env = {FAULT_ENV: f"evaluated@{2 * (PATIENCE + 1) - 2}", FAULT_ONCE_ENV: str(root / "once")}
    _train(workload, out, env=env, ok=False)
    assert (root / "once").exists()
    _train(workload, out, "--resume")
    stop = _evals(out, "chat")[-1][0]
    queued = root / "queued"
    (queued / "queue").mkdir(parents=True)
    (queued / "queue" / "finish.json").write_text(json.dumps({"action": "finish", "name": "chat", "at_step": stop}))
    _train(_workload(root, tiny_tokenizer_dir, early=False), queued)
    return root, workload


def test_a_task_that_gets_worse_stops_within_patience_of_its_minimum_and_leaves(early):
    root, _ = early
    out = root / "out"
    evals = _evals(out, "chat")
    losses = [loss for _, loss in evals]
    best = losses.index(min(losses))
    assert len(evals) - 1 - best == PATIENCE  # stopped at the patience-th evaluation after its minimum
    stop = evals[-1][0]
    recorded = json.loads((out / "evaluations.json").read_text())["chat"]  # what the HTTP API serves
    assert stop < STEPS and (recorded["stopped_at"], recorded["steps_not_taken"]) == (stop, STEPS - stop)
    assert [step for step, _, _ in recorded["history"]] == [step for step, _ in evals]
    (row,) = [r for r in read_changes(out / "changes.jsonl") if r.kind is ChangeKind.DEPARTURE]
    assert (row.step, [(q.action.value, q.name, q.file) for q in row.requests]) == (
        stop, [("finish", "chat", STOPPED_EARLY)],
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))  # the resumed run counts every step once
    assert all("chat" not in r["task_tokens"] for r in rows if r["step"] >= stop)  # it took no more steps


def test_the_exported_adapter_is_the_best_and_peft_measures_the_recorded_minimum(early):
    root, workload = early
    out = root / "out"
    chat = out / "adapters" / "chat"
    assert not _same(chat, chat / "last")
    spec = load_workload(workload).task("chat").spec
    tokenizer = data_tokenizer("tiny-llama", load_workload(workload).spec.tokenizer, source="test")
    rows = prepare_task_data(spec, tokenizer, "test").eval_examples
    model = PeftModel.from_pretrained(load_causal_lm(resolve_model_source("tiny-llama")), chat).eval()
    loss = tokens = 0.0
    for example in rows:
        targets = torch.tensor(example.labels[1:])
        with torch.no_grad():
            logits = model(torch.tensor([example.input_ids])).logits[0, :-1].double()
        keep = targets != IGNORE_INDEX
        loss += float(F.cross_entropy(logits[keep], targets[keep], reduction="sum"))
        tokens += int(keep.sum())
    assert loss / tokens == pytest.approx(min(loss for _, loss in _evals(out, "chat")), rel=1e-5)
    card = (chat / "README.md").read_text()
    assert "Best evaluation (this adapter)" in card and "Stopped early at step" in card


def test_killed_and_resumed_it_ends_as_the_run_where_it_left_by_a_queued_finish(early):
    """The same evaluations, the same stop step, and bitwise the same adapters (best and last) as the uninterrupted
    run in which a queued finish took ``chat`` out at that step: the other tenant trains as if it had been asked."""
    root, _ = early
    out, queued = root / "out", root / "queued"
    assert _evals(out, "chat") == _evals(queued, "chat")
    assert _evals(out, "docsum") == _evals(queued, "docsum")
    for task in ("chat", "docsum"):
        for view in ("", "last"):
            assert _same(out / "adapters" / task / view, queued / "adapters" / task / view), (task, view)
