"""Who pays what: one step's GPU-seconds shared out among the tasks whose sequences it ran; and what
holding a deployment costs in money, on pools with prices (:func:`price_per_second`).

The fleet is held for the whole step, idle or not, so with ``M`` the measured makespan, ``g_r`` the
GPUs of replica ``r`` and ``G = Σ_r g_r`` (``DeploymentPlan.used_gpus``) the step costs::

    C = M * G                  replica r's part:  C_r = M * g_r = b_r * g_r  +  (M - b_r) * g_r
                                                                  (busy part)     (idle part)

with ``b_r`` replica r's measured busy time (``StepReport.replica_busy_s``).

**Busy part: by the tasks' share of the replica's time.** The busy time is measured per replica
only, so within r it is split by the cost model. Micro-batch k of r takes τ_k (its stage time,
``CostModel.shape_time``); in a micro-batch that mixes tasks, task t's part of τ_k is in proportion
to the stage time of t's rows of k alone, S_{k,t} (padded to k's length when k is padded: a task
pays for its own padding)::

    φ_{k,t} = τ(S_{k,t}) / Σ_u τ(S_{k,u})            s_{r,t} = Σ_k τ_k φ_{k,t} / Σ_k τ_k

(Σ_t φ_{k,t} = 1 and Σ_t s_{r,t} = 1.) The rest of r's estimate, the pipeline bubble (slots x the
largest τ_k), the adapters' gradient all-reduce and the optimizer step, is there for all of r's
micro-batches together, so it is spread in the same proportions: ``s_{r,t}`` is t's share of r's
whole estimated time. The speed factors of a recalibrated dispatch scale a replica's estimates
uniformly and cancel in these ratios. Task t's busy GPU-seconds are then, with measured time
scaling *between* replicas (a replica twice as slow costs its tasks twice as much)::

    B_t = Σ_r b_r * g_r * s_{r,t}                    B = Σ_t B_t = Σ_{r with work} b_r * g_r

**Idle part: by everyone in the step.** A replica idles because the step waits for its slowest
replica (the adapters' gradients are all-reduced across all of them), not because of the
sequences it ran, so the whole idle pool ``I = C - B`` (idle time of every replica, and all of the
part of a replica without work) is shared by the step's tasks in proportion to their busy
GPU-seconds over the fleet. Both parts together give the closed form::

    cost_t = B_t + I * B_t / B = C * B_t / B

So Σ_t cost_t = C (to float rounding) and every cost_t >= 0, even when a measured busy time
exceeds the makespan (clock skew between ranks: the pool is then smaller, never negative per task).

Degenerate steps: when no replica with work measured any busy time (B = 0), the replicas' cost
model estimates (``ReplicaWork.estimated_time_s``) stand in for b_r; when those are 0 as well, the
real tokens do. Where the cost model gives a micro-batch or replica no time, its split is by real
tokens. A step without a single sequence has no task to charge: every value is 0 and its cost is
left unattributed.

Pure numpy and lorafleet's types (no torch), so the trainer, the simulator and the report share it. The
sums of these over steps and phases are the run summary's (``lorafleet.metrics.summary``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.plans import DeploymentPlan, MicroBatch, StepPlan, StepReport
from lorafleet.specs.cluster import ClusterSpec

SECONDS_PER_HOUR = 3600.0


def price_per_second(plan: DeploymentPlan, cluster: ClusterSpec) -> float | None:
    """What holding ``plan``'s replicas costs a second, in the pools' currency::

        price = Σ_r price_per_gpu_hour(pool of r) * g_r / 3600

    (every GPU a replica holds is paid for the whole step, as GPU-seconds count it); a step of makespan M
    costs M * price. None when a pool the replicas use has no price (or is not the cluster's)."""
    prices = {p.name: p.price_per_gpu_hour for p in cluster.pools}
    total = 0.0
    for replica in plan.replicas:
        price = prices.get(replica.pool)
        if price is None:
            return None
        total += price * replica.config.n_gpus
    return total / SECONDS_PER_HOUR


def _split_by_tokens(mb: MicroBatch, n_tasks: int) -> np.ndarray:
    out = np.zeros(n_tasks)
    np.add.at(out, np.asarray(mb.task_ids, dtype=np.int64), np.asarray(mb.lengths, dtype=float))
    total = out.sum()
    return out / total if total > 0 else out


def _microbatch_split(cost_model: CostModel, config: ParallelConfig, mb: MicroBatch, n_tasks: int) -> np.ndarray:
    """φ_{k,·}: each task's fraction of micro-batch ``mb`` (sums to 1 when it holds a sequence)."""
    tasks = sorted(set(mb.task_ids))
    out = np.zeros(n_tasks)
    if len(tasks) == 1:
        out[tasks[0]] = 1.0
        return out
    rows = {t: [n for task, n in zip(mb.task_ids, mb.lengths) if task == t] for t in tasks}
    alone = [MicroBatchShape(seq_lens=tuple(rows[t]), padded_len=mb.padded_len) for t in tasks]
    times = np.asarray(cost_model.stage_coeffs(config).shapes(alone), dtype=float)
    if not (np.all(np.isfinite(times)) and np.all(times >= 0) and times.sum() > 0):
        return _split_by_tokens(mb, n_tasks)
    out[tasks] = times / times.sum()
    return out


def replica_task_shares(step_plan: StepPlan, plan: DeploymentPlan, cost_model: CostModel, n_tasks: int) -> np.ndarray:
    """s_{r,t}: task t's share of replica r's estimated time in ``step_plan`` (see the module docstring).

    Returns an array (replicas, n_tasks), in ``plan.replicas`` order: each row sums to 1 for a
    replica with work, and is all 0 for one without. Task ids of the micro-batches index columns.
    """
    if len(step_plan.work) != len(plan.replicas):
        raise ValueError(
            f"step {step_plan.step} has work for {len(step_plan.work)} replicas, the plan has {len(plan.replicas)}"
        )
    shares = np.zeros((len(plan.replicas), n_tasks))
    for r, (replica, work) in enumerate(zip(plan.replicas, step_plan.work)):
        mbs = [mb for mb in work.microbatches if mb.lengths]
        if not mbs:
            continue
        if max(max(mb.task_ids) for mb in mbs) >= n_tasks or min(min(mb.task_ids) for mb in mbs) < 0:
            raise ValueError(
                f"step {step_plan.step}: a micro-batch of replica {r} names a task outside 0..{n_tasks - 1}"
            )
        tau = np.asarray(cost_model.stage_coeffs(replica.config).shapes([mb.shape for mb in mbs]), dtype=float)
        if np.all(np.isfinite(tau)) and np.all(tau >= 0) and tau.sum() > 0:
            for t_k, mb in zip(tau, mbs):
                if t_k > 0:
                    shares[r] += t_k * _microbatch_split(cost_model, replica.config, mb, n_tasks)
        else:  # a cost model that prices nothing here: by real tokens
            for mb in mbs:
                shares[r] += sum(mb.lengths) * _split_by_tokens(mb, n_tasks)
        total = shares[r].sum()
        shares[r] = shares[r] / total if total > 0 else shares[r]
    return shares


def task_gpu_seconds(
    step_plan: StepPlan,
    report: StepReport,
    plan: DeploymentPlan,
    cost_model: CostModel,
    names: Sequence[str],
) -> dict[str, float]:
    """GPU-seconds each task owes for one step: ``C * B_t / B`` (module docstring), C = makespan x used GPUs.

    ``step_plan`` is the plan the executor ran for ``report`` (same step; its micro-batches' task ids
    index ``names``), ``plan`` the deployment (replica order and GPUs), ``cost_model`` what splits a
    replica's time among its tasks. Returns every name of ``names``, in order, 0.0 for a task with
    no sequence in the step; the values sum to makespan x ``plan.used_gpus`` (unless the step ran no
    sequence at all: then all are 0). ValueError when the plan, step plan and report disagree on the
    replicas or the step, or a time is not a finite number >= 0.
    """
    if step_plan.step != report.step:
        raise ValueError(f"the step plan is for step {step_plan.step}, the report for step {report.step}")
    n = len(plan.replicas)
    if len(report.replica_busy_s) != n:
        raise ValueError(f"step {report.step} reports {len(report.replica_busy_s)} replicas, the plan has {n}")
    busy = np.asarray(report.replica_busy_s, dtype=float)
    makespan = float(report.makespan_s)
    if not (math.isfinite(makespan) and makespan >= 0 and np.all(np.isfinite(busy)) and np.all(busy >= 0)):
        raise ValueError(f"step {report.step}: times must be finite numbers >= 0 (makespan {makespan}, busy {busy})")
    shares = replica_task_shares(step_plan, plan, cost_model, len(names))
    gpus = np.array([r.config.n_gpus for r in plan.replicas], dtype=float)
    busy_gpu_s = shares * (busy * gpus)[:, None]  # B_{r,t}
    if busy_gpu_s.sum() <= 0:  # nothing measured busy where there was work: the estimates, then the tokens
        estimate = np.array([max(w.estimated_time_s, 0.0) for w in step_plan.work], dtype=float)
        if not np.all(np.isfinite(estimate)):
            estimate = np.zeros(n)
        busy_gpu_s = shares * (estimate * gpus)[:, None]
        if busy_gpu_s.sum() <= 0:
            tokens = np.array([sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work], dtype=float)
            busy_gpu_s = shares * (tokens * gpus)[:, None]
    per_task = busy_gpu_s.sum(axis=0)  # B_t
    total = per_task.sum()  # B
    cost = makespan * plan.used_gpus  # C
    owed = per_task * (cost / total) if total > 0 else np.zeros(len(names))
    return {name: float(v) for name, v in zip(names, owed)}
