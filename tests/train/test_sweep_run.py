"""A sweep trained end to end (``specs.sweep``, ``lorafleet.sweeps``, ``train.promote``): ``lorafleet train`` on the
tiny Llama with ``docsum`` beside a 6-member sweep of ``chat`` (3 learning rates x 2 ranks), halving with eta 3 after
every 2 of the members' steps, evaluated every 3 (off the rungs' grid: each rung boundary is evaluated all the same,
``lorafleet.eval_schedule``).

- every member trains on the same batches at the same steps while it is in the run;
- the members still training are evaluated at each of the two rungs the 6 can decide (steps 2 and 4) and at every
  3 steps, the winner at none after its last rung but 6 and its last (8);
- each rung keeps the best ``max(1, floor(n / 3))`` by the eval losses the run recorded (best so far), and the
  others leave at that boundary through the departure path (``changes.jsonl``: ``(dropped by its sweep)``);
- the winner, by the same rule over the whole run, is promoted: ``adapters/chat/`` is bitwise its best adapter,
  every member's is kept under ``adapters/chat/members/``, the card names the winning values and holds the table,
  and ``lorafleet sweep-report`` prints it; the sweep is one tenant in the GPU-seconds line.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet.cli import main
from lorafleet.sweeps import decide_rung, winner
from lorafleet.train.change_log import SWEEP_DROPPED, ChangeKind, read_changes
from tests.helpers.repo import DEMO

pytestmark = pytest.mark.slow

STEPS = 8
LRS, RANKS = ("1e-3", "0.01", "0.1"), (2, 4)
MEMBERS = [f"chat.lr={lr}.rank={rank}" for lr in LRS for rank in RANKS]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    workload = root / "sweep.yaml"
    workload.write_text(
        "model: tiny-llama\n"
        f"tokenizer: {tiny_tokenizer_dir}\n"
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 1}\n"
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-2}}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 3, context_length: 256, "
        f"steps: {STEPS}}}\n"
        f"  - name: chat\n    data: {{path: {DEMO / 'chat.jsonl'}}}\n    batch_size: 4\n    context_length: 128\n"
        f"    steps: {STEPS}\n    eval: {{split: 0.1, every_steps: 3, max_rows: 16}}\n"
        "    sweep:\n      grid: {optimizer.lr: [1.0e-3, 1.0e-2, 1.0e-1], lora.rank: [2, 4]}\n"
        "      halving: {eta: 3, rung_steps: 2}\n"
    )
    plan = root / "plan.json"
    assert main(["plan", str(workload), "--json", str(plan)]) == 0
    argv = ["train", str(workload), "--plan", str(plan), "--steps", str(STEPS), "--out", str(root / "out"),
            "--no-progress", "--no-recalibrate"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "lorafleet", *argv], cwd=root, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (root / "stdout.txt").write_text(proc.stdout)
    return root / "out"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_members_train_on_the_same_batches_and_rungs_drop_by_the_recorded_losses(run):
    rows = _rows(run)
    for row in rows:
        tokens = {row["task_tokens"][m] for m in MEMBERS if m in row["task_tokens"]}
        assert len(tokens) == 1, row["step"]  # every member still in the run: the same batch
    evaluations = json.loads((run / "evaluations.json").read_text())
    order = {m: i for i, m in enumerate(MEMBERS)}
    alive, best = list(MEMBERS), dict.fromkeys(MEMBERS, math.inf)
    departures = {r.step: r for r in read_changes(run / "changes.jsonl") if r.kind is ChangeKind.DEPARTURE}
    rungs = 0
    for row in rows:
        for name, loss in row.get("eval_loss", {}).items():
            if name in best:
                best[name] = min(best[name], loss)
        if "sweep_rung" not in row:
            continue
        rungs += 1
        boundary = row["step"] + 1
        rung = decide_rung("chat", rungs, boundary, {m: best[m] for m in alive}, order, 3)
        assert row["sweep_rung"] == {"chat": rungs} and set(row["sweep_dropped"]) == set(rung.dropped)
        assert row["sweep_scores"] == rung.to_json()["scores"]  # every judged member's score, as the rung ranked it
        assert {(q.name, q.file) for q in departures[boundary].requests} == {(m, SWEEP_DROPPED) for m in rung.dropped}
        assert all(evaluations[m]["dropped_rung"] == rungs and evaluations[m]["stopped_at"] == boundary
                   for m in rung.dropped)  # fmt: skip
        alive = list(rung.kept)
    assert rungs == 2 and len(alive) == 1  # 6 -> 2 -> 1
    assert winner(best, order) == alive[0]
    # off the every_steps grid: each rung boundary evaluated, none after the sweep is decided but the schedule's
    evaluated = {m: [s for s, _, _ in evaluations[m]["history"]] for m in MEMBERS}
    assert evaluated[alive[0]] == [2, 3, 4, 6, 8]
    assert sorted(evaluated[m] for m in MEMBERS if m != alive[0]) == [[2]] * 4 + [[2, 3, 4]]
    # the dropped take no batch after their rung
    for name in set(MEMBERS) - set(alive):
        assert all(name not in row["task_tokens"] for row in rows if row["step"] >= evaluations[name]["stopped_at"])


def test_the_winner_is_promoted_with_the_sweeps_table(run, capsys, tmp_path):
    result = json.loads((run / "adapters" / "chat" / "sweep.json").read_text())[0]
    name = result["winner"]
    evaluations = json.loads((run / "evaluations.json").read_text())
    best = {m: evaluations[m]["stopping"]["best_loss"] for m in MEMBERS}
    assert name == winner(best, {m: i for i, m in enumerate(MEMBERS)})
    top, member = run / "adapters" / "chat", run / "adapters" / "chat" / "members" / name
    assert sorted(p.name for p in (top / "members").iterdir()) == sorted(MEMBERS)
    for file in ("adapter_model.safetensors", "adapter_config.json", "last/adapter_model.safetensors"):
        assert (top / file).read_bytes() == (member / file).read_bytes()
    card = (top / "README.md").read_text()
    lr, rank = name.removeprefix("chat.lr=").split(".rank=")
    assert card.startswith("---") and "# chat\n" in card and f"`optimizer.lr` = {lr}, `lora.rank` = {rank}" in card
    assert card.count("\n| chat.lr=") == 6 and "| winner |" in card
    assert result["gpu_s"] == pytest.approx(sum(m["gpu_s"] for m in result["members"]))
    stdout = (run.parent / "stdout.txt").read_text()
    assert f"sweep chat: 6 members (5 dropped at rungs), {result['gpu_s']:.4g} GPU-s; winner {name}" in stdout
    assert " chat " in stdout.split("GPU-seconds by task")[1].split("\n")[0]  # one tenant
    assert main(["sweep-report", str(run), "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "sweep-chat.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert out.startswith(f"sweep chat: 6 members, successive halving (eta 3, a rung every 2 steps); winner {name}")
    assert out.count("\n| chat.lr=") == 6
