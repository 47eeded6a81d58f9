"""``lorafleet profile``: measure a model's cost-model records on this machine.

The profiler spawns ``world`` processes (torch.multiprocessing) that run the same program,
each on one device (``device.ProfileDevice``): on a CPU, gloo processes of one CPU thread
each, so a process plays one device; on CUDA, one GPU per process and NCCL. On a machine of
one GPU the world is one process: TP1 only, and no transfer records.

1. per TP degree, with every process busy on the torch executor's own replicas
   (``replica.ProfiledReplica``: two TP1 replicas side by side, or one TP2 replica on ranks
   0-1 with the executor's gloo TP; a record is the slowest replica's time):
   - layer: the executor's inputs and forward + backward of the L blocks, over L, on every
     padded (mbs, seq_len) of the grid and on random packed micro-batches, plus held-out
     off-grid padded and packed micro-batches the fit never sees;
   - head: embedding, rotary table, final norm, LM head and loss, forward + input gradient;
   - layer_forward, head_forward: the same forward alone under ``torch.no_grad`` (an evaluation's
     work, ``CostModel.forward_time``);
   - replica: whole executor steps (1F1B over the micro-batches, gradient sum, norms, every
     task's optimizer) over random mixed lists of padded and packed micro-batches, to check
     the composed cost model against; for TP1 both alone and with the adapters' gradient
     all-reduce across the replicas side by side;
   - memory: max tokens M of every requested <tp, pp> by ``search_max_tokens`` against the
     memory budget, emulating the first pipeline stage (pp micro-batches in flight, L/pp
     blocks, embedding) and the last (L/pp blocks, head, logits);
2. p2p ping-pong and 2-rank all-reduces over a range of sizes (``transfers``: two processes);
   optimizer steps of 1..n tasks.

Every time is the median of ``repeats`` after ``warmup`` calls, the smallest over
``rounds`` passes; see ``measure`` for how time and peak bytes are taken. Rank 0 writes the
records; the caller fits and saves them.
"""

from __future__ import annotations

import functools
import pickle
import random
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lorafleet.costmodel.adapters import FP32_BYTES, AdapterLoad
from lorafleet.costmodel.memory_model import StageMemory, search_max_tokens
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.profile_format import (
    AdaptersJSON,
    HeadRecord,
    LayerRecord,
    MemoryRecord,
    Profile,
    Records,
    ReplicaRecord,
    ShapeJSON,
    SizeRecord,
)
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.executor.torch.precision import Precision
from lorafleet.profiling.device import DeviceKind, ProfileDevice, describe_host
from lorafleet.profiling.measure import best_of_rounds
from lorafleet.profiling.replica import ProfiledReplica
from lorafleet.specs.model import ModelSpec

MIB = 1 << 20
#: A measurement: what to time, and how its time (ms) becomes a (kind, record) pair.
Timed = tuple[Callable[[], object], Callable[[float], tuple[str, object]]]


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure and how."""

    model: ModelSpec
    configs: tuple[ParallelConfig, ...]
    """<tp, pp> whose max tokens to measure; their TP degrees get time records."""
    adapters: AdapterLoad
    seq_lens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    """Grid of padded lengths s."""
    mbs: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Grid of micro-batch sizes b."""
    max_grid_tokens: int = 4096
    """Grid points and random micro-batches stay at or below b*s = this."""
    packed: int = 12
    """Random packed micro-batches per TP degree fitted with the grid (packing has costs of its own,
    a loop over sequences in attention, that padded records alone cannot show)."""
    heldout: int = 6
    """Off-grid padded and (as many) packed layer records per TP degree, kept out of the fit."""
    replica_steps: int = 5
    """Random micro-batch lists timed as whole steps per TP degree and sync setting."""
    warmup: int = 1
    repeats: int = 5
    rounds: int = 2
    """Passes over every list of measurements; a record keeps its smallest median (see ``best_of_rounds``)."""
    memory_budget_bytes: int = 48 * MIB
    """The memory a "device" may use: M is searched against it."""
    seed: int = 0
    comm_sizes: tuple[int, ...] = tuple(4**k * 1024 for k in range(6))
    """Bytes of the timed p2p messages and all-reduces (1 KiB .. 1 MiB)."""
    transfers: bool = True
    """Time the p2p and all-reduce records, which need two processes. Off on a machine of one GPU:
    the fitted links then cost nothing."""
    device: DeviceKind = DeviceKind.CPU
    """cpu: gloo processes of one thread; cuda: one GPU per process, NCCL."""
    precision: Precision = Precision.FP32
    """dtype of the base model and the adapters."""
    gpu: str = "cpu"
    """GPU preset name the profile is for (``specs.gpus.GPU_PRESETS``)."""
    command: str = ""
    """The command line, recorded in the profile."""
    start_method: str = "spawn"
    """How the ranks start (``torch.multiprocessing``): spawned, each a clean process. The CPU tests fork them
    instead, reusing their own imports (~5 CPU-s a rank); never under CUDA, whose state a fork cannot carry."""

    @property
    def world(self) -> int:
        """Processes to spawn: the largest TP degree, and two for the transfer records when ``transfers``."""
        return max(2 if self.transfers else 1, *(c.tp for c in self.configs))

    @property
    def tps(self) -> list[int]:
        return sorted({c.tp for c in self.configs})

    @property
    def grid(self) -> list[MicroBatchShape]:
        return [MicroBatchShape.padded(b, s) for s in self.seq_lens for b in self.mbs if b * s <= self.max_grid_tokens]


