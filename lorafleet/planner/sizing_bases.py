"""Sizing the fleet over a choice of base (``plan --gpus auto`` with ``quantize: auto`` or a list:
:func:`size_per_base`): the GPU counts are swept once per candidate base (``planner.sizing.size_fleet`` over b's
cost models), and each base is judged by its sweep's own goal, on the row that sweep chose
(``sizing_choice.goal_value``): v_b = t̂(n) G(n) (fewest GPU-seconds), n (a deadline), t̂(n) (a budget), C(n)
(both), or t̂(n) P(n) where a sweep over priced pools counts money; b* is kept by ``base_choice``'s rule
(:func:`~lorafleet.planner.base_choice.first_within`: the first base within the tie tolerance of the best, in the
order none, int8, nf4). A base whose sweep chooses no count (no plan, or none meets the goal) has no value; when
none has one, the first's error is raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.planner.base_choice import base_name, candidate_bases, first_within, with_base
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.sizing import size_fleet
from lorafleet.planner.sizing_choice import goal_value
from lorafleet.planner.sizing_objective import SizingObjective, describe_objective
from lorafleet.planner.sizing_result import SizingError, SizingResult, SizingRow, by_cost
from lorafleet.runtime.base_quantization import check_base_choice
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.lora import Quantization
from lorafleet.workload import Workload


@dataclass(frozen=True)
class SizedBase:
    """One candidate base's fleet sizing: its sweep, or the error of a sweep that chose no count."""

    base: Quantization | None
    sizing: SizingResult | None
    error: SizingError | None = None

    def value(self) -> float:
        """v_b: the sweep's goal figure of the row it chose (module docstring)."""
        assert self.sizing is not None, "a base whose sweep chose no count has no value"
        return goal_value(self.sizing.chosen_row, self.sizing.objective.goal, by_cost(self.sizing.rows))


@dataclass(frozen=True)
class SizedBaseChoice:
    """Every candidate base's fleet sizing, and the base kept (module docstring)."""

    options: tuple[SizedBase, ...]
    chosen: int
    reason: str

    @property
    def sizing(self) -> SizingResult:
        sizing = self.options[self.chosen].sizing
        assert sizing is not None, "the chosen base always has a sizing"
        return sizing

    def lines(self) -> list[str]:
        """The choice, then one line per base: the count its sweep chose, that count's figures and the sweep's planning
        time, or why none."""
        bases = ", ".join(base_name(o.base) for o in self.options)
        goal = describe_objective(self.sizing.objective, by_cost(self.sizing.rows))
        out = [f"base chosen among quantize: [{bases}] by the sizing's goal ({goal}): "]
        out[0] += f"{base_name(self.options[self.chosen].base)}, {self.reason}"
        for k, option in enumerate(self.options):
            mark = "  <- chosen" if k == self.chosen else ""
            if option.sizing is None:
                out.append(f"  {base_name(option.base):>4}: no count chosen: {option.error.msg}{mark}")
                continue
            row, rows = option.sizing.chosen_row, option.sizing.rows
            money = "" if row.cost_per_step is None else f", cost/step {row.cost_per_step:.4g}"
            figures = f"{row.gpus} GPUs, step {row.step_s:.3f} s, {row.gpu_seconds_per_step:.1f} GPU-s a step{money}"
            swept = f"{len(rows)} count{'s' if len(rows) != 1 else ''} swept in {sum(r.plan_s for r in rows):.1f} s"
            out.append(f"  {base_name(option.base):>4}: {figures}, {row.result.plan.describe()} ({swept}){mark}")
        return out


def size_per_base(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model_of: Callable[[Workload, ClusterSpec], CostModel],
    options: PlannerOptions = PlannerOptions(),
    objective: SizingObjective = SizingObjective(),
    *,
    max_nodes: int | None = None,
    progress: Callable[[Quantization | None, SizingRow, int], None] | None = None,
) -> SizedBaseChoice:
    """``size_fleet`` of ``workload`` over each candidate base (:func:`candidate_bases`), every count priced by
    ``cost_model_of(workload over that base, the candidate cluster)``, and the base whose sweep's chosen row is best
    by the sweep's own goal (module docstring). ``progress`` is told each row with its base. Raises an InputError
    as :func:`choose_base` does for a base the model or the cost model cannot take, and the first base's
    :class:`SizingError` when no base's sweep chooses a count."""
    bases = candidate_bases(workload)
    check_base_choice(workload.spec.model, workload.model.model_type, bases, workload.path)
    sized: list[SizedBase] = []
    for base in bases:
        over = with_base(workload, base)
        told = None if progress is None else (lambda row, planned, base=base: progress(base, row, planned))
        try:
            sizing = size_fleet(
                over,
                cluster,
                lambda candidate, over=over: cost_model_of(over, candidate),
                options,
                objective,
                max_nodes=max_nodes,
                progress=told,
            )
        except SizingError as err:
            sized.append(SizedBase(base, None, err))
            continue
        sized.append(SizedBase(base, sizing))
    if all(o.sizing is None for o in sized):
        raise sized[0].error
    values = [None if o.sizing is None else o.value() for o in sized]
    chosen, reason = first_within(values, bases, options.tie_rel, "the only base whose sweep chose a count")
    return SizedBaseChoice(tuple(sized), chosen, reason)
