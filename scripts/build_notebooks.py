"""Write the capacity-planning notebooks in notebooks/ from the cells below, then execute them.

    .venv/bin/python scripts/build_notebooks.py [NAME.ipynb ...]

The notebooks are generated (not edited by hand) so their code stays reviewable here; CI
re-executes them top to bottom (tests/test_notebooks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]

CAPACITY = [
    (
        "md",
        """# Capacity planning for a tenant mix

Six tenants fine-tune LoRA adapters on Llama2-7B (LobRA's 7B workload). Questions a
service provider asks before buying or reserving GPUs:

1. What do the tenants cost per step on 16 GPUs, with lorafleet's heterogeneous plan and
   with the homogeneous baselines?
2. What does adding a long-document tenant (BillSum, ~3.9K tokens on average) cost?
3. How many GPUs meet a deadline of 2,000 steps in 6 hours?

Everything below runs on the analytic cost model of the GPU datasheet and the simulated
executor, so it needs no GPU.""",
    ),
    (
        "code",
        """from pathlib import Path
import pandas as pd
from lorafleet.workload import load_workload
from lorafleet.whatif import Variation, sweep

root = Path.cwd() if (Path.cwd() / "examples").exists() else Path.cwd().parent
workload = load_workload(root / "examples" / "lobra-7b.yaml")
[(t.name, t.batch_size, round(t.lengths.mean)) for t in workload.tasks]""",
    ),
    ("md", "## 1. Today's mix on 16 x A100-40GB"),
    (
        "code",
        """rows = sweep(workload, [Variation.parse("gpus=16")], steps=2)
today = pd.DataFrame(rows)[["method", "plan", "step_s", "gpu_s_per_step"]]
today""",
    ),
    ("md", "## 2. Adding a long-document tenant"),
    (
        "code",
        """rows = sweep(workload, [Variation.parse("tasks=none,+billsum")], steps=2)
mix = pd.DataFrame(rows).pivot(index="method", columns="vary_tasks", values="gpu_s_per_step")
mix["extra GPU-s per step"] = mix["+billsum"] - mix["none"]
mix.round(1)""",
    ),
    (
        "md",
        """lorafleet absorbs the new tenant on extra high-TP replicas while the short tasks keep their
TP1 replicas; the homogeneous baselines must raise every replica's TP for the long
documents, so the marginal tenant costs them more.""",
    ),
    ("md", "## 3. GPUs for a deadline: 2,000 steps in 6 hours"),
    (
        "code",
        """rows = sweep(workload, [Variation.parse("gpus=8,16,32")], steps=2)
fleet = pd.DataFrame(rows)
fleet = fleet[fleet.method == "lorafleet"][["gpus_total", "plan", "step_s", "gpu_s_per_step"]]
fleet["hours for 2000 steps"] = fleet.step_s * 2000 / 3600
fleet["meets 6 h"] = fleet["hours for 2000 steps"] <= 6
fleet.round(2)""",
    ),
    (
        "code",
        """smallest = fleet[fleet["meets 6 h"]].gpus_total.min()
print(f"smallest fleet that meets the deadline: {smallest} GPUs")""",
    ),
]

GPU_TYPES = [
    (
        "md",
        """# Choosing hardware: A100 vs H100 vs H200 for the same workload

The same six tenants (LobRA's 7B workload) planned and simulated on 16 GPUs of each kind.
Memory decides the parallel configs a GPU can run (how many tokens a micro-batch may
hold); compute and bandwidth decide the step time. GPU-hours per 1,000 steps is what a
reservation costs.""",
    ),
    (
        "code",
        """from pathlib import Path
import pandas as pd
from lorafleet.workload import load_workload
from lorafleet.whatif import Variation, sweep

root = Path.cwd() if (Path.cwd() / "examples").exists() else Path.cwd().parent
workload = load_workload(root / "examples" / "lobra-7b.yaml")
rows = sweep(workload, [Variation.parse("gpu=A100-40GB,A100-80GB,H100-80GB,H200-141GB")], steps=2)
table = pd.DataFrame(rows)
table["GPU-h per 1000 steps"] = table.gpu_s_per_step * 1000 / 3600
table.pivot(index="gpu_kind", columns="method", values="GPU-h per 1000 steps").round(1)""",
    ),
    (
        "code",
        """ours = table[table.method == "lorafleet"].set_index("gpu_kind")[["plan", "step_s"]]
ours""",
    ),
    (
        "md",
        """More memory per GPU lets the long tasks run at lower TP (fewer GPUs per replica), and
H100/H200's compute shortens every step. Divide the GPU-hours by your price per GPU-hour
to compare offers.""",
    ),
    (
        "code",
        """import matplotlib.pyplot as plt
pivot = table.pivot(index="gpu_kind", columns="method", values="GPU-h per 1000 steps")
pivot.plot.bar(figsize=(7, 3.5), ylabel="GPU-hours per 1000 steps", rot=0)
plt.tight_layout()""",
    ),
]

EVALUATIONS = [
    (
        "md",
        """# Evaluations and early stops in a what-if

The demo's four tenants (SmolLM2-135M on 4 x A100-40GB), each given 100 steps and evaluated every 10 of them
on a 5% split of its rows, with early stopping (patience 2). The demo's files hold 240 rows each, which the
inline `lengths` histograms count, so a what-if holds out 12 rows a task, as `train` does. `simulate` has no
model to measure a loss on, so each task's eval loss is a documented curve of the real tokens it has trained,
`l_inf + a n^-alpha` (n in millions of tokens), plus, for an overfitting task, `rise x (n - rise_after)` past
`rise_after` (docs/simulation.md, "Evaluations and early stops"; `--eval-curves-from RUN` fits one to a
training run's evaluations). Here `codegen` and `moddoc` overfit from 40% of their steps' expected tokens;
`docsum` and `chat` improve to the end. Each evaluation is priced by the cost model as forward-only work and
billed to its tenant; a stop hands the tenant's capacity back.""",
    ),
    (
        "code",
        """from pathlib import Path

import pandas as pd

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.loss_curve import TOKENS_UNIT
from lorafleet.planner import plan_deployment
from lorafleet.report import eval_rows
from lorafleet.simulate import simulate_schedule
from lorafleet.workload import load_workload

root = Path.cwd() if (Path.cwd() / "examples").exists() else Path.cwd().parent
demo = root / "examples" / "demo" / "workload.yaml"
STEPS, EVERY, L_INF, A, ALPHA = 100, 10, 1.0, 0.05, 0.5
sets = [
    f"defaults.steps={STEPS}",
    f"defaults.eval.every_steps={EVERY}",
    "defaults.eval.split=0.05",
    "defaults.early_stopping.patience=2",
    f"defaults.eval.curve.l_inf={L_INF}",
    f"defaults.eval.curve.a={A}",
    f"defaults.eval.curve.alpha={ALPHA}",
]
for name in ("codegen", "moddoc"):  # the minimum at 40% of the steps' tokens, rising twice as fast as it fell there
    low = 0.4 * STEPS * load_workload(demo).task(name).expected_tokens / TOKENS_UNIT
    sets += [
        f"tasks.{name}.eval.curve.rise_after={low:.4g}",
        f"tasks.{name}.eval.curve.rise={2 * ALPHA * A * low ** (-ALPHA - 1):.4g}",
    ]
workload = load_workload(demo, sets)
cluster = workload_cluster(workload)
planned = plan_deployment(workload, cluster, workload_cost_model(workload, cluster))
run = simulate_schedule(workload, planned.schedule, planned.cost_model, STEPS)
full = simulate_schedule(workload, planned.schedule, planned.cost_model, STEPS, stops=False)  # no task stops
pd.DataFrame(eval_rows(run.evals, full.evals)).set_index("task").round(3)""",
    ),
    (
        "md",
        """`best_step` is the global step after the task's best evaluation (the adapter it gets), `stopped_at` the one
after which it left: `patience` evaluations later. `not_taken` are the steps it would have trained without the
stop. What the stops save, against the same run with every task trained to its steps. `simulate` keeps the
plan, so a stop saves what the shorter steps after it save, and on 4 A100s the demo's small steps are mostly
fixed costs; `simulate --arrivals` re-plans the fleet around the tenants left (below):""",
    ),
    (
        "code",
        """saved = 1 - run.total_gpu_seconds / full.total_gpu_seconds
evals = sum(run.eval_gpu_seconds.values())
print(
    f"GPU-s {run.total_gpu_seconds:.1f} with early stops, {full.total_gpu_seconds:.1f} without: {saved:.1%} saved; "
    f"evaluations {evals:.1f} GPU-s ({evals / (run.total_gpu_seconds - evals):.1%} over the steps')"
)""",
    ),
    (
        "code",
        """%matplotlib inline
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
for name, reference in full.evals.items():
    (line,) = ax.plot([r.step for r in reference.records], [r.loss for r in reference.records], ":", alpha=0.6)
    e = run.evals[name]
    ax.plot([r.step for r in e.records], [r.loss for r in e.records], ".-", color=line.get_color(), label=name)
    best = next(r for r in e.records if r.step == e.state.best_step)
    ax.plot(best.step, best.loss, "o", mfc="none", ms=10, color=line.get_color())
    if e.stop_step is not None:
        ax.plot(e.records[-1].step, e.records[-1].loss, "x", ms=10, color=line.get_color())
ax.set(xlabel="step", ylabel="eval loss (curve)", title="evaluations: best (o), early stop (x), no stop (dotted)")
ax.legend()
plt.tight_layout()""",
    ),
    (
        "md",
        """The shell gives the same replay: `lorafleet simulate examples/demo/workload.yaml --steps 100 --set ...`
(the sets above) prints each task's evaluations, best and stop, and `--report DIR` draws this plot
(`evals.png`); `simulate --arrivals` replays the stops with the incremental re-plan handing the capacity back
(`benchmarks/bench_eval.py`, T4).""",
    ),
]


def build(name: str, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src) for kind, src in cells
    ]
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    path = ROOT / "notebooks" / name
    nbformat.write(nb, path)
    return path


NOTEBOOKS = {
    "capacity_planning.ipynb": CAPACITY,
    "whatif_gpu_types.ipynb": GPU_TYPES,
    "evaluations.ipynb": EVALUATIONS,
}

if __name__ == "__main__":
    for name in sys.argv[1:] or NOTEBOOKS:  # the names given (default: every notebook)
        print("wrote", build(name, NOTEBOOKS[name]))
