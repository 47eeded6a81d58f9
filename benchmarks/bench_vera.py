"""VeRA against LoRA in the multi-adapter operator, and against PEFT's VeRA layers one task at a time (issue #41).

Forward + backward of one square linear with 8 tenants of ``tokens`` rows each, dropout 0.1, ``dX`` computed:

* **ours_lora**: :class:`MultiLoraLinear` with 8 LoRA adapters of rank r;
* **ours_vera**: the same layer with 8 VeRA adapters of rank r (each its own frozen ``A (r, K)``, ``B (N, r)``;
  ``vera.update``: ``λ_d`` on the shrink's output, ``B' = diag(λ_b) B`` formed in the forward, and no ``(r, K)``
  weight-gradient GEMM in the backward);
* **peft_vera**: PEFT 0.21's ``vera.Linear`` per task, each task's rows through its own forward and backward.

The methods run interleaved in one process (``bench_multi_lora.measure``: median of rotating repeats), and each row
prints ``ours_vera / ours_lora`` (what the cost model assumes is ~1: ``costmodel.adapters``, VeRA priced as LoRA's
GEMMs) and ``peft_vera / ours_vera``, with the 1-minute load when the row finished.

    python benchmarks/bench_vera.py --threads 1 --clock cpu      # a loaded machine: one thread's CPU time
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_multi_lora import measure  # noqa: E402

from lorafleet.executor.torch.multi_lora import MultiLoraLinear  # noqa: E402
from lorafleet.executor.torch.routing import Segments  # noqa: E402
from lorafleet.executor.torch.vera import VeraProjections, draw_projections  # noqa: E402
from lorafleet.specs.lora import LoraSpec  # noqa: E402

N_TASKS = 8
DROPOUT = 0.1
SHAPES = ((1024, 256, 16), (2048, 256, 16), (2048, 256, 256), (2048, 16, 256), (4096, 128, 16))
"""(hidden, tokens a task, rank); 16 tokens at rank 256: the low-rank products, not the base GEMM, are the step."""


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> None:
    """One step of a layer: its forward over ``x`` (a leaf needing its gradient), the backward of ``grad_y``."""
    x.grad = None
    layer.zero_grad(set_to_none=True)
    layer(x).backward(grad_y)


def build(hidden: int, tokens: int, rank: int) -> dict[str, Callable[[], None]]:
    """One fwd+bwd step per method over the same base, inputs and upstream gradient; every ``λ_b`` and ``B`` off
    zero."""
    import peft
    from peft.tuners._buffer_dict import BufferDict
    from peft.tuners.vera.layer import Linear as PeftVera

    base = nn.Linear(hidden, hidden, bias=False).requires_grad_(False)
    x = torch.randn(N_TASKS * tokens, hidden)
    grad_y = torch.randn(N_TASKS * tokens, hidden)
    segments = Segments.packed(range(N_TASKS), [tokens] * N_TASKS)
    lora = LoraSpec(rank=rank, alpha=rank, dropout=DROPOUT)
    vera = LoraSpec(rank=rank, use_vera=True, dropout=DROPOUT)
    pairs = [draw_projections(rank, task, hidden, hidden) for task in range(N_TASKS)]

    def ours(spec: LoraSpec) -> Callable[[], None]:
        layer = MultiLoraLinear(base)
        for task, pair in enumerate(pairs):
            layer.add_adapter(task, spec, projections=VeraProjections(*pair) if spec.use_vera else None)
        with torch.no_grad():
            for p in layer.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.02)
        layer.segments = segments
        return functools.partial(fwd_bwd, layer, x.clone().requires_grad_(), grad_y)

    config = peft.VeraConfig(r=rank, vera_dropout=DROPOUT)
    layers = []
    for task, (A, B) in enumerate(pairs):
        layer = PeftVera(base, BufferDict({"default": A}), BufferDict({"default": B}), "default", config=config, r=rank)
        with torch.no_grad():
            layer.vera_lambda_b["default"].normal_(0, 0.02)
        rows = slice(task * tokens, (task + 1) * tokens)
        layers.append((layer, x[rows].clone().requires_grad_(), grad_y[rows]))

    def peft_vera() -> None:
        for layer, x_t, g_t in layers:
            fwd_bwd(layer, x_t, g_t)

    return {"ours_lora": ours(lora), "ours_vera": ours(vera), "peft_vera": peft_vera}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--row-seconds", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{N_TASKS} tasks, fp32 CPU, {torch.get_num_threads()} threads, {args.clock} clock, dropout {DROPOUT}")
    print(f"{'hidden':>6} {'tokens':>6} {'rank':>4} {'lora ms':>8} {'vera ms':>8} {'vera/lora':>9} "
          f"{'peft/vera':>9} {'load':>5}")  # fmt: skip
    for hidden, tokens, rank in SHAPES:
        median = measure(build(hidden, tokens, rank), 50, args.row_seconds, clock)
        print(
            f"{hidden:>6} {tokens:>6} {rank:>4} {median['ours_lora'] * 1e3:>8.2f} {median['ours_vera'] * 1e3:>8.2f} "
            f"{median['ours_vera'] / median['ours_lora']:>8.2f}x {median['peft_vera'] / median['ours_vera']:>8.2f}x "
            f"{os.getloadavg()[0]:>5.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
