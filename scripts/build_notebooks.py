"""Write the capacity-planning notebooks in notebooks/ from the cells below, then execute them.

    .venv/bin/python scripts/build_notebooks.py

The notebooks are generated (not edited by hand) so their code stays reviewable here; CI
re-executes them top to bottom (tests/test_notebooks.py).
"""

from __future__ import annotations

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


if __name__ == "__main__":
    for name, cells in (("capacity_planning.ipynb", CAPACITY), ("whatif_gpu_types.ipynb", GPU_TYPES)):
        print("wrote", build(name, cells))
