"""A hyperparameter sweep as tenants against the sweep users run today: each member trained alone with TRL.

    python benchmarks/bench_sweep.py [--task docsum] [--steps 12] [--rungs 2] [--halving-eval-every 12] [--rounds 1]

A 9-member grid (3 learning rates x 3 ranks) on one demo task, SmolLM2-135M on CPU, three sides, each in its own
process tree started by this script (the sides interleaved in rounds):

- **(a) trl**: each member in turn, TRL's ``SFTTrainer`` with ``packing=True`` (best-fit-decreasing packing,
  padding-free: no pad token is computed), over a PEFT ``LoraConfig`` model, the strongest recipe users run;
  then, outside the measured window, its eval loss on the task's held-out rows;
- **(b) joint**: ``lorafleet train`` of the task's ``sweep`` without halving: the 9 members side by side, every
  one evaluated every ``--rungs`` steps;
- **(c) halving**: the same with successive halving, eta 3, a rung every ``--rungs`` steps, evaluated as a user of
  halving would set it: at the rungs (each rung boundary is evaluated whatever ``every_steps`` is,
  ``lorafleet.eval_schedule``; the 9 members at 2, the 3 kept at 4) and at the end (``eval.every_steps`` =
  ``--halving-eval-every``, default the steps), which is (a)'s information: (a) evaluates every member once, at its
  end. ``--halving-eval-every 2`` is the setting before, every member still training evaluated every 2 steps
  throughout (the winner at 6, 8 and 10 too, after the sweep is decided).

Same inputs everywhere: the task's rows as lorafleet tokenizes them and its held-out rows (``eval.split``; the
same rows for every member), the same base weights, LoRA and optimizer settings per member. Measured: the CPU
seconds of each side's process tree from the end of its first step to the end of its last (per member for (a),
summed), and the real tokens trained in that window. (a) evaluates after its window; so (b) is measured over its
steps alone, as (a) is: the steps whose metrics row carries no evaluation (an evaluation's time falls between the
line of the step it follows and the line before, the row written after it), which with ``--rungs 2`` is every
other step. (c) is measured with its evaluations: they are what halving costs.

Printed: tokens per CPU-second per side; **(b) over (a)**, the ratio of CPU-seconds for the same steps of every
member (tokens per CPU-second: (b) trains exactly the members' batches); **(c) over (a)**, the CPU-seconds (a) would
spend on the sweep (b) trained (all of (b)'s steps after its first, at (a)'s tokens per CPU-second) over (c)'s; and
the winners:
(a)'s best member by its final eval loss, and (c)'s (its promoted member), with (a)'s loss of (c)'s winner.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peer import DEMO, Run, recipe_inputs, repo_env, task_rows, trainer_arguments, watch

LRS = (1.0e-4, 3.0e-4, 1.0e-3)
RANKS = (4, 8, 16)
SIDES = ("trl", "joint", "halving")


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """The two workloads (the grid, and the grid halved) and their plans on one CPU."""
    demo = yaml.safe_load(DEMO.read_text())
    task = next(t for t in demo["tasks"] if t["name"] == args.task)
    task = {k: v for k, v in task.items() if k != "lengths"}
    task["data"]["path"] = str((DEMO.parent / task["data"]["path"]).resolve())
    task["steps"] = args.steps
    cluster = {"gpu": "cpu", "nodes": 1, "gpus_per_node": 1}
    grid = {"optimizer.lr": list(LRS), "lora.rank": list(RANKS)}
    paths = {}
    halving = {"eta": 3, "rung_steps": args.rungs}
    sides = (("joint", {"grid": grid}, args.rungs),
             ("halving", {"grid": grid, "halving": halving}, args.halving_eval_every or args.steps))  # fmt: skip
    for side, sweep, every in sides:
        evaluation = {"split": 0.1, "every_steps": every, "max_rows": args.eval_rows}
        top = {k: v for k, v in demo.items() if k not in ("tasks", "cluster")}
        spec = {**top, "cluster": cluster, "tasks": [{**task, "eval": evaluation, "sweep": sweep}]}
        path = work / f"{side}.yaml"
        text = yaml.safe_dump(spec, sort_keys=False)
        plan = path.with_suffix(".plan.json")
        if not path.exists() or path.read_text() != text:  # a kept plan is of the workload it was made for
            path.write_text(text)
            plan.unlink(missing_ok=True)
        if not plan.exists():
            subprocess.run([sys.executable, "-m", "lorafleet", "plan", str(path), "--json", str(plan)], check=True,
                           stdout=subprocess.DEVNULL, env=repo_env())  # fmt: skip
        paths[side] = path
    return paths


def run_side(side: str, round_: int, args: argparse.Namespace, work: Path, paths: dict[str, Path]) -> Run:
    """One side's process tree, its step lines recorded with the tree's CPU seconds."""
    out = work / f"{side}-{round_}"
    shutil.rmtree(out, ignore_errors=True)  # a stale metrics file would be read as this run's
    env = repo_env(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="passive")
    if side == "trl":
        out.mkdir(parents=True, exist_ok=True)
        events = out / "steps.jsonl"
        argv = [sys.executable, __file__, "--child", "--workload", str(paths["joint"]), "--events", str(events),
                "--steps", str(args.steps), "--threads", str(args.threads)]  # fmt: skip
    else:
        events = out / "metrics.jsonl"
        path = paths[side]
        argv = [sys.executable, "-m", "lorafleet", "train", str(path), "--plan", str(path.with_suffix(".plan.json")),
                "--out", str(out), "--steps", str(args.steps), "--overwrite", "--no-progress"]  # fmt: skip
    run = Run(side, round_)
    with (out.parent / f"{side}-{round_}.log").open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        watch(proc, events, run)
    if proc.returncode != 0:
        tail = (out.parent / f"{side}-{round_}.log").read_text().splitlines()[-20:]
        raise SystemExit(f"{side} (round {round_}) failed with exit code {proc.returncode}:\n" + "\n".join(tail))
    return run


def window(run: Run) -> tuple[int, float, int]:
    """(real tokens, CPU seconds) of the measured steps from the end of the first step to the end of the last, per
    member for trl, without the steps that carry an evaluation for joint (module doc); and the real tokens of every
    step after the first (the sweep's work)."""
    if run.side != "trl":
        steps = [
            (sum(line["task_tokens"].values()), cpu - before, "eval_s" in line)
            for (_, _, before), (line, _, cpu) in zip(run.lines, run.lines[1:])
        ]
        measured = [(t, c) for t, c, evaluated in steps if run.side == "halving" or not evaluated]
        return sum(t for t, _ in measured), sum(c for _, c in measured), sum(t for t, _, _ in steps)
    by_member: dict[str, list] = {}
    for line, _, cpu in run.lines:
        by_member.setdefault(line["task"], []).append((line["real"], cpu))
    tokens = sum(sum(r for r, _ in steps[1:]) for steps in by_member.values())
    return tokens, sum(steps[-1][1] - steps[0][1] for steps in by_member.values()), tokens


def winner(side: str, out: Path, task: str) -> tuple[str | None, dict[str, float]]:
    """A side's winner and its members' final (trl) or best (lorafleet) eval losses."""
    if side == "trl":
        losses = json.loads((out / "eval.json").read_text())
        return min(losses, key=losses.get), losses
    result = json.loads((out / "adapters" / task / "sweep.json").read_text())[0]
    return result["winner"], {m["name"]: m["best_loss"] for m in result["members"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="docsum", help="the demo task swept (default docsum)")
    parser.add_argument("--steps", type=int, default=12, help="steps per member (default 12)")
    parser.add_argument("--rungs", type=int, default=2, help="steps between rungs, and (b)'s evaluations (default 2)")
    parser.add_argument("--halving-eval-every", type=int, default=0,
                        help="(c)'s eval.every_steps, beside its rungs' evaluations (default: the steps)")  # fmt: skip
    parser.add_argument("--eval-rows", type=int, default=16, help="held-out rows an evaluation reads (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of every side (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides (default all three)")
    parser.add_argument("--keep", default="", help="keep the runs' files in this directory")
    parser.add_argument(
        "--reuse", default="", help="comma-separated sides not run again: their figures read from --keep's runs"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_members(args)
    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        paths = prepare(args, work)
        print(f"task {args.task}: 9 members (lr {', '.join(map(str, LRS))} x rank {', '.join(map(str, RANKS))}), "
              f"{args.steps} steps each; (b) evaluated every {args.rungs}; (c) halving eta 3 every {args.rungs} steps, "
              f"evaluated at its rungs and every {args.halving_eval_every or args.steps}; "
              f"{args.threads} thread(s) a side, {args.rounds} round(s), {os.cpu_count()} CPUs",
              flush=True)  # fmt: skip
        print(f"{'round':>5} {'side':<8}{'tokens':>9}{'CPU s':>8}{'tok/CPU-s':>10}{'load':>6}", flush=True)
        measured: dict[str, list[tuple[int, float, int]]] = {side: [] for side in sides}
        outs: dict[str, Path] = {}
        for r in range(args.rounds):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                outs[side] = work / f"{side}-{r}"
                reused = side in args.reuse.split(",")
                if reused and not outs[side].is_dir():
                    outs[side] = work / f"{side}-0"  # one kept run of a side stands for every round
                record = outs[side] / "measured.json"
                if reused:
                    tokens, cpu, *swept = json.loads(record.read_text())  # a record before the sweep's tokens
                    measured[side].append((tokens, cpu, swept[0] if swept else tokens))
                else:
                    measured[side].append(window(run_side(side, r, args, work, paths)))
                    record.write_text(json.dumps(measured[side][-1]))
                tokens, cpu, _ = measured[side][-1]
                print(f"{r + 1:>5} {side:<8}{tokens:>9,}{cpu:>8.1f}{tokens / cpu:>10.1f}{os.getloadavg()[0]:>6.1f}",
                      flush=True)  # fmt: skip
        summarize(measured, outs, args.task)
    return 0


def summarize(measured: dict[str, list[tuple[int, float, int]]], outs: dict[str, Path], task: str) -> None:
    """Mean tokens per CPU-second per side, the two ratios and the winners (module doc)."""
    rate = {side: sum(t / c for t, c, _ in runs) / len(runs) for side, runs in measured.items()}
    print("mean over rounds: " + ", ".join(f"{side} {r:.1f} tok/CPU-s" for side, r in rate.items()))
    if "trl" in rate and "joint" in rate:
        print(f"  (b) joint / (a) trl: {rate['joint'] / rate['trl']:.2f}x fewer CPU-seconds for the same steps")
    if {"trl", "joint", "halving"} <= set(rate):
        sweep_tokens = sum(swept for _, _, swept in measured["joint"]) / len(measured["joint"])
        halving_cpu = sum(c for _, c, _ in measured["halving"]) / len(measured["halving"])
        print(f"  (c) halving vs (a) trl: {sweep_tokens / rate['trl'] / halving_cpu:.2f}x fewer CPU-seconds "
              f"({sweep_tokens / rate['trl']:.0f} CPU-s for (a)'s sweep, {halving_cpu:.0f} for (c))")  # fmt: skip
    winners = {side: winner(side, out, task) for side, out in outs.items()}
    for side, (name, losses) in winners.items():
        print(f"  {side} winner: {name} (eval loss {losses[name]:.4f})" if name else f"  {side}: no winner")
    if "trl" in winners and "halving" in winners:
        best, losses = winners["trl"]
        picked = winners["halving"][0]
        gap = losses[picked] / losses[best] - 1
        print(f"  same winner: {picked == best} ((a)'s eval loss of (c)'s winner is {gap:+.2%} off (a)'s best)")


# ---- the child: (a), each member in turn with TRL's SFTTrainer, packed -----------------------------------


def run_members(args: argparse.Namespace) -> int:
    """Trains each member of the workload's sweep in turn (module doc), one JSON line per optimizer step to
    ``--events``; then each member's eval loss on the held-out rows, to ``eval.json`` beside it."""
    import datasets
    import peft
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from lorafleet.executor.torch.peft_export import lora_config

    inputs = recipe_inputs(Path(args.workload), args.steps, args.threads, torch.float32)
    spec, tokenizer, base = inputs.spec, inputs.tokenizer, inputs.base
    events_path = Path(args.events)
    losses = {}
    rows = task_rows(inputs.streams, args.steps, 0)  # every member: the same rows (its sweep's data order)
    held = inputs.streams.streams[0].data.eval_examples
    dataset = datasets.Dataset.from_list(
        [{"input_ids": list(e.input_ids), "labels": list(e.labels)} for step in rows for e in step]
    )
    longest_step = max(sum(len(e) for e in step) for step in rows)
    with events_path.open("a") as events:
        for member in spec.tasks:
            model = peft.get_peft_model(copy.deepcopy(base), lora_config(member.lora))
            config = SFTConfig(
                **trainer_arguments(member.optimizer, events_path.parent / member.name, args.steps, spec.seed),
                per_device_train_batch_size=1,
                packing=True,
                max_length=longest_step,
            )
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
            packed = [len(r) for r in trainer.train_dataset["input_ids"]]

            class StepLines(TrainerCallback):
                def on_step_end(self, args_, state, control, name=member.name, packed=packed, **kwargs):
                    real = packed[(state.global_step - 1) % len(packed)]
                    events.write(json.dumps({"task": name, "step": state.global_step, "real": real}) + "\n")
                    events.flush()

            trainer.add_callback(StepLines())
            trainer.train()
            losses[member.name] = eval_loss(model, held)
            del trainer, model
    (events_path.parent / "eval.json").write_text(json.dumps(losses, indent=1))
    return 0


def eval_loss(model: Any, examples: Any) -> float:
    """Mean token loss of ``model`` over ``examples`` (the label-shifted tokens with a label), as lorafleet's
    evaluation measures it."""
    import torch
    from torch.nn import functional as F

    total = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for e in examples:
            logits = model(input_ids=torch.tensor([e.input_ids])).logits[0, :-1]
            labels = torch.tensor(e.labels[1:])
            keep = labels != -100
            total += float(F.cross_entropy(logits[keep], labels[keep], reduction="sum"))
            tokens += int(keep.sum())
    return total / tokens if tokens else math.nan


if __name__ == "__main__":
    sys.exit(main())
