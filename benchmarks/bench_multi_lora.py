"""Forward + backward of one LoRA-wrapped linear with 8 adapters: MultiLoraLinear vs two baselines.

* **ours**: :class:`MultiLoraLinear` (torch backend): one base GEMM over all 8 segments, the
  low-rank GEMMs batched per run of equal segments.
* **peft_seq**: the tasks one after another, each task's rows through a PEFT ``lora.Linear``
  (all eight wrap the same base), each with its own forward and backward.
* **naive**: one batch, every adapter computed over the *full* batch then masked to its rows:
  the per-adapter loop that mLoRA's BatchLoRA operator replaced.
* **base** (a bound, not a method): only the frozen layer's two GEMMs over the whole batch,
  ``X W^T`` and ``G W``, which any exact operator must also compute. ``peft_seq/base`` is the
  ratio an operator whose adapters cost nothing would reach: where it is near 1.5x (large
  layers, short segments, several threads), no operator can reach 1.5x.

Every step draws dropout (p = 0.1, training mode), computes ``dX`` (the layer is inside a model)
and the adapter gradients; the frozen base gets none, and all three use the same base, inputs,
upstream gradient, fp32 and dropout rate. After one warm-up step each, the methods run
interleaved, repeat after repeat, in one process, each repeat starting with the next method in
turn (so none always follows the same one), and the table reports median-time ratios
(baseline / ours), so machine noise hits all of them alike. A row gets as many repeats as fit
in about :data:`ROW_SECONDS` (judged from the warm-up), at least 3 and at most the sweep's.
``ranks`` is ``equal`` (all rank r) or ``mixed`` (cycling r/4, r/2, r, 2r with alpha = 2r: ours
pads them to 2r in one batched GEMM, or splits the run by rank where that pays; PEFT runs each
at its own rank). ``load`` is the 1-minute load average when the row finished: on a shared 2-core machine,
a load above ~2 means other processes hold the cores, and two-thread GEMMs then stall at their
barriers for whole scheduler slices; the ratios measure the scheduler, not the operator. Use
``--threads 1 --clock cpu`` there: CPU time of one thread does not count time spent descheduled.

On a GPU (``--device cuda``) every time is wall time read after ``torch.cuda.synchronize()``,
and a fourth method runs first: **ours_triton**, the same layer on its Triton backend (what
``LoraBackend.AUTO`` picks for CUDA tensors); ``ours`` is then its torch backend, and every
ratio is over ``ours_triton``. Each method gets a second warm-up step there: the first compiles
Triton's kernels (and lets cuBLAS pick its GEMMs), and the pace that sets the repeats is judged
from the second. ``--dtype bf16`` runs every method in bf16 (fp32 by default).

    python benchmarks/bench_multi_lora.py                          # full sweep, 2 threads, wall clock
    python benchmarks/bench_multi_lora.py --quick                  # a few shapes (~1 min)
    python benchmarks/bench_multi_lora.py --threads 1 --clock cpu  # on a loaded machine
    python benchmarks/bench_multi_lora.py --device cuda --dtype bf16 --quick --row-seconds 2
    python benchmarks/bench_multi_lora.py --dora --threads 1 --clock cpu   # DoRA rows (issue #41)
    python benchmarks/bench_multi_lora.py --dora --device cuda --dtype bf16 --quick   # on a GPU (gpu_check.sh)

**DoRA rows** (``--dora``): the same 8 adapters as DoRA (``use_dora``), with dropout 0 and 0.1, ours against
PEFT's ``use_dora`` layers one task at a time (PEFT reads ``use_dora`` from ``config=``), interleaved in one process
with the same adapters as plain LoRA: ``peft_seq/ours`` over the DoRA steps (the bar: never below 1.0x), and each
implementation's DoRA/LoRA time ratio beside the analytic model's factor (``costmodel.dora_cost``) and PEFT PR
#1474's 1.6-2.1x.

**Mask rows** (``--masks``): the adapter-dropout keep-mask kept for the backward against drawn again there
(``dropout.MaskReplay``, as ``MultiLoraLinear`` runs it), one operator call (``multi_lora_linear``, the 8 LoRA
adapters of equal rank, dropout 0.1) each, interleaved in one process: ``kept`` hands the operator the mask alone
(it saves the ``(T, K)`` bool, the operator before the replay), ``replayed`` hands it the mask and its replay too
(it saves the generator state and draws the mask again in the backward). Per row: the bytes the forward saves
for the backward (distinct storages, weights left out; the replay's generator state on the host is not a saved
tensor and is counted beside: 5,056 bytes on CPU), replayed / kept, and the step times' ratio replayed / kept.

    python benchmarks/bench_multi_lora.py --masks --threads 1 --clock cpu   # the mask rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import peft
import torch
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn

from lorafleet.executor.torch.dropout import MaskReplay, default_generator, draw_keep_mask
from lorafleet.executor.torch.multi_lora import MultiLoraLinear, multi_lora_linear
from lorafleet.executor.torch.routing import LoraBackend, Segments
from lorafleet.specs.lora import LoraSpec

N_ADAPTERS = 8
DROPOUT = 0.1


@dataclass(frozen=True)
class Sweep:
    layer: str
    hidden: int
    rank: int
    ranks: str  # "equal" or "mixed", see adapter_specs
    tokens: tuple[int, ...]  # per adapter
    quick_tokens: tuple[int, ...]
    repeats: int  # at most this many timed steps per method; --quick uses a third, at least 3 (a ~1 ms tiny
    # step needs hundreds for a stable median: with 21, the mixed rows at 16-128 tokens read 1.47-1.61x
    # from run to run, with 401 1.59-1.74x)


TINY_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
SWEEPS = [
    Sweep("tiny-llama h=64", 64, 8, "equal", TINY_TOKENS, (16, 128, 2048), 401),
    Sweep("tiny-llama h=64", 64, 8, "mixed", TINY_TOKENS, (16, 128, 2048), 401),
    Sweep("7B h=4096", 4096, 16, "equal", (16, 64, 128, 512, 2048), (16, 128), 15),
    Sweep("7B h=4096", 4096, 16, "mixed", (16, 128, 2048), (16,), 15),
]
ROW_SECONDS = 30.0
"""Timed seconds per row, all methods together (the slow 7B rows get 3 repeats whatever this is)."""


def adapter_specs(rank: int, ranks: str, dora: bool = False, dropout: float = DROPOUT) -> list[LoraSpec]:
    """8 specs: all rank ``rank``, or ranks cycling r/4, r/2, r, 2r (alphas = 2 x rank); DoRA ones with ``dora``."""
    cycle = [rank] if ranks == "equal" else [max(1, rank // 4), max(1, rank // 2), rank, 2 * rank]
    return [
        LoraSpec(rank=r, alpha=2.0 * r, dropout=dropout, use_dora=dora)
        for r in (cycle[i % len(cycle)] for i in range(N_ADAPTERS))
    ]


def randomize(params) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.02)


def build(
    hidden: int,
    specs: list[LoraSpec],
    tokens: int,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
) -> dict[str, Callable[[], None]]:
    """One fwd+bwd step per method, all on the same base, inputs and upstream gradient; on CUDA
    ``ours_triton`` first."""
    base = nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype).requires_grad_(False)
    T = tokens * N_ADAPTERS
    x = torch.randn(T, hidden, device=device, dtype=dtype)
    grad_y = torch.randn(T, hidden, device=device, dtype=dtype)

    def operator(backend: LoraBackend) -> Callable[[], None]:
        layer = MultiLoraLinear(base, backend=backend)
        for i, spec in enumerate(specs):
            layer.add_adapter(i, spec)
        randomize(layer.parameters())
        layer.segments = Segments.packed(range(N_ADAPTERS), [tokens] * N_ADAPTERS)
        x_layer = x.clone().requires_grad_()

        def step() -> None:
            x_layer.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x_layer).backward(grad_y)

        return step

    steps = {"ours_triton": operator(LoraBackend.TRITON)} if device.type == "cuda" else {}
    steps["ours"] = operator(LoraBackend.TORCH)

    peft_layers = [
        PeftLinear(
            base,
            "default",
            # peft reads dropout and DoRA from config=, not from its keyword arguments
            config=peft.LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout, use_dora=s.use_dora),
            r=s.rank,
            lora_alpha=s.alpha,
            use_dora=s.use_dora,
        )
        for s in specs
    ]
    for layer in peft_layers:
        for adapters in (layer.lora_A, layer.lora_B):
            adapters.to(device=device, dtype=dtype)  # where the base is, whatever peft's own placement rule
        randomize([layer.lora_A["default"].weight, layer.lora_B["default"].weight])
        if layer.lora_magnitude_vector:
            layer.lora_magnitude_vector.to(device=device, dtype=dtype)
    x_tasks = [x[i * tokens : (i + 1) * tokens].clone().requires_grad_() for i in range(N_ADAPTERS)]
    g_tasks = [grad_y[i * tokens : (i + 1) * tokens] for i in range(N_ADAPTERS)]

    def step_peft_seq() -> None:
        for layer, x_t, g_t in zip(peft_layers, x_tasks, g_tasks):
            x_t.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x_t).backward(g_t)

    naive_A = [nn.Parameter(torch.randn(s.rank, hidden, device=device, dtype=dtype) * 0.02) for s in specs]
    naive_B = [nn.Parameter(torch.randn(hidden, s.rank, device=device, dtype=dtype) * 0.02) for s in specs]
    row_masks = [
        (torch.arange(T, device=device) // tokens == i).to(dtype)[:, None] for i in range(N_ADAPTERS)
    ]  # (T, 1)
    dropout = nn.Dropout(DROPOUT)
    x_naive = x.clone().requires_grad_()

    def step_naive() -> None:
        x_naive.grad = None
        for p in (*naive_A, *naive_B):
            p.grad = None
        y = base(x_naive)
        for A, B, mask, spec in zip(naive_A, naive_B, row_masks, specs):
            y = y + mask * (dropout(x_naive) @ A.T @ B.T) * spec.scaling  # (T, N), all T rows
        y.backward(grad_y)

    def step_base() -> None:
        torch.nn.functional.linear(x, base.weight)  # (T, N) = X W^T
        grad_y.mm(base.weight)  # (T, K) = G W

    return {**steps, "peft_seq": step_peft_seq, "naive": step_naive, "base": step_base}


def measure(
    steps: dict[str, Callable[[], None]],
    max_repeats: int,
    seconds: float,
    clock: Callable[[], float],
    warmups: int = 1,
) -> dict[str, float]:
    """Median seconds per step; methods interleaved, in rotating order, so drift affects all alike.

    Repeats: as many as fit in ``seconds`` at the last warm-up's pace, at least 3, at most ``max_repeats``.
    """
    for _ in range(warmups):
        warm_up = 0.0
        for step in steps.values():  # warm-up: allocator, first-call dispatch (on CUDA: Triton's compile)
            start = clock()
            step()
            warm_up += clock() - start
    repeats = min(max_repeats, max(3, int(seconds / warm_up)))
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = clock()
            steps[name]()
            times[name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def cuda_clock() -> float:
    """Wall time once the GPU has finished everything launched so far."""
    torch.cuda.synchronize()
    return time.perf_counter()


def dora_rows(args: argparse.Namespace, clock: Callable[[], float], device: torch.device, dtype: torch.dtype) -> None:
    """The DoRA table (module doc): per shape and dropout, ours and PEFT with DoRA and with plain LoRA, on ``device``
    in ``dtype`` (ours as ``LoraBackend.AUTO`` runs it there: Triton on CUDA, torch on CPU)."""
    from lorafleet.costmodel.adapters import AdapterLoad
    from lorafleet.costmodel.analytic import analytic_dora_factor
    from lorafleet.costmodel.time_model import MicroBatchShape
    from lorafleet.specs.gpus import resolve_gpu
    from lorafleet.specs.model import MODEL_PRESETS

    where = (
        f"{torch.cuda.get_device_name()}, synchronized wall clock"
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads, {args.clock} clock"
    )
    print(f"{N_ADAPTERS} DoRA adapters, {args.dtype} {where}, fwd+bwd per step")
    print(
        f"{'layer':<16} {'dropout':>7} {'tok/adapter':>11} {'ours ms':>9} {'peft_seq/ours':>14} "
        f"{'ours dora/lora':>15} {'peft dora/lora':>15} {'load':>5}"
    )
    worst = float("inf")
    for sweep in (s for s in SWEEPS if s.ranks == "equal"):
        repeats = max(3, sweep.repeats // 3) if args.quick else sweep.repeats
        seconds = args.row_seconds / 3 if args.quick else args.row_seconds
        for dropout in (0.0, DROPOUT):
            for tokens in sweep.quick_tokens if args.quick else sweep.tokens:
                steps = {}
                for kind, dora in (("lora", False), ("dora", True)):
                    built = build(
                        sweep.hidden, adapter_specs(sweep.rank, "equal", dora, dropout), tokens, device, dtype
                    )
                    ours = built["ours_triton" if device.type == "cuda" else "ours"]
                    steps |= {f"ours_{kind}": ours, f"peft_{kind}": built["peft_seq"]}
                median = measure(steps, repeats, seconds, clock, warmups=2 if device.type == "cuda" else 1)
                ratio = median["peft_dora"] / median["ours_dora"]
                worst = min(worst, ratio)
                print(
                    f"{sweep.layer:<16} {dropout:>7g} {tokens:>11} {median['ours_dora'] * 1e3:>9.2f} {ratio:>13.2f}x "
                    f"{median['ours_dora'] / median['ours_lora']:>14.2f}x "
                    f"{median['peft_dora'] / median['peft_lora']:>14.2f}x {os.getloadavg()[0]:>5.1f}",
                    flush=True,
                )
    load, shape = AdapterLoad.uniform(6), MicroBatchShape.padded(4, 1024)
    model, gpu = MODEL_PRESETS["llama2-7b"], resolve_gpu("a100-40gb")
    factors = [analytic_dora_factor(model, gpu, load, shape, dropout=d) for d in (True, False)]
    print(f"\nnever slower than PEFT with DoRA: {'yes' if worst >= 1.0 else 'NO'} (worst ratio {worst:.2f}x)")
    print(
        f"analytic DoRA factor (Llama-2-7B block, A100-40GB, 4x1024 tokens): {factors[0]:.2f}x with dropout, "
        f"{factors[1]:.2f}x without; PEFT PR #1474 measured 1.6-2.1x"
    )


def mask_steps(
    hidden: int, specs: list[LoraSpec], tokens: int, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], int]]]:
    """One fwd+bwd step of the operator with the keep-mask ``kept`` and ``replayed`` (module doc), on the same
    base, adapters, inputs and upstream gradient, as the device's backend runs it; and per mode the bytes one
    forward saves for the backward."""
    layer = MultiLoraLinear(nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype))
    for i, spec in enumerate(specs):
        layer.add_adapter(i, spec)
    randomize(layer.parameters())
    layer.segments = Segments.packed(range(N_ADAPTERS), [tokens] * N_ADAPTERS)
    routing, weight = layer.routing(), layer.base_layer.weight
    lora_A, lora_B = list(layer.lora_A.values()), list(layer.lora_B.values())
    T = tokens * N_ADAPTERS
    x = torch.randn(T, hidden, device=device, dtype=dtype, requires_grad=True)
    grad_y = torch.randn(T, hidden, device=device, dtype=dtype)

    def forward(replaying: bool) -> torch.Tensor:
        replay = MaskReplay.next_draw(T, hidden, routing, device) if replaying else None
        keep = draw_keep_mask(T, hidden, routing, device=device)
        return multi_lora_linear(x, weight, None, lora_A, lora_B, routing, keep, replay=replay)

    def step(replaying: bool) -> Callable[[], None]:
        def run() -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            forward(replaying).backward(grad_y)

        return run

    def saved_bytes(replaying: bool) -> Callable[[], int]:
        def count() -> int:
            weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                if t.untyped_storage().data_ptr() not in weights:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                forward(replaying)
            return sum(storages.values())

        return count

    modes = {"kept": False, "replayed": True}
    return {m: step(r) for m, r in modes.items()}, {m: saved_bytes(r) for m, r in modes.items()}


def mask_rows(args: argparse.Namespace, clock: Callable[[], float], device: torch.device, dtype: torch.dtype) -> None:
    """The mask table (module doc): per shape, saved bytes and step time with the keep-mask kept and replayed."""
    where = (
        "synchronized wall clock" if device.type == "cuda" else f"{torch.get_num_threads()} threads, {args.clock} clock"
    )
    state = default_generator(device).get_state().nbytes
    print(f"{N_ADAPTERS} LoRA adapters, dropout {DROPOUT}, {args.dtype} {device.type}, {where}, fwd+bwd per step")
    print(f"generator state a replay keeps on the host: {state:,} bytes a call")
    print(
        f"{'layer':<16} {'tok/adapter':>11} {'mask MiB':>9} {'kept MiB':>9} {'replayed MiB':>13} {'bytes r/k':>10} "
        f"{'kept ms':>9} {'time r/k':>9} {'load':>5}"
    )
    for sweep in (s for s in SWEEPS if s.ranks == "equal"):
        repeats = max(3, sweep.repeats // 3) if args.quick else sweep.repeats
        seconds = args.row_seconds / 3 if args.quick else args.row_seconds
        for tokens in sweep.quick_tokens if args.quick else sweep.tokens:
            steps, saved = mask_steps(sweep.hidden, adapter_specs(sweep.rank, "equal"), tokens, device, dtype)
            kept, replayed = saved["kept"](), saved["replayed"]()
            median = measure(steps, repeats, seconds, clock, warmups=2 if device.type == "cuda" else 1)
            mib = 1 << 20
            print(
                f"{sweep.layer:<16} {tokens:>11} {tokens * N_ADAPTERS * sweep.hidden / mib:>9.2f} {kept / mib:>9.2f} "
                f"{replayed / mib:>13.2f} {replayed / kept:>10.3f} {median['kept'] * 1e3:>9.2f} "
                f"{median['replayed'] / median['kept']:>9.3f} {os.getloadavg()[0]:>5.1f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes, fewer repeats")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time (default); cpu: this process's CPU time, which with --threads 1 "
        "ignores time the process spends descheduled on a machine shared with other jobs",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: wall time after torch.cuda.synchronize(), and the Triton backend as ours_triton",
    )
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="of every method (default fp32)")
    parser.add_argument(
        "--row-seconds",
        type=float,
        default=ROW_SECONDS,
        help=f"timed seconds per row, all methods together (default {ROW_SECONDS:g}; --quick: a third)",
    )
    parser.add_argument("--dora", action="store_true", help="the DoRA table instead (module doc)")
    parser.add_argument("--masks", action="store_true", help="the keep-mask table instead: kept vs replayed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    on_cuda = device.type == "cuda"
    clock = cuda_clock if on_cuda else time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    if args.dora:
        dora_rows(args, clock, device, dtype)
        return
    if args.masks:
        mask_rows(args, clock, device, dtype)
        return

    # Every ratio is (other method) / (the operator as the device runs it: Triton on CUDA).
    ours = "ours_triton" if on_cuda else "ours"
    others = ["ours", "peft_seq", "naive"] if on_cuda else ["peft_seq", "naive"]
    if on_cuda:
        print(
            f"{N_ADAPTERS} adapters, {args.dtype} {torch.cuda.get_device_name()}, {torch.get_num_threads()} host "
            f"threads, synchronized wall clock, dropout {DROPOUT}, fwd+bwd per step"
        )
    else:
        print(
            f"{N_ADAPTERS} adapters, {args.dtype} CPU, {torch.get_num_threads()} threads, {args.clock} clock, "
            f"dropout {DROPOUT}, fwd+bwd per step"
        )
    ms_label = f"{ours} ms"
    ms_width = max(9, len(ms_label))
    labels = [f"{other}/{ours}" for other in others]
    print(
        f"{'layer':<16} {'ranks':<6} {'tok/adapter':>11} {ms_label:>{ms_width}} "
        + " ".join(f"{label:>{len(label) + 1}}" for label in labels)
        + f" {'peft_seq/base':>14} {'load':>5}"
    )
    rows = []
    for sweep in SWEEPS:
        specs = adapter_specs(sweep.rank, sweep.ranks)
        repeats = max(3, sweep.repeats // 3) if args.quick else sweep.repeats
        seconds = args.row_seconds / 3 if args.quick else args.row_seconds
        for tokens in sweep.quick_tokens if args.quick else sweep.tokens:
            steps = build(sweep.hidden, specs, tokens, device, dtype)
            median = measure(steps, repeats, seconds, clock, warmups=2 if on_cuda else 1)
            ratios = {other: median[other] / median[ours] for other in others}
            bound = median["peft_seq"] / median["base"]
            rows.append((tokens, ratios, bound))
            print(
                f"{sweep.layer:<16} {sweep.ranks:<6} {tokens:>11} {median[ours] * 1e3:>{ms_width}.2f} "
                + " ".join(f"{ratios[other]:>{len(label)}.2f}x" for other, label in zip(others, labels))
                + f" {bound:>13.2f}x {os.getloadavg()[0]:>5.1f}",
                flush=True,
            )
    slowest = min(min(ratios.values()) for _, ratios, _ in rows)
    tokens, ratios, bound = min((r for r in rows if r[0] <= 128), key=lambda r: r[1]["peft_seq"])
    short = ratios["peft_seq"]
    print(f"\nnever slower: {'yes' if slowest >= 1.0 else 'NO'} (worst ratio {slowest:.2f}x)")
    print(
        f">= 1.5x over peft_seq at <= 128 tokens/adapter: {'yes' if short >= 1.5 else 'NO'} (worst {short:.2f}x, "
        f"at {tokens} tokens, where the base GEMMs alone bound it at {bound:.2f}x)"
    )


if __name__ == "__main__":
    main()
