"""Joint training against the recipe users run today: transformers' ``Trainer`` + PEFT, one task after another.

    python benchmarks/bench_peer.py [--model smollm2-135m|bench-llama] [--threads 1|2] [--rounds 2]
                                    [--steps 8] [--measure-from 3] [--tasks moddoc] [--batch-scale 1]
                                    [--trl] [--device cpu|cuda] [--dtype fp32|bf16] [--omp-wait passive]

Three sides train the same tasks, each in its own process tree started by this script, the sides
interleaved in rounds (each round starts with the next side in turn):

- **lorafleet**: ``lorafleet train`` on the plan ``lorafleet plan --gpus 1`` makes (one replica, every
  task's adapter in one multi-LoRA pass, packed micro-batches), exactly as a user runs it;
- **recipe**: for each task in turn, transformers' ``Trainer`` over a PEFT ``LoraConfig`` model, its
  batches padded to their longest sequence by ``DataCollatorForSeq2Seq`` (the recipe users run);
- **trl** (``--trl``): the same with TRL's ``SFTTrainer`` (its own collator, also padding to the longest);
- **trl-packed** (``--trl``): ``SFTTrainer`` with ``packing=True`` (best-fit-decreasing packing, padding-free: no
  pad token computed), one packed row of at most the task's largest step's tokens an optimizer step: the strongest
  recipe users run. Its steps hold the same tokens on average, not the same rows: compare tokens per CPU-second.

Same inputs on every side: the workload's tasks (the demo's four by default, ``--tasks`` for a subset),
tokenized by lorafleet (``training_streams``: truncated to each task's context) and drawn by lorafleet's
batch rule, so step ``s`` of task ``t`` trains on the same examples everywhere; the same base weights
(``load_causal_lm`` of the workload's model), batch sizes, LoRA rank, alpha, dropout and targets, learning
rate, warm-up, schedule, weight decay, betas and clipping.

Measured: the time and CPU from the end of step ``measure_from - 1`` to the end of the last step (steps
3-8 of 8 by default: start-up, the probe and the first steps' one-time costs are left out; for the
recipe and trl, per task, the sum over tasks). A step's end is when its line appears (lorafleet's
``metrics.jsonl``, the Trainer's ``on_step_end`` callback); at that moment this script reads the CPU
seconds of the side's whole process tree (psutil: launcher, torchrun, ranks, threads). Printed per run
and as the mean over rounds: **real tokens** (the sequences' own, not padding; the same count on every
side) per second and per CPU-second, the tokens the recipe processes with its padding, and the ratios
lorafleet / recipe. The machine load is printed with each run: on a shared machine, CPU seconds are the
steadier measure. Every side's OpenMP threads sleep at barriers (``OMP_WAIT_POLICY=passive``, what
``lorafleet train`` gives its workers unless told otherwise): spinning ones are counted as CPU seconds and,
on a loaded machine, take the cores their peers need (a demo step ran 4-5x slower at load 6-7).

``--model bench-llama`` trains a random 6-layer, width-256 Llama (``bench_train.BENCH_LLAMA``) with the
project's tiny tokenizer, saved once as an HF directory that every side loads. ``--device cuda --dtype
bf16`` runs every side on the GPU in bf16, the recipe attending with SDPA (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO = REPO / "examples" / "demo" / "workload.yaml"
SIDES = ("lorafleet", "recipe", "trl", "trl-packed")


# ---- the parent: prepare, run the sides in rounds, measure ----------------------------------------


def tree_cpu_s(root: psutil.Process) -> float:
    """CPU seconds (user + system) of ``root`` and every live descendant, with the children each has
    already waited for (psutil's ``children_*``)."""
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@dataclass
class Run:
    """One side's run: every step line as it appeared, with the wall clock and the tree's CPU then."""

    side: str
    round: int
    lines: list[tuple[dict[str, Any], float, float]] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    """The 1-minute load average at the start and the end of the run."""


def watch(proc: subprocess.Popen, events: Path, run: Run, poll_s: float = 0.02) -> None:
    """Until ``proc`` exits: each new line of ``events`` recorded with the time and the tree's CPU seconds."""
    root = psutil.Process(proc.pid)
    offset, partial = 0, b""
    while True:
        done = proc.poll() is not None
        if events.exists() and events.stat().st_size > offset:
            with events.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            partial += chunk
            *complete, partial = partial.split(b"\n")
            if complete:
                wall, cpu = time.perf_counter(), tree_cpu_s(root)
                run.lines += [(json.loads(line), wall, cpu) for line in complete if line.strip()]
        if done:
            return
        time.sleep(poll_s)


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with this checkout first on ``PYTHONPATH``, and ``extra``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def run_side(side: str, round_: int, args: argparse.Namespace, work: Path, workload: Path, plan: Path) -> Run:
    """Starts one side's process tree and records its step lines."""
    out = work / f"{side}-{round_}"
    threads = str(args.threads)
    env = repo_env(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OMP_WAIT_POLICY=args.omp_wait)
    if side == "lorafleet":
        events = out / "metrics.jsonl"
        flags = f"--gpus 1 --gpu {args.gpu} --steps {args.steps} --device {args.device} --dtype {args.dtype}"
        argv = [sys.executable, "-m", "lorafleet", "train", str(workload), "--plan", str(plan), "--out", str(out)]
        argv += [*flags.split(), "--overwrite", "--no-progress"]
    else:
        out.mkdir(parents=True, exist_ok=True)
        events = out / "steps.jsonl"
        flags = f"--steps {args.steps} --threads {args.threads} --device {args.device} --dtype {args.dtype}"
        argv = [sys.executable, __file__, "--child", side, "--workload", str(workload), "--events", str(events)]
        argv += flags.split()
    run = Run(side, round_)
    start_load = os.getloadavg()[0]
    with (out.parent / f"{side}-{round_}.log").open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        watch(proc, events, run)
    run.load = (start_load, os.getloadavg()[0])
    if proc.returncode != 0:
        tail = (out.parent / f"{side}-{round_}.log").read_text().splitlines()[-20:]
        raise SystemExit(f"{side} (round {round_}) failed with exit code {proc.returncode}:\n" + "\n".join(tail))
    return run


@dataclass(frozen=True)
class Measured:
    """What one run trained in its measured steps."""

    real_tokens: int
    processed_tokens: int
    """Real tokens plus padding."""
    wall_s: float
    cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.wall_s

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.real_tokens / self.cpu_s


@dataclass(frozen=True)
class StepLine:
    """One optimizer step as a side reported it, with when its line appeared and the tree's CPU then."""

    task: str
    """The task (``*`` for lorafleet, whose step trains every task)."""
    step: int
    """1-based."""
    real: int
    padded: int
    wall: float
    cpu: float


def step_lines(run: Run) -> list[StepLine]:
    """A run's lines in one form: lorafleet's ``metrics.jsonl`` (a 0-based step, tokens per task) or a
    sequential side's own (its task, a 1-based step, its real and padded tokens)."""
    out = []
    for line, wall, cpu in run.lines:
        if run.side == "lorafleet":
            real = sum(line["task_tokens"].values())
            padded = real + sum(line["task_padding_tokens"].values())
            out.append(StepLine("*", line["step"] + 1, real, padded, wall, cpu))
        else:
            out.append(StepLine(line["task"], line["step"], line["real"], line["padded"], wall, cpu))
    return out


def measured(run: Run, first: int, last: int) -> Measured:
    """Steps ``first..last`` (1-based) of a run: from the line of step ``first - 1`` to that of ``last``,
    per task for the sequential sides (summed over tasks)."""
    by_task: dict[str, dict[int, StepLine]] = {}
    for line in step_lines(run):
        by_task.setdefault(line.task, {})[line.step] = line
    real = processed = 0
    wall = cpu = 0.0
    for task, steps in by_task.items():
        if first - 1 not in steps or last not in steps:
            raise SystemExit(f"{run.side}: task {task} did not report steps {first - 1} and {last}")
        wall += steps[last].wall - steps[first - 1].wall
        cpu += steps[last].cpu - steps[first - 1].cpu
        real += sum(steps[k].real for k in range(first, last + 1))
        processed += sum(steps[k].padded for k in range(first, last + 1))
    return Measured(real, processed, wall, cpu)


def prepare_workload(args: argparse.Namespace, work: Path) -> Path:
    """The workload every side trains: the demo's (or ``--workload``), its tasks cut to ``--tasks``, batch
    sizes times ``--batch-scale``, data paths absolute; for ``bench-llama`` the random model saved as an HF
    directory with the tiny tokenizer (and the length histograms dropped: they are SmolLM2's tokens)."""
    source = Path(args.workload).resolve()
    spec = yaml.safe_load(source.read_text())
    if args.tasks:
        keep = args.tasks.split(",")
        missing = set(keep) - {t["name"] for t in spec["tasks"]}
        if missing:
            raise SystemExit(f"--tasks: {', '.join(sorted(missing))} not in {source}")
        spec["tasks"] = [t for t in spec["tasks"] if t["name"] in keep]
    for task in spec["tasks"]:
        task["batch_size"] = task.get("batch_size", 1) * args.batch_scale
        task["data"]["path"] = str((source.parent / task["data"]["path"]).resolve())
    if args.model == "bench-llama":
        model_dir = work / "bench-llama"
        save_bench_llama(model_dir)
        spec["model"] = spec["tokenizer"] = str(model_dir)
        for task in spec["tasks"]:
            task.pop("lengths", None)
    elif args.model != spec["model"]:
        spec["model"] = args.model
    path = work / "workload.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def save_bench_llama(directory: Path) -> None:
    """``bench_train.BENCH_LLAMA`` with seeded random weights and the tiny tokenizer, as an HF directory."""
    from bench_train import BENCH_LLAMA

    from lorafleet.data.model_source import ModelSource, SourceKind
    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer
    from lorafleet.executor.torch.base_model import load_causal_lm

    model = load_causal_lm(ModelSource(kind=SourceKind.RANDOM, name="bench-llama", spec=BENCH_LLAMA, seed=0))
    model.save_pretrained(directory)
    build_tiny_tokenizer(directory, vocab_size=BENCH_LLAMA.vocab)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (the demo's) or bench-llama")
    parser.add_argument("--workload", default=str(DEMO), help="workload YAML (default: the demo's)")
    parser.add_argument("--tasks", default="", help="comma-separated task names to train (default: all)")
    parser.add_argument("--batch-scale", type=int, default=1, help="multiply every task's batch size")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of every side (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="steps each side trains (default 8)")
    parser.add_argument("--measure-from", type=int, default=3, help="first measured step, 1-based (default 3)")
    parser.add_argument("--trl", action="store_true", help="also run TRL's SFTTrainer, padded and packed")
    parser.add_argument("--sides", default="", help="comma-separated sides to run (default lorafleet,recipe[,trl])")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument(
        "--gpu", default="", help="the GPU preset lorafleet plans for (default: cpu, or the CUDA device's own kind)"
    )
    parser.add_argument(
        "--omp-wait",
        default="passive",
        choices=("passive", "active"),
        help="OMP_WAIT_POLICY of every side (default passive: an OpenMP thread waiting at a barrier sleeps "
        "instead of spinning, which on a shared machine would count as CPU seconds)",
    )
    parser.add_argument("--keep", default="", help="keep the runs' files in this directory")
    parser.add_argument("--child", choices=SIDES[1:], help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_trainer(args)
    trl = ["trl", "trl-packed"] if args.trl else []
    sides = args.sides.split(",") if args.sides else ["lorafleet", "recipe", *trl]
    if not 1 < args.measure_from <= args.steps:
        raise SystemExit("--measure-from must be in 2..--steps (the step before it is the window's start)")
    args.gpu = args.gpu or device_gpu(args.device)
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        workload = prepare_workload(args, work)
        plan = work / "plan.json"
        subprocess.run(
            [sys.executable, "-m", "lorafleet", "plan", str(workload), "--gpus", "1", "--gpu", args.gpu]
            + ["--json", str(plan)],
            check=True,
            stdout=subprocess.DEVNULL,
            env=repo_env(),
        )
        spec = yaml.safe_load(workload.read_text())
        tasks = ", ".join(f"{t['name']} x{t['batch_size']}" for t in spec["tasks"])
        print(
            f"model {args.model}, tasks {tasks}, {args.steps} steps (steps {args.measure_from}-{args.steps} "
            f"measured), {args.threads} thread(s) a side (OMP_WAIT_POLICY={args.omp_wait}), {args.device} "
            f"{args.dtype}, {args.rounds} round(s), {os.cpu_count()} CPUs",
            flush=True,
        )
        header = f"{'round':>5} {'side':<10}{'real tok':>9}{'processed':>10}{'wall s':>8}{'CPU s':>8}"
        print(header + f"{'tok/s':>8}{'tok/CPU-s':>10}{'load':>10}", flush=True)
        results: dict[str, list[Measured]] = {side: [] for side in sides}
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                run = run_side(side, r, args, work, workload, plan)
                m = measured(run, args.measure_from, args.steps)
                results[side].append(m)
                print(
                    f"{r + 1:>5} {side:<10}{m.real_tokens:>9,}{m.processed_tokens:>10,}{m.wall_s:>8.1f}{m.cpu_s:>8.1f}"
                    f"{m.tokens_per_s:>8.1f}{m.tokens_per_cpu_s:>10.2f}{run.load[0]:>5.1f}-{run.load[1]:.1f}",
                    flush=True,
                )
        print_summary(results)
    return 0


def device_gpu(device: str) -> str:
    """The GPU preset of ``device`` (``cpu``, or the CUDA device's kind): ``lorafleet train`` checks every
    rank's device against the plan's pool, so the plan must be made for the GPU the run has."""
    import torch

    from lorafleet.executor.torch.launch import device_kind

    kind, words = device_kind(torch.device(device))
    if kind is None:
        raise SystemExit(f"--gpu: no GPU preset names {words}; pass the closest preset's name")
    return kind


def print_summary(results: dict[str, list[Measured]]) -> None:
    """Mean over rounds per side, and lorafleet's ratio over each other side."""
    means = {
        side: (sum(m.tokens_per_s for m in ms) / len(ms), sum(m.tokens_per_cpu_s for m in ms) / len(ms))
        for side, ms in results.items()
    }
    print("mean over rounds:")
    for side, (per_s, per_cpu) in means.items():
        runs = results[side]
        padding = 1 - runs[0].real_tokens / runs[0].processed_tokens
        print(f"  {side:<10} {per_s:8.1f} real tok/s  {per_cpu:8.2f} real tok/CPU-s  padding {padding:.1%}")
    if "lorafleet" in means:
        for side in means:
            if side != "lorafleet":
                wall = means["lorafleet"][0] / means[side][0]
                cpu = means["lorafleet"][1] / means[side][1]
                print(f"  lorafleet / {side}: {wall:.2f}x tokens/s, {cpu:.2f}x tokens per CPU-second")


# ---- a child: one sequential recipe (Trainer + PEFT, or TRL's SFTTrainer) -------------------------


def plain_fp32(model: Any) -> Any:
    """The base model as a user of the recipe loads it: transformers marks a model dequantised from a
    GGUF file as quantised (``hf_quantizer``), and ``Trainer`` refuses to train a quantised model; its
    weights are plain tensors of the load dtype, the same ``from_pretrained`` gives for a safetensors
    checkpoint, so the marks are dropped."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def task_rows(streams: Any, steps: int, task: int) -> list[list[Any]]:
    """Task ``task``'s examples of each of the first ``steps`` global batches, in batch order."""
    out = []
    for step in range(steps):
        batch = streams.global_batch(step)
        examples = streams.examples(batch.task_ids, batch.sample_ids)
        out.append([e for t, e in zip(batch.task_ids, examples, strict=True) if t == task])
    return out


def step_callback(events: Any, task: str, tokens: list[tuple[int, int]], cuda: bool) -> Any:
    """A ``TrainerCallback`` writing one line per optimizer step: the task, the 1-based step and its
    (real, padded) tokens."""
    import torch
    from transformers import TrainerCallback

    class StepLines(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            real, padded = tokens[state.global_step - 1]
            events.write(json.dumps({"task": task, "step": state.global_step, "real": real, "padded": padded}) + "\n")
            events.flush()

    return StepLines()


@dataclass(frozen=True)
class RecipeInputs:
    """What a sequential recipe's child trains from: the workload, its tokenizer (a pad token set), its data
    streams for ``steps`` steps as lorafleet orders them, and the base model in the load dtype."""

    spec: Any
    tokenizer: Any
    streams: Any
    base: Any


def recipe_inputs(workload: Path, steps: int, threads: int, dtype: Any) -> RecipeInputs:
    """The inputs of :class:`RecipeInputs` for ``workload``, torch on ``threads`` threads."""
    import torch

    from lorafleet.data.model_source import resolve_model_source
    from lorafleet.executor.torch.base_model import load_causal_lm
    from lorafleet.runtime.data_stream import task_tokenizer, training_streams
    from lorafleet.workload import load_workload

    torch.set_num_threads(threads)
    spec = load_workload(workload).spec
    tokenizer = task_tokenizer(spec)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    streams = training_streams(spec, steps, tokenizer)
    source = resolve_model_source(spec.model, source="workload", field="model", seed=spec.seed)
    return RecipeInputs(spec, tokenizer, streams, plain_fp32(load_causal_lm(source, dtype)))


def trainer_arguments(optimizer: Any, output_dir: Path, steps: int, seed: int, cuda: bool = False) -> dict[str, Any]:
    """``TrainingArguments``/``SFTConfig`` fields of a task's optimizer (lr, warm-up, weight decay, betas, clip,
    schedule) for ``steps`` optimizer steps, nothing saved or reported, data in the main process."""
    return dict(
        output_dir=str(output_dir),
        max_steps=steps,
        learning_rate=optimizer.lr,
        warmup_steps=optimizer.warmup_steps,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.betas[0],
        adam_beta2=optimizer.betas[1],
        max_grad_norm=optimizer.grad_clip,
        lr_scheduler_type=optimizer.schedule.value,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )


def run_trainer(args: argparse.Namespace) -> int:
    """Trains each task of the workload in turn with the ``--child`` recipe, appending one JSON line per
    optimizer step to ``--events``."""
    import peft
    import torch
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from lorafleet.executor.torch.peft_export import lora_config

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    inputs = recipe_inputs(Path(args.workload), args.steps, args.threads, dtype)
    spec, tokenizer, streams, base = inputs.spec, inputs.tokenizer, inputs.streams, inputs.base
    cuda = args.device == "cuda"
    with Path(args.events).open("a") as events:
        for t, task in enumerate(spec.tasks):
            rows = task_rows(streams, args.steps, t)
            dataset = [
                {"input_ids": list(e.input_ids), "attention_mask": [1] * len(e), "labels": list(e.labels)}
                for step_rows in rows
                for e in step_rows
            ]
            tokens = [(sum(len(e) for e in r), len(r) * max(len(e) for e in r)) for r in rows]
            out = Path(args.events).parent / task.name
            common = trainer_arguments(task.optimizer, out, args.steps, spec.seed, cuda)
            common |= dict(
                per_device_train_batch_size=task.batch_size,
                train_sampling_strategy="sequential",
                bf16=args.dtype == "bf16",
            )
            model = peft.get_peft_model(copy.deepcopy(base), lora_config(task.lora))
            callback = step_callback(events, task.name, tokens, cuda)
            if args.child == "recipe":
                trainer = Trainer(
                    model=model,
                    args=TrainingArguments(**common),
                    train_dataset=dataset,
                    data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
                    callbacks=[callback],
                )
            else:
                import datasets
                from trl import SFTConfig, SFTTrainer

                packed = args.child == "trl-packed"
                if packed:  # one packed row of at most the largest step's tokens an optimizer step
                    common["per_device_train_batch_size"] = 1
                    size = dict(packing=True, max_length=max(real for real, _ in tokens))
                else:
                    size = dict(max_length=None)
                trainer = SFTTrainer(
                    model=model,
                    args=SFTConfig(**common, **size),
                    train_dataset=datasets.Dataset.from_list(
                        [{"input_ids": d["input_ids"], "labels": d["labels"]} for d in dataset]
                    ),
                    processing_class=tokenizer,
                    callbacks=[callback],
                )
                if packed:  # a packed step's tokens are its row's: no padding
                    rows = [len(r) for r in trainer.train_dataset["input_ids"]]
                    tokens[:] = [(rows[k % len(rows)],) * 2 for k in range(args.steps)]
            trainer.train()
            del trainer, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