def _random_padded(rng: random.Random, max_tokens: int) -> MicroBatchShape:
    s = rng.randint(12, min(1000, max_tokens))
    return MicroBatchShape.padded(rng.randint(1, max(1, min(12, max_tokens // s))), s)


def _random_packed(rng: random.Random, max_tokens: int) -> MicroBatchShape:
    lens: list[int] = []
    for _ in range(rng.randint(2, 6)):
        n = rng.randint(8, 600)
        if sum(lens) + n > max_tokens:
            break
        lens.append(n)
    return MicroBatchShape.packed(lens or [max_tokens // 2])


def _random_step(rng: random.Random, max_tokens: int) -> tuple[MicroBatchShape, ...]:
    """2-4 micro-batches, padded or packed, of at most half the grid's tokens each (a step stays short)."""
    make = (_random_padded, _random_packed)
    return tuple(make[rng.randint(0, 1)](rng, max(16, max_tokens // 2)) for _ in range(rng.randint(2, 4)))


class _Worker:
    """One rank's share of the measurements (every rank runs every phase; collectives must line up)."""

    def __init__(self, settings: ProfileSettings, rank: int) -> None:
        self.s = settings
        self.rank = rank
        self.device = ProfileDevice(settings.device, rank)
        self.gen = torch.Generator().manual_seed(settings.seed + rank)
        self.records: dict[str, list] = defaultdict(list)
        self.memory: list[MemoryRecord] = []

    def shapes_rng(self, *phase: object) -> random.Random:
        """Random shapes of one phase: the same on every rank, whichever phases a rank took part in."""
        return random.Random("-".join(map(str, (self.s.seed, *phase))))

    def time(self, runs: list[Callable[[], object]], group: dist.ProcessGroup | None) -> list[float]:
        return best_of_rounds(runs, self.s.rounds, self.s.warmup, self.s.repeats, group, self.device)

    def replica(self, tp: int, busy: int, world: int) -> ProfiledReplica:
        """This rank's part of ``busy // tp`` replicas of ⟨tp, 1⟩ in a world of ``world``. Collective."""
        return ProfiledReplica(
            self.s.model, self.s.adapters, tp, self.rank, busy, world, self.s.seed, self.device, self.s.precision
        )

    def run(self) -> None:
        world = self.s.world
        for tp in self.s.tps:
            # Every device is busy, as in a cluster: world // tp replicas of this degree run side by side
            # (so TP1 is timed with its neighbour core loaded too). Groups are collective: every rank
            # creates every group (``ProfiledReplica`` too, through build_replica), member or not.
            n_busy = world // tp * tp
            busy = dist.new_group(list(range(n_busy)))
            replica = self.replica(tp, n_busy, world)
            if replica.active:
                plan = self.layer_plan(replica, tp) + self.head_plan(replica, tp)
                if tp == 1:  # a TP1 replica alone has nothing to all-reduce
                    plan += self.step_plan(replica, tp, None, 1)
                if tp > 1 or n_busy > 1:  # (a world of one: the TP1 replica alone, just timed)
                    plan += self.step_plan(replica, tp, busy, n_busy // tp)
                self.measure(plan, busy, tp)
                for config in (c for c in self.s.configs if c.tp == tp):
                    self.memory_record(replica, config, busy)
            dist.barrier()
        if self.s.transfers:
            pair = dist.new_group([0, 1])
            if self.rank < 2:
                self.comm_records(pair)
        if self.rank == 0:
            self.optimizer_records(self.replica(1, 1, 1))
        dist.barrier()

    def measure(self, plan: list[Timed], group: dist.ProcessGroup, tag: object) -> None:
        """Time every run of ``plan`` and keep its record. The runs go in a shuffled order (the same on
        every rank), so layer, head and step records share the machine's quiet and busy spells alike."""
        order = list(range(len(plan)))
        self.shapes_rng("order", tag).shuffle(order)
        times = dict(zip(order, self.time([plan[i][0] for i in order], group)))
        for i, (_, record) in enumerate(plan):
            kind, rec = record(times[i])
            self.records[kind].append(rec)

    def layer_plan(self, replica: ProfiledReplica, tp: int) -> list[Timed]:
        """The blocks on the grid and random packed micro-batches, and on held-out padded and packed ones.

        A record is the time of all L blocks over L (LobRA profiles a few layers and divides too):
        a block's backward then finds its activations where a whole step leaves them, behind the
        other blocks' (on a CPU, out of cache), not just written by its own forward.
        """
        rng = self.shapes_rng("layer", tp)
        shapes = [(mb, False) for mb in self.s.grid]
        shapes += [(_random_packed(rng, self.s.max_grid_tokens), False) for _ in range(self.s.packed)]
        shapes += [(_random_padded(rng, self.s.max_grid_tokens), True) for _ in range(self.s.heldout)]
        shapes += [(_random_packed(rng, self.s.max_grid_tokens), True) for _ in range(self.s.heldout)]
        n_layers = self.s.model.n_layers

        def record(ms: float, mb: MicroBatchShape, held: bool, kind: str) -> tuple[str, LayerRecord]:
            per_layer = ms / n_layers
            return kind, LayerRecord(**ShapeJSON.of(mb).model_dump(), tp=tp, time_ms=per_layer, heldout=held)

        return [
            (
                replica.blocks_run(mb, i, forward_only),
                lambda ms, mb=mb, held=held, kind=kind: record(ms, mb, held, kind),
            )
            for i, (mb, held) in enumerate(shapes)
            for forward_only, kind in ((False, "layer"), (True, "layer_forward"))
        ]

    def head_plan(self, replica: ProfiledReplica, tp: int) -> list[Timed]:
        """The head on every token count of the grid, forward + input gradient and forward alone."""
        sizes = sorted({mb.tokens for mb in self.s.grid})
        return [
            (
                replica.head_run(n, forward_only),
                lambda ms, n=n, kind=kind: (kind, HeadRecord(tp=tp, tokens=n, time_ms=ms)),
            )
            for n in sizes
            for forward_only, kind in ((False, "head"), (True, "head_forward"))
        ]

    def step_plan(
        self, replica: ProfiledReplica, tp: int, fleet: dist.ProcessGroup | None, replicas: int
    ) -> list[Timed]:
        """Whole executor steps over random micro-batch lists (micro-batch k of task k), synced across
        the ``replicas`` replicas of ``fleet`` when given."""
        rng = self.shapes_rng("replica", tp, fleet is not None)
        steps = [_random_step(rng, self.s.max_grid_tokens) for _ in range(self.s.replica_steps)]

        def record(ms: float, step: tuple[MicroBatchShape, ...]) -> tuple[str, ReplicaRecord]:
            shapes = tuple(ShapeJSON.of(mb) for mb in step)
            return "replica", ReplicaRecord(tp=tp, sync_replicas=replicas, microbatches=shapes, time_ms=ms)

        return [(replica.step_run(step, fleet), lambda ms, step=step: record(ms, step)) for step in steps]

    def memory_record(self, replica: ProfiledReplica, config: ParallelConfig, group: dist.ProcessGroup) -> None:
        """M of ``config`` against the budget, and the memory line of its binding stage."""
        replica.prime()  # optimizer states now exist and count as static bytes
        stages = replica.stage_runs(config)
        samples: dict[str, list[tuple[int, int]]] = defaultdict(list)

        def fits(tokens: int) -> bool:
            ok = True
            for name, (static, step) in stages.items():
                replica.clear_grads()  # a step allocates its adapter gradients: they are in its peak
                peak = self.device.peak_bytes(functools.partial(step, tokens), group)
                if peak is None:  # out of device memory: above any budget, and no point of the line
                    ok = False
                    continue
                total = static + peak
                samples[name].append((tokens, total))
                ok &= total <= self.s.memory_budget_bytes
            return ok

        max_tokens = search_max_tokens(fits, start=256)
        lines = {}
        for name, points in samples.items():
            tokens, total = np.array(points, dtype=float).T
            slope, intercept = np.polyfit(tokens, total, 1)
            lines[name] = StageMemory(self.s.memory_budget_bytes, max(0.0, intercept), max(slope, 1.0))
        line = min(lines.values(), key=StageMemory.max_tokens)
        self.memory.append(
            MemoryRecord(
                tp=config.tp,
                pp=config.pp,
                recompute=config.recompute,
                max_tokens=max_tokens,
                budget_bytes=line.budget_bytes,
                static_bytes=line.static_bytes,
                bytes_per_token=line.bytes_per_token,
            )
        )

    def comm_records(self, pair: dist.ProcessGroup) -> None:
        runs = []
        for nbytes in self.s.comm_sizes:
            buf = torch.zeros(nbytes // FP32_BYTES, device=self.device.torch_device)
            runs += [self._ping_pong(buf, pair), lambda buf=buf: dist.all_reduce(buf, group=pair)]
        times = self.time(runs, pair)
        for nbytes, round_trip, allreduce in zip(self.s.comm_sizes, times[::2], times[1::2]):
            self.records["p2p"].append(SizeRecord(size=nbytes, time_ms=round_trip / 2))
            self.records["allreduce"].append(SizeRecord(size=nbytes, time_ms=allreduce))

    def _ping_pong(self, buf: torch.Tensor, pair: dist.ProcessGroup) -> Callable[[], None]:
        """One message each way between ranks 0 and 1 (half of it is one pipeline transfer)."""
        peer = 1 - self.rank

        def run() -> None:
            if self.rank == 0:
                dist.send(buf, peer, group=pair)
                dist.recv(buf, peer, group=pair)
            else:
                dist.recv(buf, peer, group=pair)
                dist.send(buf, peer, group=pair)

        return run

    def optimizer_records(self, replica: ProfiledReplica) -> None:
        """Optimizer steps (``TaskOptimizer.step``, no clipping) of the first k tasks' adapters, k = 1..n."""
        replica.prime()  # every task's optimizer has its states
        counts = range(1, replica.n_tasks + 1)
        runs = [lambda k=k: [o.step(0.0) for o in replica.optimizers[:k]] for k in counts]
        for k, ms in zip(counts, self.time(runs, None)):
            params = sum(p.numel() for t in range(k) for p in replica.replica.task_params(t))
            self.records["optimizer"].append(SizeRecord(size=params, time_ms=ms))


TIMING_CPU = "process CPU time"
TIMING_CUDA = "wall time between torch.cuda.synchronize() calls"
TIMING_COMMON = ": median of repeats, smallest over rounds; slowest replica or TP rank, every repeat behind a barrier"
MEMORY_CPU = "peak of torch.profiler [memory] events + parameter, gradient and optimizer-state bytes"
MEMORY_CUDA = (
    "torch.cuda.max_memory_allocated after reset_peak_memory_stats, less the bytes allocated before "
    "+ parameter, gradient and optimizer-state bytes; out of memory: does not fit"
)


def _rank_main(rank: int, settings: ProfileSettings, store: str, out_path: str) -> None:
    ProfileDevice(settings.device, rank).join(rank, settings.world, store)
    try:
        worker = _Worker(settings, rank)
        worker.run()
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump((dict(worker.records), worker.memory), f)
    finally:
        dist.destroy_process_group()


def measure_profile(settings: ProfileSettings) -> Profile:
    """Run the measurements in ``settings.world`` processes (``settings.start_method``); the profile has records, no
    fit."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path, store = str(Path(tmp) / "records.pkl"), str(Path(tmp) / "store")
        mp.start_processes(
            _rank_main,
            args=(settings, store, out_path),
            nprocs=settings.world,
            join=True,
            start_method=settings.start_method,
        )
        with open(out_path, "rb") as f:
            records, memory = pickle.load(f)
    on_cuda = settings.device is DeviceKind.CUDA
    return Profile(
        kind="measured",
        model=settings.model.name,
        gpu=settings.gpu,
        gpus_per_node=settings.world,
        dtype_bytes=settings.precision.bytes,
        adapters=AdaptersJSON.of(settings.adapters),
        command=settings.command,
        settings={
            "host": describe_host(settings.device),
            "processes": settings.world,
            **({"gpus_per_process": 1} if on_cuda else {"threads_per_process": 1}),
            "backend": ProfileDevice(settings.device).backend,
            "dtype": settings.precision.value,
            "warmup": settings.warmup,
            "repeats": settings.repeats,
            "rounds": settings.rounds,
            "timing": (TIMING_CUDA if on_cuda else TIMING_CPU) + TIMING_COMMON,
            "memory_budget_bytes": settings.memory_budget_bytes,
            "memory_method": MEMORY_CUDA if on_cuda else MEMORY_CPU,
            "seed": settings.seed,
        },
        memory=tuple(sorted(memory, key=lambda m: (m.tp, m.pp))),
        records=Records(**{k: tuple(v) for k, v in records.items()}),
    )
