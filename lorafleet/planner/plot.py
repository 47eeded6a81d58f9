"""The expected load per replica of a plan, as a PNG (matplotlib, files only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from lorafleet.plans import DeploymentPlan, StepPlan


def plot_expected_load(plan: DeploymentPlan, step: StepPlan, out: str | Path) -> Path:
    """One bar per replica: its expected time on the expected batch, coloured by config, the makespan dashed.

    The text above each bar is the replica's share of the batch's real tokens.
    """
    out = Path(out)
    tokens = [sum(sum(mb.lengths) for mb in w.microbatches) for w in step.work]
    total = max(sum(tokens), 1)
    configs = [str(c) for c in sorted({r.config for r in plan.replicas})]
    colours = {c: plt.get_cmap("tab10")(k % 10) for k, c in enumerate(configs)}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(plan.replicas) + 2), 4.0))
    for replica, work, tok in zip(plan.replicas, step.work, tokens, strict=True):
        ax.bar(replica.replica_id, work.estimated_time_s, color=colours[str(replica.config)])
        ax.text(replica.replica_id, work.estimated_time_s, f"{tok / total:.0%}", ha="center", va="bottom", fontsize=7)
    line = ax.axhline(
        step.estimated_makespan_s,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"makespan {step.estimated_makespan_s:.3g} s",
    )
    handles = [line, *(Patch(color=colours[c], label=c) for c in configs)]
    ax.set_xticks([r.replica_id for r in plan.replicas])
    ax.set_xlabel("replica (label: share of the batch's tokens)")
    ax.set_ylabel("expected time per step (s)")
    ax.set_title(
        f"expected load per replica\n{plan.describe()} on {plan.used_gpus} of {plan.describe_fleet()}", fontsize=10
    )
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
