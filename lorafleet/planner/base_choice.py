"""The planner's choice of the shared base (``quantize: auto`` or a list of bases; ``specs.workload``).

A quantized base (QLoRA) changes two terms of the cost model at once: it frees the weights' bytes, so every config
holds a larger micro-batch M (``costmodel.memory_model``: ``(bytes saved) / bytes_per_token`` more tokens) and
shorter pipelines fit; and it adds the dequantization of every projection, forward and backward
(``costmodel.analytic``: ``2 P (q + dtype) / tp / (W e_mem)`` a block). Which wins depends on the fleet, so
:func:`choose_base` plans the whole fleet once per candidate base b, each over its own cost model::

    p_b = plan_deployment(workload over b, cluster, cost_model(b)),   v_b = objective(p_b)

with v the expected step's makespan (``--objective makespan``) or its cost a step at the pools' prices
(``--objective cost``, over the plans within the step-time limit when one is given; with a step-cost cap
``--max-cost`` alone, the makespan over the plans within the cap), and keeps

    b* = the first b, in the order none, int8, nf4, with v_b <= (1 + ε) min_b' v_b'     (ε: ``tie_rel``)

so a tie within the planner's tolerance goes to the base that rounds the function least. A base on which the
model or some task's longest sequence fits no config is a candidate with no plan (its reason kept); when none has
one, the first's error is raised. The whole fleet is over one base: a tenant the dispatcher splits across replicas
trains one adapter, which must learn over one function (docs/multi_lora.md, "Quantized base").

What each quantized candidate trades on the config c the unquantized plan gives the most GPUs, the
:class:`BaseTrade`: M_b(c) against M_none(c), and the dequantization's share of a micro-batch of M_none(c) tokens,
``τ_b(c, M) / τ_none(c, M) - 1``. Where nf4 loses, the second outweighs what the first saves.

Sizing the fleet over a choice of base is :mod:`.sizing_bases`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.errors import InputError
from lorafleet.planner.driver import LORAFLEET, PlanResult, plan_deployment
from lorafleet.planner.options import PlannerOptions, PlanObjective
from lorafleet.runtime.base_quantization import check_base_choice
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.lora import Quantization
from lorafleet.workload import Workload


def base_name(base: Quantization | None) -> str:
    """``nf4``, ``int8``, or ``none`` for the base in the run's dtype (``quantize``'s words)."""
    return "none" if base is None else base.value


def candidate_bases(workload: Workload) -> tuple[Quantization | None, ...]:
    """The bases the planner chooses among: the workload's ``quantize_candidates``, else its one ``quantize``."""
    spec = workload.spec
    return spec.quantize_candidates if spec.quantize_candidates is not None else (spec.quantize,)


def with_base(workload: Workload, base: Quantization | None) -> Workload:
    """``workload`` over the one base ``base`` (its tasks as resolved: nothing is read again)."""
    spec = workload.spec.model_copy(update={"quantize": base, "quantize_candidates": None})
    return replace(workload, spec=spec)


@dataclass(frozen=True)
class BaseTrade:
    """What a quantized base changes on one config against the unquantized base (module docstring)."""

    config: ParallelConfig
    """The config the unquantized plan gives the most GPUs (all its replicas')."""
    tokens: tuple[int, int]
    """M of ``config``: over the unquantized base, over this one."""
    dequantization: float
    """The fraction a micro-batch of the unquantized M takes longer over this base: ``τ_b / τ_none - 1``."""

    def describe(self) -> str:
        before, after = self.tokens
        return (
            f"on {self.config}: M {before:,} -> {after:,} tokens (x{after / before:.2f}); dequantization "
            f"{self.dequantization:+.1%} on a micro-batch of {before:,}"
        )


