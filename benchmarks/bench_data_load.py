"""CPU-seconds of a rank's data load and of a whole ``lorafleet train --steps 2`` on the demo's defaults (``make
demo-train``: SmolLM2-135M's GGUF, its four tasks, one CPU rank), the caches cold (the tokenizer built from the
GGUF, the data tokenized) and warm (the tokenizer read in its saved form: ``data.tokenizer_cache``; the examples
read: ``data.length_cache``), interleaved.

    python benchmarks/bench_data_load.py [--rounds 2] [--skip-launch]

First, the cached tokenizer is checked to be the built one (:func:`check_cached_tokenizer`, the script stops
otherwise). Then each round runs, cold then warm, each in a fresh process with a cache directory of its own:

- **rank data load**: what a rank does for its data (``train.trainer.train_rank``), torch imported before:
  ``workload_tokens`` then ``training_streams`` (the tokenizer loaded and the data tokenized, or the examples
  read back; the overflow rule; the streams), its CPU (``process_time``), whether it loaded the tokenizer, and
  then transformers' import (timed apart: rank 0's model load imports it anyway) and the tokenizer's load where
  it was not loaded (rank 0 loads it to save it beside the adapters and say its template lines; the other ranks
  need not): the streams' fingerprints (every token and label) must be the same on both sides, or the script
  stops;
- **validate**: ``lorafleet validate`` of the demo's workload, the CPU of its process (its lengths are given, so
  the tokenizer is loaded for the chat-template lines only: built from the GGUF cold, read back warm);
- **launch**: the whole command on a plan made once (``lorafleet plan --gpus 1 --gpu cpu``), the CPU of its
  process tree (``os.wait4``: the launcher, torchrun, the rank); the tokenizer files the cold and the warm run
  export (``<out>/tokenizer/``, beside the adapters) must be the same bytes, or the script stops.

A warm side's cache is warmed once, untimed, by a rank data load. Printed: each run, the medians, warm / cold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_launch_cpu import launch_cpu  # noqa: E402

from lorafleet.data.length_cache import CACHE_ENV  # noqa: E402

WORKLOAD = REPO / "examples" / "demo" / "workload.yaml"
RANK_LOAD = """
import json, sys, time
import torch  # a rank has imported it (its process group) before it loads data
from lorafleet.runtime.data_stream import training_streams, workload_tokens
from lorafleet.workload import load_workload
spec = load_workload(sys.argv[1]).spec
start = time.process_time()
tokens = workload_tokens(spec)
streams = training_streams(spec, 2, tokens)
loaded = "transformers" in sys.modules
middle = time.process_time()
import transformers  # rank 0's model load imports it anyway: timed apart
imported = time.process_time()
tokens.tokenizer()  # rank 0 loads it for the run's exports: already loaded when the data was tokenized
print(json.dumps({"streams_s": middle - start, "import_s": imported - middle, "loaded": loaded,
                  "tokenizer_s": time.process_time() - imported,
                  "fingerprints": [s.data.fingerprint for s in streams.streams]}))
"""


def rank_load(cache: Path) -> dict:
    """A rank's data load in a fresh process (module doc)."""
    done = subprocess.run(
        [sys.executable, "-c", RANK_LOAD, str(WORKLOAD)],
        env={**os.environ, CACHE_ENV: str(cache)},
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return json.loads(done.stdout.splitlines()[-1])


def entry_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "tokens").iterdir())


TOKENIZER_ATTRIBUTES = (
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "padding_side", "truncation_side",
    "model_max_length", "chat_template", "special_tokens_map", "added_tokens_decoder",
)  # fmt: skip


