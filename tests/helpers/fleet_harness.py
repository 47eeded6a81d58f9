"""Builds fleets by hand for the executor tests: tiny model, synthetic tasks, StepPlans, gloo worlds.

The dispatcher is not used: :func:`make_step_plan` places sequences on replicas by a fixed
rule, so a test controls exactly which replica sees which task.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.data.model_source import ModelSource, SourceKind
from lorafleet.data.tokenize import IGNORE_INDEX, Example
from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.executor.torch.families import base_attention
from lorafleet.executor.torch.quantized_base import quantize_base
from lorafleet.executor.torch.worker import ExecutorConfig, TaskTraining, TorchExecutor
from lorafleet.plans import (
    DeploymentPlan,
    GlobalBatch,
    MicroBatch,
    PlanPool,
    ReplicaSpec,
    ReplicaWork,
    StepPlan,
    StepReport,
)
from lorafleet.runtime.data_stream import DataStreams, TaskData
from lorafleet.specs.architecture import model_lora
from lorafleet.specs.lora import LoraSpec, OptimizerSpec, Quantization
from lorafleet.specs.model import MODEL_PRESETS

TINY = ModelSource(kind=SourceKind.RANDOM, name="tiny-llama", spec=MODEL_PRESETS["tiny-llama"], seed=0)
VOCAB = MODEL_PRESETS["tiny-llama"].vocab


#: Tiny random models of every supported family but Llama, one shape (GQA: 4 query heads share 2 key/value heads),
#: built from transformers' own config and model classes. Each family's particulars are switched on and made to
#: matter: sliding windows of 8 tokens (shorter than most sequences), on alternate layers where the family
#: alternates; Gemma 2's soft caps small enough to bend its scores and logits.
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # biased q/k/v projections
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
        },
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 8, "pad_token_id": 0, "eos_token_id": 2}),
}


def build_model(family: str = "llama", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """tiny-llama, or a seeded model of another family (:data:`FAMILIES`) of the same shape; frozen, eval mode."""
    if family == "llama":
        return load_causal_lm(TINY, dtype)
    config_cls, model_cls, particulars = FAMILIES[family]
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    attention = base_attention(config_cls.model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**shape, **particulars, attn_implementation=attention))
    return model.to(dtype).eval().requires_grad_(False)


#: Three tasks that differ in rank, scaling, targets and schedule.
TASKS = (
    TaskTraining(
        name="summary",
        lora=LoraSpec(rank=4, alpha=8),
        total_steps=4,
        optimizer=OptimizerSpec(lr=3e-4, warmup_steps=1, grad_clip=1.0),
    ),
    TaskTraining(
        name="code",
        lora=LoraSpec(rank=8, alpha=4, target_modules=("q_proj", "v_proj", "down_proj"), use_rslora=True),
        total_steps=4,
        optimizer=OptimizerSpec(lr=1e-4, schedule="linear", weight_decay=0.01, grad_clip=0.05),
    ),
    TaskTraining(
        name="chat",
        lora=LoraSpec(rank=2, alpha=16, target_modules=("o_proj", "gate_proj", "up_proj", "k_proj")),
        total_steps=4,
        optimizer=OptimizerSpec(lr=5e-4, schedule="constant", grad_clip=0.0),
    ),
    # The same adapter and optimizer as "summary", other data: a mix-up of the two would pass
    # unnoticed by shapes, only by values.
    TaskTraining(
        name="summary-b",
        lora=LoraSpec(rank=4, alpha=8),
        total_steps=4,
        optimizer=OptimizerSpec(lr=3e-4, warmup_steps=1, grad_clip=1.0),
    ),
)
BATCH_SIZES = (3, 4, 3, 2)


def family_tasks(family: str) -> tuple[TaskTraining, ...]:
    """:data:`TASKS` as a workload for ``family`` would give them: on Phi-3, whose q/k/v and gate/up are fused, "code"
    names the fused ``qkv_proj`` and "chat" the whole gate and up (the executor maps the Llama names onto the fused
    ones, ``specs.architecture``); the same on every other family."""
    if family != "phi3":
        return TASKS
    targets = {"code": ("qkv_proj", "down_proj"), "chat": ("o_proj", "gate_proj", "up_proj")}
    return tuple(
        replace(t, lora=t.lora.model_copy(update={"target_modules": targets[t.name]})) if t.name in targets else t
        for t in TASKS
    )


def model_tasks(family: str) -> tuple[TaskTraining, ...]:
    """:func:`family_tasks` with the targets as the model names them (what the executor trains and exports)."""
    model_type = FAMILIES[family][0].model_type if family != "llama" else "llama"
    return tuple(replace(t, lora=model_lora(t.lora, model_type)) for t in family_tasks(family))


def synthetic_task(name: str, n: int, lengths: tuple[int, int], seed: int) -> TaskData:
    """``n`` random sequences with lengths in ``lengths``; the first third of each is an unlearned prompt."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = tuple(int(i) for i in rng.integers(3, VOCAB, length))
        prompt = max(1, length // 3)
        examples.append(Example(ids, (IGNORE_INDEX,) * prompt + ids[prompt:]))
    return TaskData(name, tuple(examples))


def synthetic_streams(batch_sizes: Sequence[int] = BATCH_SIZES, seed: int = 7) -> DataStreams:
    """Each task's examples, lengths differing by task; the same streams in every process."""
    lengths = [(4, 12), (10, 24), (6, 16), (4, 12)]
    tasks = [synthetic_task(t.name, 20, lengths[i], seed + i) for i, t in enumerate(TASKS)]
    return DataStreams(tasks, batch_sizes, seed)


def plan_of(
    *replicas: tuple[int, int] | tuple[int, int, bool],
    max_tokens: int = 4096,
    gpu: str = "cpu",
    gpus_per_node: int | None = None,
    cost_model: CostModelOrigin | None = None,
) -> DeploymentPlan:
    """Replicas of the given (tp, pp) or (tp, pp, recompute), on consecutive ranks of one unnamed pool of
    ``gpu`` (one node of every rank unless ``gpus_per_node`` says otherwise)."""
    specs, next_rank = [], 0
    for i, layout in enumerate(replicas):
        config = ParallelConfig(*layout)
        specs.append(ReplicaSpec(i, config, max_tokens, tuple(range(next_rank, next_rank + config.n_gpus))))
        next_rank += config.n_gpus
    return DeploymentPlan(
        model="tiny-llama",
        pools=(PlanPool("", gpu, next_rank, gpus_per_node or next_rank, cost_model),),
        tasks=tuple(t.name for t in TASKS),
        replicas=tuple(specs),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
    )


def make_step_plan(batch: GlobalBatch, n_replicas: int, *, per_microbatch: int = 3, packed: bool = False) -> StepPlan:
    """Sequence ``i`` goes to replica ``i mod n``; each replica's sequences, grouped by task, are cut
    into micro-batches of ``per_microbatch`` (padded to their longest, or packed)."""
    work = []
    for r in range(n_replicas):
        seqs = sorted(range(r, len(batch), n_replicas), key=lambda q: (int(batch.task_ids[q]), q))
        mbs = []
        for k in range(0, len(seqs), per_microbatch):
            chunk = seqs[k : k + per_microbatch]
            lengths = tuple(int(batch.lengths[q]) for q in chunk)
            mbs.append(
                MicroBatch(
                    tuple(chunk),
                    tuple(int(batch.task_ids[q]) for q in chunk),
                    lengths,
                    None if packed else max(lengths),
                )
            )
        work.append(ReplicaWork(r, tuple(mbs), 0.0))
    return StepPlan(step=batch.step, bucket_boundaries=(), work=tuple(work), estimated_makespan_s=0.0)


@dataclass(frozen=True)
class Run:
    """One training run of a fleet: the plan, the steps, the layout of micro-batches, checkpoints."""

    plan: DeploymentPlan
    steps: int
    packed: bool = False
    per_microbatch: int = 3
    seed: int = 0
    out: str = ""
    """Directory: the final checkpoint goes to ``out/final``."""
    save_at: tuple[int, ...] = ()
    """Also checkpoint into ``out/ckpt`` after these step counts."""
    resume_from: str = ""
    """Restore the latest checkpoint of this directory first, then run up to ``steps``."""
    dtype: torch.dtype = torch.float32
    """Of the base model and the adapters."""
    family: str = "llama"
    """Model family (:func:`build_model`)."""
    window: int = 1
    """Steps per pipeline window (``TorchExecutor.run_steps``); windows also end at ``save_at``."""
    tasks: tuple[TaskTraining, ...] = TASKS
    """The tasks (their names and data are :data:`TASKS`'; their adapters and optimizers may differ)."""
    quantize: Quantization | None = None
    """Train over a quantized base (``executor.torch.quantized_base.quantize_base`` of the whole model)."""


def train(run: Run) -> list[StepReport]:
    """The training loop of every rank (rank 0 drives, the others serve)."""
    config = ExecutorConfig(plan=run.plan, tasks=run.tasks, seed=run.seed, base_model="tiny-llama")
    model = build_model(run.family, run.dtype)
    if run.quantize is not None:
        quantize_base(model, run.quantize)
    executor = TorchExecutor(config, model, synthetic_streams(), torch.device("cpu"))
    if dist.get_rank() != 0:
        executor.serve()
        return []
    start = 0
    if run.resume_from:
        start = executor.restore_checkpoint(run.resume_from).step
    reports = []
    step = start
    while step < run.steps:
        end = min([run.steps, step + run.window, *(s for s in run.save_at if s > step)])
        plans = []
        for s in range(step, end):
            batch = executor.next_global_batch(s)
            plans.append(
                make_step_plan(batch, len(run.plan.replicas), per_microbatch=run.per_microbatch, packed=run.packed)
            )
        reports.extend(executor.run_steps(plans))
        step = end
        if step in run.save_at:
            executor.save_checkpoint(Path(run.out) / "ckpt", step)
    executor.save_checkpoint(Path(run.out) / "final", run.steps)
    executor.close()
    return reports


def _rank_main(
    rank: int, world: int, init_file: str, runs: Sequence[Run], result_file: str, body: Callable = train
) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = [body(run) for run in runs]
        if rank == 0:
            Path(result_file).write_bytes(pickle.dumps(results))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, runs: Sequence[Run], tmp: Path, body: Callable = train) -> list:
    """Runs ``runs`` one after another in one world of ``world`` gloo processes, each by ``body`` (every rank's loop,
    :func:`train` by default); rank 0's results (reports)."""
    init_file, result_file = tmp / "init", tmp / "reports.pkl"
    for path in (init_file, result_file):
        path.unlink(missing_ok=True)
    # fork, not spawn: a spawned child re-imports torch, transformers and peft (~8 s each when
    # four share two cores); a forked one starts with the test process's modules.
    mp.start_processes(
        _rank_main, args=(world, str(init_file), list(runs), str(result_file), body), nprocs=world, start_method="fork"
    )
    return pickle.loads(result_file.read_bytes())