@dataclass(frozen=True)
class BaseOption:
    """One candidate base: its plan and the objective's value, or why it has none."""

    base: Quantization | None
    result: PlanResult | None
    """None: the model, or some task's longest sequence, fits no config over this base (``infeasible``)."""
    infeasible: str = ""
    trade: BaseTrade | None = None
    """Against the unquantized candidate's plan, for a quantized candidate when both have plans."""

    def value(self, objective: PlanObjective) -> float:
        """v_b: the expected step's makespan (s), or its cost at the pools' prices (module docstring)."""
        assert self.result is not None, "an infeasible base has no value"
        ours = self.result.cost(LORAFLEET)
        if objective is PlanObjective.COST:
            assert ours.cost_per_step is not None, "plan_deployment checks that every pool has a price"
            return ours.cost_per_step
        return ours.makespan_s


@dataclass(frozen=True)
class BaseChoice:
    """Every candidate base planned, and the one kept (module docstring)."""

    options: tuple[BaseOption, ...]
    objective: PlanObjective
    chosen: int
    reason: str
    """Why ``chosen`` won: the best value, or a tie with it that goes to the less-quantized base."""

    @property
    def option(self) -> BaseOption:
        return self.options[self.chosen]

    @property
    def result(self) -> PlanResult:
        result = self.option.result
        assert result is not None, "the chosen base always has a plan"
        return result

    def lines(self) -> list[str]:
        """The choice, then one line per candidate (its value and plan, or why it has none; a quantized one's trade
        on a line of its own), the chosen marked."""
        cost = self.objective is PlanObjective.COST
        bases = ", ".join(base_name(o.base) for o in self.options)
        out = [f"base chosen among quantize: [{bases}] by {self.objective.value}: {base_name(self.option.base)}, "]
        out[0] += self.reason
        for k, option in enumerate(self.options):
            mark = "  <- chosen" if k == self.chosen else ""
            if option.result is None:
                out.append(f"  {base_name(option.base):>4}: no plan: {option.infeasible}{mark}")
                continue
            value = option.value(self.objective)
            said = f"cost/step {value:.4g}" if cost else f"makespan {value:.3f} s"
            out.append(f"  {base_name(option.base):>4}: {said}, {option.result.plan.describe()}{mark}")
            if option.trade is not None:
                out.append(f"        {option.trade.describe()}")
        return out


def choose_base(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model_of: Callable[[Workload], CostModel],
    options: PlannerOptions = PlannerOptions(),
) -> BaseChoice:
    """Plan ``workload`` on ``cluster`` once per candidate base (:func:`candidate_bases`), each priced by
    ``cost_model_of(workload over that base)``, and keep the better plan by ``options``' objective (module
    docstring). Raises an InputError when a quantized candidate cannot be built for the model
    (``runtime.base_quantization.check_base_choice``) or priced (``cost_model_of``'s: a measured profile is of the
    unquantized base), and the first candidate's when no base has a plan."""
    bases = candidate_bases(workload)
    check_base_choice(workload.spec.model, workload.model.model_type, bases, workload.path)
    planned: list[BaseOption] = []
    errors: list[InputError] = []
    for base in bases:
        over = with_base(workload, base)
        cost_model = cost_model_of(over)  # a base it cannot price (a measured profile, unquantized) is the error
        try:
            option = BaseOption(base, plan_deployment(over, cluster, cost_model, options))
        except InputError as err:
            errors.append(err)
            option = BaseOption(base, None, infeasible=f"{err.field}: {err.msg}")
        planned.append(option)
    if all(o.result is None for o in planned):
        raise errors[0]
    reference = planned[0] if planned[0].base is None else None
    traded = tuple(replace(o, trade=_trade(reference, o)) for o in planned)
    chosen, reason = _pick(traded, options)
    return BaseChoice(traded, options.objective, chosen, reason)


def plan_over_base(
    workload: Workload,
    cluster: ClusterSpec,
    cost_model_of: Callable[[Workload], CostModel],
    options: PlannerOptions = PlannerOptions(),
) -> tuple[PlanResult, BaseChoice | None]:
    """The plan of ``workload`` on ``cluster``: over its one base (no choice), or, written ``quantize: auto`` or as
    a list, over the base :func:`choose_base` keeps, with the choice (whose ``lines`` the callers say)."""
    if workload.spec.quantize_candidates is None:
        return plan_deployment(workload, cluster, cost_model_of(workload), options), None
    choice = choose_base(workload, cluster, cost_model_of, options)
    return choice.result, choice