def check_cached_tokenizer(cache: Path) -> str:
    """The demo's tokenizer built from its GGUF against the tokenizer cache's copy (written, then read back under
    ``cache``): the same ids and labels for the demo's data and every format and container the tests write
    (``tests/data/test_cached_examples.py``'s cases), the same special tokens, padding side and chat template,
    and their ``save_pretrained`` files the same bytes, which transformers loads back to the same ids. A line
    saying so; SystemExit naming the first difference."""
    os.environ[CACHE_ENV] = str(cache)
    cache.parent.mkdir(parents=True)
    from transformers import AutoTokenizer

    from lorafleet.data.model_source import _built_tokenizer, data_tokenizer
    from lorafleet.data.tokenize import tokenize_data
    from lorafleet.errors import InputError
    from lorafleet.specs.data import DataSpec
    from lorafleet.workload import load_workload
    from tests.data.test_cached_examples import CASES, ROWS
    from tests.helpers.containers import write_rows

    spec = load_workload(str(WORKLOAD)).spec
    built = _built_tokenizer(spec.model, spec.tokenizer, "bench")
    data_tokenizer(spec.model, spec.tokenizer, source="bench")  # a miss: built, saved
    cached = data_tokenizer(spec.model, spec.tokenizer, source="bench")
    if not str(cached.name_or_path).startswith(str(cache)):
        raise SystemExit(f"the second load did not read the cache ({cached.name_or_path})")
    for name in TOKENIZER_ATTRIBUTES:
        if getattr(built, name) != getattr(cached, name):
            raise SystemExit(f"cached tokenizer's {name} differs: {getattr(cached, name)!r}")
    if built.get_vocab() != cached.get_vocab():
        raise SystemExit("cached tokenizer's vocabulary differs")
    datas = [task.data for task in spec.tasks if task.data is not None]
    for i, (fmt, container, settings) in enumerate(CASES):
        folder = cache.parent / f"rows-{i}"
        folder.mkdir()
        datas.append(DataSpec(path=str(write_rows(folder, ROWS[fmt], container)), **settings))

    def outcome(tokenizer: object, data: DataSpec) -> list | str:
        """The examples, or the error a row's rendering raises (SmolLM2's template renders no tool call)."""
        try:
            return tokenize_data(tokenizer, data)
        except InputError as err:
            return str(err)

    tokens = refused = 0
    for data in datas:
        fresh = outcome(built, data)
        if outcome(cached, data) != fresh:
            raise SystemExit(f"{data.path}: the cached tokenizer's examples differ from the built one's")
        tokens += sum(map(len, fresh)) if isinstance(fresh, list) else 0
        refused += isinstance(fresh, str)
    saved = {}
    for side, tokenizer in (("built", built), ("cached", cached)):
        saved[side] = cache.parent / f"saved-{side}"
        tokenizer.save_pretrained(str(saved[side]))
    files = sorted(p.name for p in saved["built"].iterdir())
    if files != sorted(p.name for p in saved["cached"].iterdir()) or any(
        (saved["built"] / f).read_bytes() != (saved["cached"] / f).read_bytes() for f in files
    ):
        raise SystemExit("the cached tokenizer's save_pretrained files differ from the built one's")
    reloaded = AutoTokenizer.from_pretrained(str(saved["cached"]), local_files_only=True)
    if tokenize_data(reloaded, datas[0]) != tokenize_data(built, datas[0]):
        raise SystemExit("the saved files, loaded back, give other examples")
    return (
        f"cached tokenizer = built: {len(datas)} datasets, {tokens:,} tokens the same ({refused} refused alike); "
        f"{len(TOKENIZER_ATTRIBUTES)} attributes and the vocabulary equal; saved files {files} byte-identical"
    )


def same_export(cold: Path, warm: Path) -> None:
    """The tokenizer files a cold and a warm run exported (``<out>/tokenizer/``) are the same bytes."""
    names = sorted(p.name for p in (cold / "tokenizer").iterdir())
    if names != sorted(p.name for p in (warm / "tokenizer").iterdir()) or any(
        (cold / "tokenizer" / n).read_bytes() != (warm / "tokenizer" / n).read_bytes() for n in names
    ):
        raise SystemExit(f"the exported tokenizer differs between {cold} and {warm}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-launch", action="store_true", help="time the rank's data load only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-data-load-"))
    try:
        plan = root / "plan.json"
        if not args.skip_launch:
            subprocess.run(
                [sys.executable, "-m", "lorafleet", "plan", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu"]
                + ["--json", str(plan)],
                check=True,
                capture_output=True,
                cwd=REPO,
            )
        print(check_cached_tokenizer(root / "check" / "cache"), flush=True)
        warm = root / "warm-cache"
        reference = rank_load(warm)["fingerprints"]
        print(f"warm cache: {entry_bytes(warm):,} bytes for the demo's four tasks", flush=True)
        results: dict[str, dict[str, list[float]]] = {
            side: {"rank": [], "rank 0": [], "validate": [], "launch": []} for side in ("cold", "warm")
        }
        for i in range(args.rounds):
            for side in ("cold", "warm"):
                cache = warm if side == "warm" else root / f"cold-{i}"
                load = rank_load(cache)
                if load["fingerprints"] != reference:
                    raise SystemExit(f"round {i + 1} {side}: the examples differ from the first tokenization's")
                results[side]["rank"].append(load["streams_s"])
                results[side]["rank 0"].append(load["streams_s"] + load["import_s"] + load["tokenizer_s"])
                line = (
                    f"round {i + 1} {side}: rank data load {load['streams_s']:.2f} CPU-s (tokenizer loaded: "
                    f"{load['loaded']}), then rank 0's import of transformers {load['import_s']:.2f} and its "
                    f"tokenizer {load['tokenizer_s']:.2f}"
                )
                validate_cache = warm if side == "warm" else root / f"cold-{i}-validate"
                checked = launch_cpu(["validate", str(WORKLOAD)], {**os.environ, CACHE_ENV: str(validate_cache)})
                results[side]["validate"].append(checked)
                line += f", validate {checked:.2f} CPU-s"
                if not args.skip_launch:
                    launch_cache = warm if side == "warm" else root / f"cold-{i}-launch"
                    argv = ["train", str(WORKLOAD), "--gpus", "1", "--gpu", "cpu", "--plan", str(plan), "--steps", "2"]
                    argv += ["--out", str(root / f"run-{side}-{i}")]
                    tree = launch_cpu(argv, {**os.environ, CACHE_ENV: str(launch_cache)})
                    results[side]["launch"].append(tree)
                    if side == "warm":
                        same_export(root / f"run-cold-{i}", root / f"run-warm-{i}")
                    line += f", whole launch {tree:.2f} CPU-s"
                print(line, flush=True)
        for what in ("rank", "rank 0", "validate", "launch"):
            if results["cold"][what]:
                cold, warm_s = statistics.median(results["cold"][what]), statistics.median(results["warm"][what])
                print(f"{what}: median cold {cold:.2f}, warm {warm_s:.2f} CPU-s; warm/cold {warm_s / cold:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
