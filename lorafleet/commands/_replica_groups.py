"""A plan's replicas grouped by config, for tables that stay readable with hundreds of replicas.

``plan``, ``simulate`` and ``dispatch`` print one row per (config, max tokens) group, not a column
per replica: how many replicas, their GPUs, their share of the tokens and the spread of their load
(min / median / max over the group's replicas, and over the steps when there are several). Every
replica's own figures stay in the files the commands write (``--json``, ``--report``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.plans import DeploymentPlan

WIDTH = 150
"""Columns every table of these commands is printed in (no line is longer)."""
DESCRIBE_LIMIT = 100
"""A plan whose one-line description is longer than this is named by its counts in a title."""


@dataclass(frozen=True)
class ConfigGroup:
    """The replicas of one config and max tokens, and their figures."""

    config: str
    max_tokens: int
    replicas: tuple[int, ...]
    """Their positions in the plan."""
    gpus: int
    token_share: float | None
    """Their share of all tokens (None: not known)."""
    load: tuple[float, float, float]
    """min, median and max of their load (seconds), over the replicas and the steps."""


def config_groups(plan: DeploymentPlan, load: np.ndarray, tokens: np.ndarray | None = None) -> list[ConfigGroup]:
    """The plan's replicas by (config, max tokens), in the order the plan lists them first.

    ``load``: seconds per replica, shape (R,) or (steps, R); ``tokens``: tokens per replica, (R,) or
    (steps, R), for the groups' token shares.
    """
    load = np.atleast_2d(np.asarray(load, dtype=float))
    total = None if tokens is None else float(np.sum(tokens))
    per_replica = None if tokens is None else np.atleast_2d(np.asarray(tokens, dtype=float)).sum(axis=0)
    members: dict[tuple[str, int], list[int]] = {}
    for pos, replica in enumerate(plan.replicas):
        members.setdefault((str(replica.config), replica.max_tokens), []).append(pos)
    groups = []
    for (config, max_tokens), positions in members.items():
        values = load[:, positions]
        share = None if per_replica is None else float(per_replica[positions].sum()) / max(total, 1.0)
        groups.append(
            ConfigGroup(
                config=config,
                max_tokens=max_tokens,
                replicas=tuple(positions),
                gpus=sum(plan.replicas[p].config.n_gpus for p in positions),
                token_share=share,
                load=(float(values.min()), float(np.median(values)), float(values.max())),
            )
        )
    return groups


def groups_table(title: str, groups: Sequence[ConfigGroup], load: str, extra: Sequence[tuple[str, Sequence[str]]] = ()):
    """A rich table of ``groups``: config, replicas, GPUs, max tokens, token share (when known) and the
    load's min / median / max, headed ``load`` (``time/replica (s)``, ``busy (s)``, ...); then the
    ``extra`` columns, (heading, one cell per group)."""
    from rich.table import Table

    table = Table(title=title)
    shares = any(g.token_share is not None for g in groups)
    columns = ["config", "count", "GPUs", "max tokens", *(["token share"] if shares else [])]
    columns += [f"{load} min", "median", "max", *(heading for heading, _ in extra)]
    for column in columns:
        table.add_column(column, justify="left" if column == "config" else "right")
    for k, g in enumerate(groups):
        share = [f"{g.token_share:.1%}" if g.token_share is not None else ""] if shares else []
        table.add_row(
            g.config,
            str(len(g.replicas)),
            str(g.gpus),
            str(g.max_tokens),
            *share,
            *(f"{x:.3f}" for x in g.load),
            *(cells[k] for _, cells in extra),
        )
    return table


def plan_name(plan: DeploymentPlan) -> str:
    """``plan.describe()``, or ``84 replicas of 15 configs`` when that would not fit a title."""
    described = plan.describe()
    if len(described) <= DESCRIBE_LIMIT:
        return described
    configs = len({(r.config, r.max_tokens) for r in plan.replicas})
    return f"{len(plan.replicas)} replicas of {configs} configs"


def spread(values: np.ndarray) -> str:
    """``12.19 / 13.48 / 14.88``: min / median / max of ``values``."""
    return " / ".join(f"{x:.2f}" for x in (np.min(values), np.median(values), np.max(values)))
