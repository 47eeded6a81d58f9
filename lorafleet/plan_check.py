"""The one check of a plan against the workload, cluster and cost model a command runs it with.

Every command that reads a plan (``simulate``, ``dispatch``, ``train``) calls
:func:`check_plan` before it spawns a process or writes a file, so a plan that cannot run
as planned ends with one line naming the plan file and the field, exit code 2, and nothing
done. The rules, in the order they are checked:

- the tasks, in order, are the workload's; the model and recompute policy are the workload's, and so is the
  quantized base each pool was priced over (its cost model's ``quantize``: the workload's one base, or one of the
  bases it lets the planner choose among, the same for every pool);
- the plan's pools are pools of the cluster, in its order (a pool the cluster lacks is refused), each
  of the cluster's GPU kind and GPUs per node, with at most its GPUs (:func:`check_pools`);
- replica k has id k; it is on one of the plan's pools, and its tp * pp GPUs are that pool's (global
  ranks: a pool's follow those of the plans' pools before it), unique, each stage's TP group inside
  one node of the pool (the planner's placement rule); tp and pp are legal for the model (heads,
  KV heads, layers) and the pool;
- each replica's max tokens is at most the cost model's M of its config on its pool;
- the bucket boundaries are positive, strictly increasing and cover the longest sequence
  any task can present, and some replica holds it (static buckets of the policy too).

The pipeline window the plan is priced and run in is its policy's alone (the cost model takes it as
an argument), so there is no second copy to check it against.
"""

from __future__ import annotations

from collections.abc import Callable

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import config_problems
from lorafleet.errors import InputError
from lorafleet.planner.base_choice import base_name, candidate_bases, with_base
from lorafleet.plans import DeploymentPlan
from lorafleet.runtime.base_quantization import check_base_choice
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.lora import Quantization
from lorafleet.workload import Workload

Fail = Callable[[str, str], None]


def check_plan(
    plan: DeploymentPlan, workload: Workload, cluster: ClusterSpec, cost_model: CostModel, source: str
) -> None:
    """Raise an :class:`InputError` naming ``source`` (the plan file) and the first field that breaks a rule
    (module docstring); return quietly when ``plan`` runs as planned on ``cluster`` for ``workload``."""

    def fail(field: str, msg: str) -> None:
        raise InputError(source, field, msg)

    check_fleet(plan, workload, cluster, source)
    if not plan.replicas:
        fail("replicas", "the plan has no replicas")
    _check_replicas(plan, workload, cluster, cost_model, fail)
    _check_buckets(plan, workload, fail)


def check_fleet(plan: DeploymentPlan, workload: Workload, cluster: ClusterSpec, source: str) -> None:
    """The rules that need no cost model (tasks, model, pools, recompute; module docstring): what is checked
    before the plan's cost model is built, which is built pool by pool."""
    names = tuple(t.name for t in workload.tasks)
    if plan.tasks != names:
        raise InputError(source, "tasks", f"the plan is for tasks {list(plan.tasks)}, the workload has {list(names)}")
    if plan.model != workload.model.name:
        raise InputError(
            source, "model", f"the plan is for {plan.model!r}, the workload trains {workload.model.name!r}"
        )
    check_pools(plan, cluster, source)
    check_quantize(plan, workload, source)
    if plan.recompute != workload.spec.recompute:
        raise InputError(
            source,
            "recompute",
            f"the plan was made with recompute: {plan.recompute.value}, the workload says "
            f"{workload.spec.recompute.value}",
        )


