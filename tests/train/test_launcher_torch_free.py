"""The launcher of ``lorafleet train`` imports no torch when its tasks' data is in the token cache
(``data.length_cache``): loading the tokenizer to measure their lengths, or to count a run's steps from their
examples (no ``--steps``), is what imported transformers and torch."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

from lorafleet.data.length_cache import CACHE_ENV
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import prepare
from lorafleet.train.run_length import with_run_steps
from lorafleet.work import counting
from tests.helpers import fleet_harness as h
from tests.helpers.repo import DEMO, REPO

CHECK = """
import json, sys
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import prepare
from lorafleet.work import counting
from lorafleet.train.run_length import with_run_steps
with counting() as work:
    options = TrainOptions(workload=sys.argv[1], plan=sys.argv[2], out=sys.argv[3])
    prepared = prepare(options)
    steps = with_run_steps(options, prepared).steps
lengths = {t.name: t.histogram for t in prepared.workload.tasks}
imported = [m for m in ("torch", "transformers") if m in sys.modules]
print(json.dumps({"imported": imported, "tokenizations": work["tokenizations"], "lengths": lengths, "steps": steps}))
"""


def test_a_launcher_whose_lengths_are_cached_imports_no_torch(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """A first launch's checks tokenize the task and fill the cache; the next launcher's (a fresh process, as
    ``lorafleet train`` runs) tokenizes nothing, imports neither transformers nor torch, and resolves the lengths
    the tokenization gave and, without ``--steps``, the run's steps from the task's epochs over its examples."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\ncluster: {{gpu: cpu, nodes: 1, gpus_per_node: 1}}\n"
        f"tasks:\n  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128,"
        " epochs: 2}\n"
    )
    replace(h.plan_of((1, 1)), tasks=("chat",), bucket_boundaries=(128,)).save(tmp_path / "plan.json")
    args = [str(path), str(tmp_path / "plan.json"), str(tmp_path / "out")]
    with counting() as first:
        prepared = prepare(TrainOptions(workload=args[0], plan=args[1], out=args[2]))
    assert first["tokenizations"] == 1
    done = subprocess.run([sys.executable, "-c", CHECK, *args], capture_output=True, text=True, check=True, cwd=REPO)
    launcher = json.loads(done.stdout.splitlines()[-1])
    assert launcher["imported"] == [] and launcher["tokenizations"] == 0
    (task,) = prepared.workload.tasks
    assert task.histogram and launcher["lengths"] == {"chat": {str(k): v for k, v in task.histogram.items()}}
    assert (
        launcher["steps"] == with_run_steps(TrainOptions(workload=args[0], plan=args[1], out=args[2]), prepared).steps
    )