def _pick(planned: tuple[BaseOption, ...], options: PlannerOptions) -> tuple[int, str]:
    """The index of the base kept, and why (module docstring). Under ``--objective cost`` with a step-time limit,
    only plans within it compete, unless none is: then the fastest is kept, and the command says the limit is
    missed. With a step-cost cap C (``--max-cost``) only the plans whose step costs at most C compete too, and with
    C alone v_b is the makespan (the fastest base whose plan fits the cap; ``objective.preferred``); when none is
    within C the choice is the one without it, and the command says the cap is missed."""
    objective, limit, cap = options.objective, options.max_step_s, options.max_step_cost
    feasible = [k for k, o in enumerate(planned) if o.result is not None]
    within = [k for k in feasible if limit is None or planned[k].value(PlanObjective.MAKESPAN) <= limit]
    if not within:
        fastest = min(feasible, key=lambda k: planned[k].value(PlanObjective.MAKESPAN))
        return fastest, f"no base's plan is within the step-time limit {limit:.4g} s; the fastest"
    capped = [k for k in within if cap is not None and planned[k].value(PlanObjective.COST) <= cap]
    by, where = objective, " within the limit"
    if capped:
        by = PlanObjective.MAKESPAN if limit is None else objective
        within, where = capped, " within the step-cost cap" if limit is None else " within the limit and the cap"
    values = [o.value(by) if k in within else None for k, o in enumerate(planned)]
    only = "the only base with a plan" + ("" if len(within) == len(feasible) else where)
    chosen, reason = first_within(values, [o.base for o in planned], options.tie_rel, only)
    if by is not objective and len(within) > 1:
        reason = f"the fastest within the step-cost cap, its makespan {reason}"
    return chosen, reason


def first_within(
    values: Sequence[float | None], bases: Sequence[Quantization | None], tie_rel: float, only: str
) -> tuple[int, str]:
    """b*: the first base, in the candidates' order (none, int8, nf4), whose value v_b is within ``tie_rel`` of the
    least (None: no value), and why (``only`` when it is the one base with a value)."""
    valued = [k for k, v in enumerate(values) if v is not None]
    best = min(values[k] for k in valued)
    chosen = next(k for k in valued if values[k] <= best * (1 + tie_rel))
    others = [k for k in valued if k != chosen]
    if values[chosen] > best:
        return chosen, f"within {tie_rel:.1%} of the best: a tie goes to the less-quantized base"
    if not others:
        return chosen, only
    runner = min(others, key=lambda k: values[k])
    if values[runner] == values[chosen]:  # a sizing's GPU count often is
        return chosen, f"equal to {base_name(bases[runner])}'s: a tie goes to the less-quantized base"
    return chosen, f"{1 - values[chosen] / values[runner]:.1%} below {base_name(bases[runner])}'s"


def _trade(reference: BaseOption | None, option: BaseOption) -> BaseTrade | None:
    """What ``option``'s quantized base changes on the unquantized plan's widest config (module docstring)."""
    if reference is None or reference.result is None or option.result is None or option.base is None:
        return None
    plan, before, after = reference.result.plan, reference.result.cost_model, option.result.cost_model
    gpus: dict[ParallelConfig, int] = {}
    for replica in plan.replicas:
        gpus[replica.config] = gpus.get(replica.config, 0) + replica.config.n_gpus
    config = max(gpus, key=gpus.__getitem__)
    tokens = before.memory_tokens(config)
    slower = after.microbatch_time(config, 1, tokens) / before.microbatch_time(config, 1, tokens) - 1
    return BaseTrade(config, (tokens, after.memory_tokens(config)), float(slower))