def check_quantize(plan: DeploymentPlan, workload: Workload, source: str) -> None:
    """Each pool of the plan was priced over a base the workload trains (as its cost model's origin records it): its
    one ``quantize``, or, written ``auto`` or as a list, one of its candidates, the same for every pool (one base for
    the whole fleet: a tenant split across pools learns over one function). A plan priced over NF4 holds
    micro-batches an unquantized base cannot, and one priced over bf16 misjudges a quantized fleet's times. A pool
    without a recorded cost model is not judged."""
    allowed = candidate_bases(workload)
    priced = [(k, pool.cost_model.quantize) for k, pool in enumerate(plan.pools) if pool.cost_model is not None]
    for k, base in priced:
        field = f"pools[{k}].cost_model.quantize"
        if base not in allowed:
            was = base_name(base) if base is not None else "null"
            if workload.spec.quantize_candidates is None:
                now = f"trains over quantize: {allowed[0].value if allowed[0] is not None else 'null'}"
            else:
                now = f"chooses among quantize: [{', '.join(base_name(b) for b in allowed)}]"
            raise InputError(
                source, field, f"the plan was priced over quantize: {was}, the workload {now}; re-plan for it"
            )
        if base != priced[0][1]:
            raise InputError(
                source,
                field,
                f"priced over quantize: {base_name(base)}, pools[{priced[0][0]}] over {base_name(priced[0][1])}; a "
                "fleet trains over one base",
            )


def with_plan_base(plan: DeploymentPlan, workload: Workload, source: str) -> Workload:
    """``workload`` over the base ``plan`` was priced over, once :func:`check_quantize` accepts it: a workload that
    lets the planner choose (``quantize: auto`` or a list) takes the plan's base (an unrecorded one: the
    unquantized base, as every plan before ``quantize`` was); one with its one base is returned as it is. A choice
    that includes a base the model cannot take is refused whatever the plan's (``check_base_choice``)."""
    check_quantize(plan, workload, source)
    bases = workload.spec.quantize_candidates
    if bases is None:
        return workload
    check_base_choice(workload.spec.model, workload.model.model_type, bases, workload.path)
    return with_base(workload, plan_base(plan))


def plan_base(plan: DeploymentPlan) -> Quantization | None:
    """The base ``plan`` was priced over: its first recorded pool's (:func:`check_quantize` holds them equal); None
    when no pool records one."""
    recorded = [pool.cost_model.quantize for pool in plan.pools if pool.cost_model is not None]
    return recorded[0] if recorded else None


def check_pools(plan: DeploymentPlan, cluster: ClusterSpec, source: str) -> None:
    """The rules of the plan's pools against the cluster's (module docstring)."""
    one = len(cluster.pools) == 1 and len(plan.pools) == 1
    position = {p.name: k for k, p in enumerate(cluster.pools)}
    last = -1
    for k, pool in enumerate(plan.pools):
        field = f"pools[{k}]"
        if pool.name not in position:
            has = ", ".join(repr(n) for n in cluster.pool_names)
            raise InputError(source, f"{field}.name", f"the plan has pool {pool.name!r}, the cluster has not ({has})")
        if position[pool.name] <= last:
            raise InputError(source, f"{field}.name", "the plan's pools are not in the cluster's order")
        last = position[pool.name]
        theirs = cluster.pools[position[pool.name]]
        of = "" if one else f" in pool {pool.name!r}"
        if pool.gpu.lower() != theirs.gpu.lower():
            flag = "same --gpu as for `plan`?" if one else "a kind mismatch"
            raise InputError(
                source, f"{field}.gpu", f"the plan is for {pool.gpu} GPUs{of}, the cluster has {theirs.gpu} ({flag})"
            )
        if pool.gpus_per_node != theirs.gpus_per_node:
            raise InputError(
                source,
                f"{field}.gpus_per_node",
                f"the plan has {pool.gpus_per_node} GPUs per node{of}, the cluster {theirs.gpus_per_node}",
            )
        if not 1 <= pool.n_gpus <= theirs.n_gpus:
            flag = " (same --gpus as for `plan`?)" if one else ""
            raise InputError(
                source,
                f"{field}.n_gpus",
                f"the plan needs {pool.n_gpus} GPUs{of}, the cluster has {theirs.n_gpus}{flag}",
            )


