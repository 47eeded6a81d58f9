"""The profiler's replica: the torch executor's own, and the runs the profiler times on it.

Every rank builds what ``lorafleet train`` builds, with ``executor.torch.replica.build_replica``,
on its own device (``device.ProfileDevice``: a CPU process or one GPU) in the profile's precision:
a seeded random base model of the ModelSpec (``load_causal_lm``), every task's adapter injected
as ``MultiLoraLinear`` (one base GEMM, one low-rank update per segment of rows), Megatron TP
over the process group (``executor.torch.tp``), from a plan of ``world // tp`` replicas of
⟨tp, 1⟩ side by side on the busy ranks (idle ranks get no replica). Each task steps its own
``TaskOptimizer``.

Micro-batches are the executor's ``MicroBatch``: ``b`` rows padded to ``s``, or one row of
packed sequences, of random tokens that are all learned (labels = inputs). The profiler gives
each micro-batch one task, as LobRA forms its full micro-batches. ``build_inputs`` lays them
out (attention through ``executor.torch.attention.document_attention``: a padded row
causally, a packed row per sequence, Σ s_i² pairs, as the cost model prices it),
``stage_forward`` runs them.

What is timed:

- ``blocks_run``: ``build_inputs`` and forward + backward of all L blocks from a hidden state
  that needs its gradient (a middle pipeline stage over every layer; a layer record is this
  over L, so each block carries 1/L of the micro-batch's mask);
- ``head_run``: embedding, rotary table, final norm, LM head and the weighted token loss,
  forward + input gradient;
- both again forward only (``forward_only``: under ``torch.no_grad``, as an evaluation runs them);
- ``step_run``: a whole step of one rank, as ``TorchExecutor`` runs it: ``run_rank_step``
  (1F1B over the micro-batches), then, within a fleet, the adapter-gradient sum
  (``grad_sync``) and one all-reduce of the per-task squared norms, then every task with
  tokens steps its optimizer clipped by its norm.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.data.model_source import ModelSource, SourceKind
from lorafleet.data.tokenize import Example
from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.executor.torch.optim import TaskOptimizer
from lorafleet.executor.torch.pipeline import microbatch_shape
from lorafleet.executor.torch.precision import Precision, torch_dtype
from lorafleet.executor.torch.replica import build_replica
from lorafleet.executor.torch.step import (
    MicroBatchInputs,
    build_inputs,
    inverse_token_counts,
    run_rank_step,
    stage_forward,
    weighted_losses,
)
from lorafleet.plans import DeploymentPlan, MicroBatch, PlanPool, ReplicaSpec
from lorafleet.profiling.device import ProfileDevice
from lorafleet.profiling.stages import only_layers, part_role, role_in, stage_layout
from lorafleet.specs.lora import LoraSpec, OptimizerSpec
from lorafleet.specs.model import ModelSpec

#: Optimizer steps a profiling task's schedule spans (the rate never reaches its floor while profiling).
SCHEDULE_STEPS = 1 << 20
#: M of the profiling plan's replicas: the executor never reads it (the profiler picks the shapes).
MAX_TOKENS = 1 << 20


def adapter_specs(adapters: AdapterLoad) -> list[LoraSpec]:
    """One LoRA spec per task of the load (alpha = rank, no dropout)."""
    return [LoraSpec(rank=t.rank, alpha=t.rank, target_modules=t.targets) for t in adapters.tasks]


def side_by_side_plan(spec: ModelSpec, tp: int, busy: int, world: int, n_tasks: int) -> DeploymentPlan:
    """``busy // tp`` replicas of ⟨tp, 1⟩ on ranks 0..busy-1 of a world of ``world``."""
    replicas = tuple(
        ReplicaSpec(i, ParallelConfig(tp, 1), MAX_TOKENS, tuple(range(i * tp, (i + 1) * tp))) for i in range(busy // tp)
    )
    return DeploymentPlan(
        model=spec.name,
        pools=(PlanPool(name="", gpu="cpu", n_gpus=world, gpus_per_node=world),),
        tasks=tuple(f"task{t}" for t in range(n_tasks)),
        replicas=replicas,
        bucket_boundaries=(),
        expected_makespan_s=0.0,
    )


def microbatches(shapes: Sequence[MicroBatchShape], tasks: Iterable[int]) -> tuple[MicroBatch, ...]:
    """Micro-batch k laid out as ``shapes[k]``, every sequence of task ``tasks[k]``; sequences numbered 0, 1, ..."""
    out, first = [], 0
    for shape, task in zip(shapes, tasks):
        n = shape.n_seqs
        out.append(MicroBatch(tuple(range(first, first + n)), (task,) * n, shape.seq_lens, shape.padded_len))
        first += n
    return tuple(out)


def random_examples(mbs: Sequence[MicroBatch], vocab: int, rng: random.Random) -> dict[int, Example]:
    """Random tokens for every sequence of ``mbs``, each one a label (the whole sequence is learned)."""
    examples = {}
    for mb in mbs:
        for q, n in zip(mb.seq_ids, mb.lengths):
            ids = tuple(rng.randrange(vocab) for _ in range(n))
            examples[q] = Example(ids, ids)
    return examples


def inverse_counts(mbs: Sequence[MicroBatch], examples: dict[int, Example], n_tasks: int) -> list[float]:
    """``1 / N_t`` per task over the micro-batches (0 for a task without tokens), as the executor weights losses."""
    seqs = [(task, examples[q]) for mb in mbs for q, task in zip(mb.seq_ids, mb.task_ids)]
    return inverse_token_counts([t for t, _ in seqs], [e for _, e in seqs], n_tasks)


class ProfiledReplica:
    """This rank's part of the executor replicas of one TP degree, its task optimizers, and timed runs."""

    def __init__(
        self,
        spec: ModelSpec,
        adapters: AdapterLoad,
        tp: int,
        rank: int,
        busy: int,
        world: int,
        seed: int = 0,
        device: ProfileDevice = ProfileDevice(),
        precision: Precision = Precision.FP32,
    ) -> None:
        """Collective (``build_replica`` creates process groups): every rank of the world calls it.

        ``device``: where this rank computes; ``precision``: the dtype of the base and the activations
        (the adapters are fp32 masters over bf16, ``multi_lora.adapter_dtype``).
        """
        self.spec = spec
        self.n_tasks = adapters.n_tasks
        self.rng = random.Random(seed)
        self.device = device.torch_device
        self.dtype = torch_dtype(precision)
        model = load_causal_lm(ModelSource(kind=SourceKind.RANDOM, name=spec.name, spec=spec, seed=seed), self.dtype)
        plan = side_by_side_plan(spec, tp, busy, world, self.n_tasks)
        self.replica = build_replica(
            model,
            specs := adapter_specs(adapters),
            plan,
            rank,
            world,
            seeds=range(seed, seed + len(specs)),
            device=self.device,
        )
        optimizer = OptimizerSpec(name=adapters.optimizer)
        self.optimizers = [
            TaskOptimizer(optimizer, self.replica.task_params(t), SCHEDULE_STEPS) for t in range(self.n_tasks)
        ]

    @property
    def active(self) -> bool:
        """Whether this rank holds a replica (false on a rank the degree leaves idle)."""
        return self.replica.role is not None

    @property
    def model(self) -> torch.nn.Module:
        return self.replica.model

    @property
    def tp_position(self) -> tuple[int, int]:
        """(TP degree, this rank's TP rank)."""
        role = self.replica.role
        return role.replica.tp, role.tp_rank

    def _one(self, shape: MicroBatchShape, task: int) -> tuple[MicroBatch, list[Example], list[float]]:
        """One micro-batch of task ``task`` (mod n), its examples in order, and ``1 / N_t`` per task."""
        (mb,) = microbatches([shape], [task % self.n_tasks])
        examples = random_examples([mb], self.spec.vocab, self.rng)
        return mb, [examples[q] for q in mb.seq_ids], inverse_counts([mb], examples, self.n_tasks)

    def _row(self, tokens: int) -> MicroBatchInputs:
        """The executor's inputs of one sequence of ``tokens`` tokens (task 0)."""
        return build_inputs(*self._one(MicroBatchShape.padded(1, tokens), 0), self.device)

    def blocks_run(self, shape: MicroBatchShape, task: int, forward_only: bool = False) -> Callable[[], None]:
        """``build_inputs`` and forward + backward of all L blocks on one micro-batch of task ``task``; with
        ``forward_only``, the forward alone under ``torch.no_grad`` (as an evaluation runs it: nothing kept)."""
        mb, examples, inv = self._one(shape, task)
        x = torch.randn(
            *microbatch_shape(mb),
            self.spec.hidden,
            dtype=self.dtype,
            device=self.device,
            requires_grad=not forward_only,
        )
        role = part_role(*self.tp_position, embeds=False, heads=False)

        def forward() -> torch.Tensor:
            return stage_forward(self.model, role, x, build_inputs(mb, examples, inv, self.device))

        if forward_only:
            return self._no_grad(forward)
        grad = torch.randn_like(x)
        return lambda: forward().backward(grad)

    def head_run(self, tokens: int, forward_only: bool = False) -> Callable[[], None]:
        """Embedding, then a last stage over no layer (norm, LM head, loss), forward + input gradient; with
        ``forward_only``, forward alone under ``torch.no_grad``."""
        inputs = self._row(tokens)
        role = part_role(*self.tp_position, embeds=False, heads=True)

        def losses() -> torch.Tensor:
            # The embedding's output stands for the last block's: the head's backward must produce its gradient.
            x = self.model.model.embed_tokens(inputs.input_ids).detach().requires_grad_(not forward_only)
            with only_layers(self.model, ()):
                return weighted_losses(self.model, role, x, inputs).sum()

        return self._no_grad(losses) if forward_only else lambda: losses().backward()

    @staticmethod
    def _no_grad(run: Callable[[], object]) -> Callable[[], None]:
        def forward() -> None:
            with torch.no_grad():
                run()

        return forward

    def step_run(self, shapes: Sequence[MicroBatchShape], fleet: dist.ProcessGroup | None) -> Callable[[], None]:
        """One executor step over micro-batches ``shapes`` (micro-batch k of task k mod n).

        ``fleet``: the ranks of every replica the step syncs with (adapter-gradient sum and the
        norms' all-reduce); None for a TP1 replica alone, which has nothing to reduce.
        """
        mbs = microbatches(shapes, [k % self.n_tasks for k in range(len(shapes))])
        examples = random_examples(mbs, self.spec.vocab, self.rng)
        inv = inverse_counts(mbs, examples, self.n_tasks)
        stepping = [t for t in range(self.n_tasks) if inv[t]]
        r = self.replica

        def run() -> None:
            run_rank_step(r.model, r.role, r.neighbours, mbs, examples, inv)
            if fleet is not None:
                r.grad_sync.all_reduce(stepping)
            norms = r.grad_sync.squared_norms(self.n_tasks, stepping)  # on the host
            if fleet is not None:
                norms = norms.to(self.device)  # NCCL reduces device tensors only (a no-op on CPU)
                dist.all_reduce(norms, group=fleet)
            for t in stepping:
                self.optimizers[t].step(math.sqrt(float(norms[t])))

        return run

    def prime(self) -> None:
        """One tiny step of every task: every optimizer now has its states, as after any first step."""
        self.step_run([MicroBatchShape.padded(1, 8)] * self.n_tasks, None)()

    def stage_runs(self, config: ParallelConfig) -> dict[str, tuple[int, Callable[[int], None]]]:
        """Per binding stage of ``config`` on this rank's TP shard: its static bytes and a run on a
        micro-batch of n tokens (forward and backward, no optimizer step).

        pp = 1: the whole step. pp > 1: the first stage under 1F1B's warm-up (pp micro-batches of
        its layers forward, all held, then their backwards) and the last (received activations,
        its layers, head and loss). With ``config.recompute`` every block runs as the executor
        runs it then, under activation checkpointing.
        """
        tp, tp_rank = self.tp_position
        layout = stage_layout(tp, config.pp, self.spec.n_layers, config.recompute)
        first, last = role_in(layout, 0, tp_rank), role_in(layout, config.pp - 1, tp_rank)
        if config.pp == 1:
            r = self.replica

            def whole(tokens: int) -> None:
                mb, examples, inv = self._one(MicroBatchShape.padded(1, tokens), 0)
                run_rank_step(r.model, first, r.neighbours, (mb,), dict(zip(mb.seq_ids, examples)), inv)

            return {"replica": (self.static_bytes(first.layers, True, True), whole)}

        def first_stage(tokens: int) -> None:
            outputs = []
            with only_layers(self.model, first.layers):
                for _ in range(config.pp):
                    outputs.append(stage_forward(self.model, first, None, self._row(tokens)))
            for out in outputs:
                out.backward(torch.ones_like(out))  # the gradient the next stage would send back

        def last_stage(tokens: int) -> None:
            inputs = self._row(tokens)
            received = torch.randn(
                1, tokens, self.spec.hidden, dtype=self.dtype, device=self.device, requires_grad=True
            )
            with only_layers(self.model, last.layers):
                weighted_losses(self.model, last, received, inputs).sum().backward()

        return {
            "first": (self.static_bytes(first.layers, True, False), first_stage),
            "last": (self.static_bytes(last.layers, False, True), last_stage),
        }

    def clear_grads(self) -> None:
        """Frees every adapter gradient, as each task's optimizer step does: a measured run allocates them anew."""
        for p in self.replica.params.values():
            p.grad = None

    def static_bytes(self, layers: Iterable[int], first: bool, last: bool) -> int:
        """Bytes a stage holding ``layers`` keeps between steps: frozen weights and adapters, any
        gradient that exists, and the optimizer states (after ``prime``, so they exist)."""
        inner = self.model.model
        modules = [inner.layers[str(i)] for i in layers]
        modules += [inner.embed_tokens] if first else []
        modules += [inner.norm, self.model.lm_head] if last else []
        states = {id(p): state for o in self.optimizers if o.optimizer for p, state in o.optimizer.state.items()}
        seen: set[int] = set()
        total = 0
        for p in (p for m in modules for p in m.parameters()):
            if id(p) in seen:  # tied embeddings
                continue
            seen.add(id(p))
            tensors = [p, p.grad, *states.get(id(p), {}).values()]
            total += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
        return total
