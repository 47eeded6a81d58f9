"""Where a training step's time goes: thread CPU seconds per aten op, per code site, of steady steps.

    python benchmarks/profile_step.py [--model smollm2-135m|bench-llama] [--steps 3] [--warmup 2]
                                      [--top 30] [--tasks a,b] [--torch-profiler TRACE.json]

One process, one thread (``torch.set_num_threads(1)``), its freed heap kept as a CPU rank's is
(``host_memory``), the workload's tasks (the demo's by default) on the one-replica plan ``lorafleet
plan --gpus 1 --gpu cpu`` makes (packed micro-batches), the executor itself (:class:`TorchExecutor`,
``run_step``). After ``--warmup`` steps, every aten op of ``--steps`` steps
is timed by the CPU clock of the thread that runs it (``time.thread_time``: what another process on the
machine does between two reads is not counted, unlike torch.profiler's wall clock, which on a shared
2-core machine charged a 2.5 ms multiply 41 ms) and charged to

- its **site**: in the forward, the innermost Python frame of lorafleet or of transformers' model code
  (``multi_lora.py:forward``, ``modeling_llama.py:forward``, ``attention.py:per_document``); in the
  backward, the autograd node running it (``MulBackward0``, ``_MultiLoraFunctionBackward``), or ours
  (``torch_lora.py:backward``) when it is a Python function;
- its **group** (:data:`GROUPS`): the frozen layers' GEMMs (``mm``/``addmm`` inside the multi-LoRA
  layers), the adapters' own work (every other op there, the dropout mask's draw included),
  attention (SDPA and the documents' split), the LM head and loss, the optimizer, and the rest
  (norms, rotary, activations, residual adds, and the backward's slices and copies).

Printed: the step's CPU seconds per group, the top sites, and the top (site, op) pairs, each the
median over the measured steps. The dispatch mode costs ~10 us of Python per op outside the timed
region, so the printed total is below the step's own CPU time: compare it with the line "step CPU".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_peer import prepare_workload  # noqa: E402

from lorafleet.assemble import workload_cluster, workload_cost_model  # noqa: E402
from lorafleet.dispatch import dispatch_step  # noqa: E402
from lorafleet.executor.torch.launch import build_torch_executor  # noqa: E402
from lorafleet.planner import PlannerOptions, plan_deployment  # noqa: E402
from lorafleet.runtime.host_memory import keep_freed_host_memory  # noqa: E402
from lorafleet.workload import load_workload  # noqa: E402

#: Sites (a file and function of ours or of transformers, or an autograd node) by group; the first match wins.
GROUPS = (
    ("LoRA adapters", ("multi_lora.py", "torch_lora.py", "stacking.py", "dropout.py", "MultiLora")),
    ("attention", ("attention.py", "ScaledDotProduct", "SplitWithSizes")),
    ("LM head + loss", ("weighted_losses", "NllLoss", "LogSoftmax", "IndexSelect", "MmBackward", "step.py")),
    ("optimizer", ("optim", "grad_sync.py", "updates.py")),
)
BASE_GEMMS = ("mm", "addmm")
"""The frozen layer's own GEMMs (``Y = X W^T + b``, ``G W``) run inside the multi-LoRA kernels."""


class OpClock(TorchDispatchMode):
    """Charges every aten op's thread CPU seconds to (site, op)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        self.seconds[(site(), func.overloadpacket.__name__)] += time.thread_time() - start
        return out


def site() -> str:
    """The code an op runs for: our or the model's innermost Python frame; in the backward, the autograd
    node, unless the node is a Python function of ours (its frames come before autograd's own)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if ("lorafleet" in path and "profile_step" not in path) or "transformers/models" in path:
            return f"{Path(path).name}:{frame.f_code.co_name}"
        if "torch/optim" in path:
            return f"optim:{frame.f_code.co_name}"
        if path.endswith(("torch/autograd/graph.py", "torch/_tensor.py")):
            break  # the backward's entry: a C++ autograd node runs this op
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else "other"


def group_of(site_name: str, op: str) -> str:
    """The group of an op (module doc)."""
    for name, keys in GROUPS:
        if any(k in site_name for k in keys):
            if name == "LoRA adapters" and op in BASE_GEMMS:
                return "base GEMMs (in the multi-LoRA layers)"
            return name
    return "other (norms, rotary, activations, residuals, copies)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (the demo's) or bench-llama")
    parser.add_argument("--workload", default=str(REPO / "examples" / "demo" / "workload.yaml"))
    parser.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    parser.add_argument("--batch-scale", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    parser.add_argument("--top", type=int, default=25, help="rows of the site and op tables")
    parser.add_argument("--torch-profiler", default="", help="also write a torch.profiler trace of one step here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as a CPU rank of `lorafleet train` does (train.trainer.train_rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0")
    os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        workload = load_workload(prepare_workload(args, Path(tmp)))
        cluster = workload_cluster(workload, gpus=1, gpu="cpu")
        cost_model = workload_cost_model(workload, cluster)
        plan = plan_deployment(workload, cluster, cost_model, PlannerOptions()).plan
        total = args.warmup + args.steps
        executor = build_torch_executor(workload.spec, plan, total, torch.device("cpu"))
        per_step: list[Counter[tuple[str, str]]] = []
        cpu, tokens = [], []
        for step in range(total):
            batch = executor.next_global_batch(step)
            step_plan = dispatch_step(batch, plan, cost_model)
            clock = OpClock()
            start = time.process_time()
            with clock if step >= args.warmup else _nothing():
                report = executor.run_step(step_plan)
            if step >= args.warmup:
                cpu.append(time.process_time() - start)
                tokens.append(sum(report.task_tokens.values()))
                per_step.append(clock.seconds)
        if args.torch_profiler:
            from torch.profiler import profile

            batch = executor.next_global_batch(total)
            with profile(record_shapes=True, with_stack=True) as prof:
                executor.run_step(dispatch_step(batch, plan, cost_model))
            prof.export_chrome_trace(args.torch_profiler)
    report_profile(per_step, cpu, tokens, args.top)
    dist.destroy_process_group()
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def report_profile(per_step: list[Counter], cpu: list[float], tokens: list[int], top: int) -> None:
    """Median over the measured steps of each group, site and (site, op)."""

    def median_of(key_of) -> dict:
        sums: list[Counter] = []
        for seconds in per_step:
            c: Counter = Counter()
            for (s, op), t in seconds.items():
                c[key_of(s, op)] += t
            sums.append(c)
        keys = set().union(*sums)
        return {k: statistics.median(c.get(k, 0.0) for c in sums) for k in keys}

    groups = median_of(group_of)
    sites = median_of(lambda s, op: s)
    pairs = median_of(lambda s, op: (s, op))
    timed = sum(groups.values())
    print(
        f"{len(per_step)} steps: step CPU {statistics.median(cpu):.2f} s (median; dispatch mode included), "
        f"{statistics.median(tokens):.0f} tokens; timed in ops {timed:.2f} s"
    )
    print(f"{'group':<58}{'CPU s':>8}{'share':>8}")
    for name, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{name:<58}{seconds:>8.3f}{seconds / timed:>8.1%}")
    print(f"\n{'site':<58}{'CPU s':>8}{'share':>8}")
    for name, seconds in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name:<58}{seconds:>8.3f}{seconds / timed:>8.1%}")
    print(f"\n{'site / op':<58}{'CPU s':>8}{'share':>8}")
    for (name, op), seconds in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{(name + ' / ' + op)[:57]:<58}{seconds:>8.3f}{seconds / timed:>8.1%}")


if __name__ == "__main__":
    sys.exit(main())