def _check_replicas(
    plan: DeploymentPlan, workload: Workload, cluster: ClusterSpec, cost_model: CostModel, fail: Fail
) -> None:
    seen: dict[int, int] = {}
    for k, replica in enumerate(plan.replicas):
        where, config = f"replicas[{k}]", replica.config
        if replica.replica_id != k:
            fail(
                f"{where}.replica_id",
                f"replica {k} has id {replica.replica_id}; ids must be 0..{len(plan.replicas) - 1} in order",
            )
        try:
            pool = plan.pool(replica.pool)
        except KeyError:
            fail(
                f"{where}.pool",
                f"the plan has no pool {replica.pool!r} ({', '.join(repr(p.name) for p in plan.pools)})",
            )
        first = plan.first_gpu(pool.name)
        if len(replica.gpus) != config.n_gpus:
            fail(
                f"{where}.gpus", f"{config} needs tp * pp = {config.n_gpus} GPUs, the replica holds {len(replica.gpus)}"
            )
        for g in replica.gpus:
            if not 0 <= g < plan.n_gpus:
                fail(f"{where}.gpus", f"GPU {g} is outside 0..{plan.n_gpus - 1}")
            if not first <= g < first + pool.n_gpus:
                fail(
                    f"{where}.gpus",
                    f"GPU {g} is not pool {pool.name!r}'s: its GPUs are {first}..{first + pool.n_gpus - 1}",
                )
            if g in seen:
                fail(f"{where}.gpus", f"GPU {g} is also in replica {seen[g]}")
            seen[g] = k
        for stage, group in enumerate(replica.stages):
            nodes = sorted({(g - first) // pool.gpus_per_node for g in group})
            if len(nodes) > 1:
                of = f" of pool {pool.name!r}" if pool.name else ""
                fail(
                    f"{where}.gpus",
                    f"stage {stage}'s TP group {list(group)} spans nodes {nodes}{of}; a TP group stays "
                    f"inside one node of {pool.gpus_per_node} GPUs",
                )
        problems = config_problems(config, workload.model, cluster)
        if problems:
            fail(f"{where}.config", f"{config}: {problems[0]}")
        capacity = cost_model.memory_tokens(config)  # a plan may hold more than the knee: slower, not wrong
        by = cost_model.pool_model(config)[0].source
        if capacity <= 0:
            on = pool.gpu + (f" (pool {pool.name!r})" if pool.name else "")
            fail(f"{where}.config", f"{config} does not fit {workload.model.name} on {on} by the cost model {by}")
        if not 1 <= replica.max_tokens <= capacity:
            fail(
                f"{where}.max_tokens",
                f"{replica.max_tokens} tokens, but {config} holds at most {capacity} per "
                f"micro-batch by the cost model {by}",
            )
    if plan.expected_replica_time_s and len(plan.expected_replica_time_s) != len(plan.replicas):
        fail("expected_replica_time_s", f"{len(plan.expected_replica_time_s)} times for {len(plan.replicas)} replicas")


def _check_buckets(plan: DeploymentPlan, workload: Workload, fail: Fail) -> None:
    longest = workload.max_length
    for field, bounds in (
        ("bucket_boundaries", plan.bucket_boundaries),
        ("policy.static_boundaries", plan.policy.static_boundaries),
    ):
        if field == "policy.static_boundaries" and not bounds:
            continue
        if not bounds:
            fail(field, "empty; a plan's buckets must cover the workload's lengths")
        if bounds[0] < 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            fail(field, f"must be positive and strictly increasing, got {list(bounds)}")
        if bounds[-1] < longest:
            fail(
                field, f"the top bucket {bounds[-1]} does not cover the workload's longest sequence ({longest} tokens)"
            )
    for task in workload.tasks:
        if not plan.holds(task.lengths.max_length):
            fail(
                "replicas",
                f"no replica holds task {task.name!r}'s {task.lengths.max_length}-token sequences "
                f"(largest max_tokens {plan.largest_max_tokens})",
            )
