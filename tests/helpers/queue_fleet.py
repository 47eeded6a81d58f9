"""The live queue's test fleet: a workload of the demo tasks on the tiny Llama, its add requests, and a plan of
``<1,1>`` replicas on given GPUs of a 4-GPU node (the queue's end-to-end tests and the fleet changes' unit tests)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.helpers.repo import DEMO, REPO

PROFILE = REPO / "profiles" / "tiny-llama-cpu.json"
"""The CPU profile of the tiny Llama the 4-GPU plans are priced by."""


def workload_file(path: Path, tokenizer: Path, tasks: list[str]) -> Path:
    lines = [
        "model: tiny-llama",
        f"tokenizer: {tokenizer}",
        "cluster: {gpu: cpu, nodes: 1, gpus_per_node: 1}",
        "defaults: {lora: {rank: 4, alpha: 8}, optimizer: {lr: 1.0e-2}}",
        "tasks:",
        *tasks,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def demo_task(name: str, batch: int, context: int) -> str:
    data = DEMO / f"{name}.jsonl"
    return f"  - {{name: {name}, data: {{path: {data}}}, batch_size: {batch}, context_length: {context}}}"


DOCSUM, CHAT, CODEGEN = demo_task("docsum", 3, 256), demo_task("chat", 3, 128), demo_task("codegen", 2, 256)


def add_request(queue: Path, name: str, *, batch: int, context: int, at_step: int, data: str | None = None) -> None:
    """An add request for task ``name`` on the demo task ``data``'s rows (default: its own) in the queue directory
    ``queue``."""
    rows = DEMO / f"{data or name}.jsonl"
    (queue / f"add-{name}.yaml").write_text(
        f"name: {name}\ndata: {{path: {rows}}}\nbatch_size: {batch}\ncontext_length: {context}\nat_step: {at_step}\n"
    )


def on_four_gpus(tmp_path: Path, tokenizer: Path, slots: tuple[int, ...]) -> tuple[Path, Path]:
    """``docsum`` and ``chat`` on a node of 4 GPUs, planned (``w.plan.json``) as one ``<1,1>`` replica on each
    GPU of ``slots``, the others idle: the workload's path and the CPU profile it is priced by."""
    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.planner import PlannerOptions, plan_deployment
    from lorafleet.planner.incremental import kept_plan
    from lorafleet.workload import load_workload

    path = tmp_path / "w.yaml"
    workload_file(path, tokenizer, [DOCSUM, CHAT])
    path.write_text(path.read_text().replace("gpus_per_node: 1", "gpus_per_node: 4"))
    workload = load_workload(path)
    cost_model = workload_cost_model(workload, workload_cluster(workload), PROFILE)
    planned = plan_deployment(workload, workload_cluster(workload), cost_model, PlannerOptions(robust_samples=0))
    one = next(r for r in planned.plan.replicas if r.config.n_gpus == 1)
    replicas = tuple(replace(one, replica_id=k, gpus=(gpu,)) for k, gpu in enumerate(slots))
    kept_plan(replace(planned.plan, replicas=replicas), workload, cost_model).save(path.with_suffix(".plan.json"))
    return path, PROFILE
