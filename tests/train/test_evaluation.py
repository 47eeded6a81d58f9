"""Evaluation and early stopping end to end (``train.evaluation``): ``lorafleet train`` on two tasks of the tiny
Llama, ``docsum`` evaluated every 4 of its steps and ``chat`` (24 rows, 6 held out, rank 16 at a high learning rate)
after each of its steps, with early stopping (patience 2).

- ``chat``'s eval loss falls to a minimum at its third evaluation, then rises: it stops ``patience`` evaluations
  after that minimum; it leaves the run at that boundary through the departure path (``changes.jsonl``), its best
  adapter (the minimum's, not the first evaluation's) is the one exported, and PEFT measures on it the loss the run
  recorded as the minimum. The curve is the tiny model's: its frozen random LM head bounds how far a LoRA moves a
  logit (the eval loss stays within 0.4 of ln 1024), so the fall and the rise are a few hundredths, not a real
  model's overfitting, but they are the same on every run (CPU, bitwise);
- the run is killed once (rank 0, between an evaluation and its checkpoint, during the patience) and resumed, and
  ends with the same stop step and bitwise the same adapters (best and last) as an uninterrupted run in which
  ``chat`` left by a queued finish at that step;
- the live page (``--queue-http``'s ``/``) over that run's files, in headless Chromium, shows ``metrics.jsonl``'s
  numbers, and nothing to a wrong token.
"""

from __future__ import annotations

import json
import os
import shutil
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
from lorafleet.train.queue import start_queue_server
from lorafleet.workload import load_workload
from tests.helpers.browser import rendered_page
from tests.helpers.repo import DEMO

pytestmark = pytest.mark.slow

STEPS = 12
PATIENCE = 2
MINIMUM = 3
"""The step after which ``chat``'s evaluation is its lowest (its third: it evaluates after each of its steps)."""


def _workload(root: Path, tokenizer: Path, *, early: bool = True) -> Path:
    few = root / "few.jsonl"
    few.write_text("".join((DEMO / "chat.jsonl").read_text().splitlines(keepends=True)[:24]))
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
        f"lora: {{rank: 16, alpha: 32}}, optimizer: {{lr: 3.0e-2}}, eval: {{split: 0.25, every_steps: 1}}{stopping}}}\n"
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
    env = {FAULT_ENV: f"evaluated@{MINIMUM + 1}", FAULT_ONCE_ENV: str(root / "once")}  # the patience's first
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
    assert evals[best][0] == MINIMUM and losses[best] < losses[0]  # it fell to a minimum after its first evaluation
    assert losses[best] < losses[best + 1] < losses[best + 2]  # then rose
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


def test_the_live_page_shows_the_runs_numbers_in_a_browser(early, tmp_path):
    """The live page of ``--queue-http`` (``train.queue.fleet_view``) opened in headless Chromium over this run's
    files (the killed and resumed one: its ``metrics.jsonl`` cut back and appended to): each tenant's steps, last
    loss, loss curve, evaluations and GPU-seconds are ``metrics.jsonl``'s, to the last digit in the page's
    ``data-value`` and as rounded in its text; its state is how it left; the replica's utilisation is its busy time
    over the steps'; the queue's pending and rejected requests are listed. A wrong token gets no data."""
    root, _ = early
    run = tmp_path / "run"
    shutil.copytree(root / "out", run, ignore=shutil.ignore_patterns("adapters", "checkpoints", "tensorboard"))
    queue = run / "queue"
    (queue / "rejected").mkdir(parents=True, exist_ok=True)
    (queue / "later.json").write_text(json.dumps({"action": "cancel", "name": "docsum"}))
    (queue / "rejected" / "ghost.json").write_text(json.dumps({"action": "cancel", "name": "nobody"}))
    (queue / "rejected" / "ghost.json.reason").write_text("no active task 'nobody' in this run\n")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with start_queue_server(queue, run) as server:
        page = rendered_page(f"{server.url}/#token={server.token}")
        denied = rendered_page(f"{server.url}/#token=not-{server.token}")

    assert page.one(id="status").attrs["data-state"] == "ok"
    assert int(page.one(data_field="steps-done", within=page.one(id="run")).attrs["data-value"]) == STEPS
    for task, state in (("docsum", "done"), ("chat", "stopped early")):
        row, chart = page.one("tr", data_tenant=task), page.one("div", data_tenant=task)
        losses = [(r["step"] + 1, r["losses"][task]) for r in rows if task in r["losses"]]
        cells = {e.attrs["data-field"]: e for e in page.find(within=row) if "data-field" in e.attrs}
        assert cells["state"].text == state
        assert int(cells["steps-done"].attrs["data-value"]) == len(losses)
        assert float(cells["loss"].attrs["data-value"]) == losses[-1][1]
        assert float(cells["loss"].text) == float(f"{losses[-1][1]:.4g}")
        gpu_s = sum(r["task_gpu_s"].get(task, 0) + r.get("eval_gpu_s", {}).get(task, 0) for r in rows)
        assert float(cells["gpu-s"].attrs["data-value"]) == pytest.approx(gpu_s, rel=1e-12)
        assert float(cells["gpu-s"].text) == float(f"{gpu_s:.4g}")
        curve = page.one(within=chart, data_field="loss-curve")
        assert [int(s) for s in curve.attrs["data-steps"].split(",")] == [s for s, _ in losses]
        assert [float(v) for v in curve.attrs["data-values"].split(",")] == [v for _, v in losses]
        points = page.find(within=chart, data_field="eval-point")
        assert [(int(p.attrs["data-step"]), float(p.attrs["data-value"])) for p in points] == _evals(run, task)
    utilisation = sum(r["replica_busy_s"][0] for r in rows) / sum(r["makespan_s"] for r in rows)
    assert float(page.one(data_field="utilisation").attrs["data-value"]) == pytest.approx(utilisation, rel=1e-12)
    assert [e.attrs["data-file"] for e in page.find("li", within=page.one(id="pending"))] == ["later.json"]
    (rejected,) = page.find(within=page.one(id="rejected"), data_file="ghost.json")
    assert "no active task 'nobody'" in rejected.text

    assert denied.one(id="status").attrs["data-state"] == "error"
    assert not denied.find(data_tenant="docsum") and not denied.find(data_field="loss")


def test_the_metrics_hold_each_tasks_learning_rate_gradient_norm_and_epoch(early):
    """Each row of the run (killed and resumed) holds, for each task it updated, the learning rate of its schedule
    at its own step (cosine over its own 12 steps), its gradient norm, and its epochs done (the rows its batches drew
    over its rows: a fixed step of batch size over rows), and the run's record says both tasks finish (#42)."""
    from lorafleet.executor.torch.optim import lr_at

    root, workload = early
    out = root / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spec = {t.name: t.spec for t in load_workload(workload).tasks}
    record = {t["name"]: t for t in json.loads((out / "run_length.json").read_text())["tasks"]}
    for task in ("docsum", "chat"):
        ran = [r for r in rows if task in r["losses"]]
        assert [r["task_lr"][task] for r in ran] == [lr_at(spec[task].optimizer, k, STEPS) for k in range(len(ran))]
        assert all(0 < r["task_grad_norm"][task] < float("inf") for r in ran)
        epochs = [r["task_epoch"][task] for r in ran]
        per_step = spec[task].batch_size / record[task]["rows"]
        assert epochs == pytest.approx([per_step * (k + 1) for k in range(len(ran))], rel=1e-12)
        assert record[task]["own_steps"] == STEPS and record[task]["finishes"]
