"""Token-split LoRA inputs at TP 2 (``executor/torch/token_split.py``): saved bytes and step time, split vs whole.

Two gloo ranks (forked, one thread each) hold a TP2 shard of a small random Llama (``--hidden``, 2 blocks) with
``--tasks`` LoRA tasks of rank ``--rank`` on every projection, one micro-batch of ``--tokens`` packed rows split
evenly over the tasks (``--dropout`` on every adapter). Each rank runs training steps (forward, sum of squares of
the logits, backward) in two modes, interleaved round by round, each round starting with the other mode:

* **split**: as shipped: each column-parallel projection saves its rank's rows of its input, the backward
  reduce-scatters ``dS'``;
* **whole**: the same model with every layer's ``token_split`` cleared: the input saved whole, no collective.

It prints, per mode, rank 0's activation bytes saved for the backward (distinct storages other than the
weights, by a ``saved_tensors_hooks`` pass over one forward: all of them, and the ``(rows, hidden)`` ones: the
column-parallel groups' inputs, or their rank's rows), the median step wall and CPU (the rank's process) times
over ``--rounds`` and the ratios split / whole, with the 1-minute load average (a shared 2-core machine: above ~2
the wall times measure the scheduler; CPU time does not count time spent descheduled).

    .venv/bin/python benchmarks/bench_token_split.py --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.routing import Segments
from lorafleet.executor.torch.tp import parallelize_tensor
from lorafleet.specs.lora import LoraSpec

MODES = ("split", "whole")


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(config)
    specs = [LoraSpec(rank=args.rank, alpha=2 * args.rank, dropout=args.dropout) for _ in range(args.tasks)]
    inject_multi_lora(model, specs, seeds=list(range(1, args.tasks + 1)))
    return model.train()


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor, hidden: int) -> tuple[int, int]:
    """(all, ``(rows, hidden)`` activations) bytes of the distinct storages one forward saves for its backward;
    parameters and buffers (the weights) are left out."""
    every: dict[int, int] = {}
    inputs: dict[int, int] = {}
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() in weights:
            return t
        every[storage.data_ptr()] = storage.nbytes()
        if t.dim() == 2 and t.shape[1] == hidden:
            inputs[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).logits.sum()
    return sum(every.values()), sum(inputs.values())


def _rank(rank: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    model = _model(args)
    parallelize_tensor(model, rank, 2, dist.new_group([0, 1]))
    layers = [layer for _, layer in multi_lora_layers(model)]
    splits = [layer.token_split for layer in layers]
    share = args.tokens // args.tasks
    segments = Segments.packed(list(range(args.tasks)), [share] * args.tasks)
    for layer in layers:
        layer.segments = segments
    ids = torch.randint(0, 1024, (1, segments.end), generator=torch.Generator().manual_seed(1))

    def use(mode: str) -> None:
        for layer, split in zip(layers, splits, strict=True):
            layer.token_split = split if mode == "split" else None

    def step() -> tuple[float, float]:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        model(ids).logits.square().mean().backward()
        return time.perf_counter() - start, time.process_time() - cpu

    saved = {}
    for mode in MODES:
        use(mode)
        saved[mode] = _saved_bytes(model, ids, args.hidden)
        step()  # warm-up
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 2 :] + MODES[: r % 2]:
            use(mode)
            times[mode].append(step())
    if rank == 0:
        lines = [f"tokens {segments.end}, hidden {args.hidden}, {args.tasks} tasks r={args.rank}, p={args.dropout}"]
        wall = {mode: statistics.median(t for t, _ in times[mode]) for mode in MODES}
        cpu = {mode: statistics.median(c for _, c in times[mode]) for mode in MODES}
        for mode in MODES:
            total, inputs = saved[mode]
            lines.append(
                f"{mode:6s} saved {total / 2**20:8.2f} MiB, inputs {inputs / 2**20:7.2f} MiB, "
                f"step {wall[mode] * 1e3:8.1f} ms wall, {cpu[mode] * 1e3:8.1f} ms CPU"
            )
        ratio_saved = saved["split"][0] / saved["whole"][0]
        ratio_inputs = saved["split"][1] / saved["whole"][1]
        lines.append(
            f"split/whole: saved {ratio_saved:.3f}, inputs {ratio_inputs:.3f}, "
            f"step wall {wall['split'] / wall['whole']:.3f}, CPU {cpu['split'] / cpu['whole']:.3f}"
        )
        lines.append(f"load {os.getloadavg()[0]:.2f}")
        Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"{tmp}/init", f"{tmp}/out"
        mp.start_processes(_rank, args=(init, args, out), nprocs=2, start_method="fork")
        print(Path(out).read_text(), end="")


if __name__ == "__main__":
    main()
