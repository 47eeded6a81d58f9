"""The cost model every stage consumes: stage, replica and step times, and max tokens M.

Its sources (fitted from a measured profile, analytic from a datasheet) both produce this one
object, so the planner, the dispatcher and the simulated executor never know where the
numbers came from. Internally every time is in milliseconds (LobRA's unit); the public
methods return seconds.

Stage time of one micro-batch k on ``<tp, pp>`` (the busiest stage, the last, which holds
L/pp blocks and the LM head)::

    τ_k = (L / pp) * t_tp(mb_k) + head_tp(tokens_k) + [pp > 1] * 2 * p2p(tokens_k * h * bytes)

where t_tp is LobRA's per-block t(b, s) (Eq. 10), or its packed form (with activation
recomputation, ``LayerTimeCoeffs.recomputed``: each term grows by its forward share); the
p2p term receives the activations forward and sends their gradient backward. Every added term is affine in the
tokens, so τ keeps the LobRA form (``stage_coeffs``) and the planner's linear formulation
still applies. A replica's step over micro-batches k = 1..K is::

    T = Σ_k τ_k + bubble_slots * max_k τ_k + allreduce(adapter grads) + optimizer(adapter params)

    bubble_slots = ((pp - 1) + (W - 1) * min(stall, pp - 1)) / W          (costmodel.schedule)

with W the pipeline window: the steps a pipelined replica streams as one 1F1B schedule before
it drains (the dispatch policy's ``pipeline_window``, an argument of every call that prices a
replica, so one cost model prices any policy), and ``stall`` what a step boundary inside the window
costs given which tasks each micro-batch holds (0 when that is not known: the steady-state estimate
a load model prices classes with before dispatch). W = 1 is LobRA Eq. 12, 1F1B flushed every step:
``(pp - 1) * max_k τ_k``. The last two terms are what LobRA's timed step skips: the ring
all-reduce of every task's adapter gradients across the ``sync_replicas`` replicas and the
optimizer step, both on the adapter parameters one device holds, Σ_tasks params / (tp * pp).

Past a knee of K tokens (a CPU's: ``microbatch_size``) every token of a micro-batch costs ``1 + ρ`` times its
affine price, ``τ'_k = τ_k + ρ c3 max(0, S_k − K)``, and M is the memory limit capped where a token costs least.

A fleet of several pools (GPU kinds) is one CostModel too (:meth:`CostModel.of_pools`): each pool's
own model (its profile's, or its kind's analytic one), and a config is priced by the model of the
pool it names (``ParallelConfig.pool``). Every caller prices configs as before and never asks
which kind a replica runs on, except for the one term that depends on the whole deployment: the adapters'
gradient all-reduce runs over the deployment's replicas, so it crosses pools only when the deployment does.
A pool's model prices it on that pool's own ``grad_sync`` link; the model a deployment over several pools is
priced by (:meth:`CostModel.spanning`) prices each pool's replicas on that pool's inter-node link instead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated

import numpy as np
from pydantic import Field

from lorafleet.costmodel import schedule
from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.attention_span import stage_span
from lorafleet.costmodel.microbatch_size import MicroBatchKnee
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MS_PER_S, AffineTime, LayerTimeCoeffs, Link, MicroBatchShape
from lorafleet.specs.field_docs import documented
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import ModelSpec
from lorafleet.work import count as count_work

#: Pipeline messages per micro-batch on a stage: activations in (forward), their gradient out (backward).
P2P_MESSAGES = 2


@dataclass(frozen=True)
class Interconnect:
    """The links a replica's step uses besides its TP group (whose cost is inside t_tp)."""

    p2p_intra_node: Link = field(default_factory=Link)
    """Pipeline transfers between stages on one node."""
    p2p_inter_node: Link = field(default_factory=Link)
    """Pipeline transfers between nodes."""
    grad_sync: Link = field(default_factory=Link)
    """The adapters' gradient all-reduce across replicas."""
    gpus_per_node: int = 8
    """A replica on more GPUs than this has stages on different nodes."""

    def p2p(self, config: ParallelConfig) -> Link:
        return self.p2p_intra_node if config.n_gpus <= self.gpus_per_node else self.p2p_inter_node


@dataclass(frozen=True, kw_only=True)
class CostModelOrigin:
    """Where a cost model's figures come from: what a plan records, so a later command rebuilds the same model."""

    __pydantic_config__ = documented(extra="forbid")

    kind: str
    """``analytic`` (the datasheet model of ``gpu``) or ``profile`` (the file ``profile``)."""
    gpu: str
    """The GPU kind the figures are for."""
    profile: str = ""
    """The profile file, as it was given (empty for analytic)."""
    sha256: str = ""
    """Hex SHA-256 of the profile file's bytes when the model was built (empty for analytic)."""
    quantize: Annotated[Quantization | None, Field(exclude_if=lambda value: value is None)] = None
    """The quantized shared base the figures price (QLoRA: ``nf4``, ``int8``; analytic only); None: the base in the
    run's dtype, and left out of the JSON (a plan of an unquantized workload writes what it wrote before). A plan
    records it per pool, and the plan check holds a workload's ``quantize`` to it."""

    def __post_init__(self) -> None:
        if self.kind not in ("analytic", "profile"):
            raise ValueError(f"cost model kind must be analytic or profile, got {self.kind!r}")

    def describe(self) -> str:
        """``analytic:A100-40GB`` (``analytic:A100-40GB over nf4`` over a quantized base) or
        ``profile:profiles/x.json (sha256 1a2b3c4d)``."""
        if self.kind == "analytic":
            return f"analytic:{self.gpu}" + (f" over {self.quantize.value}" if self.quantize is not None else "")
        return f"profile:{self.profile} (sha256 {self.sha256[:8]})"


@dataclass(frozen=True)
class CostModel:
    """Time (seconds) and memory (tokens) of every parallel config of one model on one GPU kind."""

    model: ModelSpec
    """The base model the figures are for."""
    layer_time: Mapping[int, LayerTimeCoeffs]
    """t(b, s) per TP degree, ms per transformer layer (LobRA Eq. 10)."""
    max_tokens_table: Mapping[ParallelConfig, int]
    """M per config: a micro-batch fits iff its tokens (padding included) <= M."""
    source: str = "unknown"
    """Where the figures came from: ``fitted:<profile>``, ``analytic:<gpu>``, ..."""
    head_time: Mapping[int, AffineTime] = field(default_factory=dict)
    """Embedding, final norm, LM head and loss per TP degree, ms vs micro-batch tokens."""
    interconnect: Interconnect = field(default_factory=Interconnect)
    """Pipeline and gradient-sync links."""
    optimizer_time: AffineTime = field(default_factory=AffineTime)
    """Optimizer step, ms vs adapter parameters on one device."""
    forward_layer_time: Mapping[int, LayerTimeCoeffs] = field(default_factory=dict)
    """A block's forward alone per TP degree, ms, where a profile measured it (empty: none measured, and
    :meth:`forward_time` takes the forward as shares of ``layer_time``)."""
    forward_head_time: Mapping[int, AffineTime] = field(default_factory=dict)
    """The head's forward alone per TP degree, ms vs micro-batch tokens (the TP degrees of ``forward_layer_time``)."""
    adapters: AdapterLoad | None = None
    """The tasks' adapters every replica carries (None: no step overhead is charged)."""
    activation_bytes: int = 2
    """Bytes of one activation or gradient element (2 for bf16)."""
    sync_replicas: int = 2
    """Replicas taking part in the adapters' gradient all-reduce (1: no sync)."""
    knees: Mapping[ParallelConfig, MicroBatchKnee] = field(default_factory=dict)
    """Per config, where a micro-batch's tokens start costing more (``microbatch_size``: a CPU's); a config
    without one: never."""
    origin: CostModelOrigin | None = None
    """How to rebuild this model (``load_cost_model`` sets it; None for one built by hand or a fleet's)."""
    pools: Mapping[str, CostModel] = field(default_factory=dict)
    """A fleet's models, by pool name (:meth:`of_pools`): a config is priced by its pool's. Empty: this
    model's own tables price every config (one GPU kind, configs of no named pool)."""
    spans_pools: bool = False
    """Whether the deployment this fleet model prices uses several pools (:meth:`spanning`): its replicas'
    gradient all-reduce then crosses pools, on each pool's inter-node link, instead of each pool's own
    ``grad_sync`` (False for a model of one kind)."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per-config figures already derived from the fields above (stage coefficients, step overhead),
    keyed by the config, its pool included: the model is frozen, so they never change; a copy
    (``dataclasses.replace``) starts empty."""

    @classmethod
    def of_pools(cls, models: Mapping[str, CostModel]) -> CostModel:
        """The model of a fleet whose pool ``name`` is priced by ``models[name]`` (one-kind models of one
        base model and adapter load); the one unnamed pool's model is simply that model."""
        if not models:
            raise ValueError("a fleet has at least one pool")
        if tuple(models) == ("",):
            return models[""]
        if "" in models or any(m.pools for m in models.values()):
            raise ValueError("a fleet's pools are named and priced by one-kind models")
        first = next(iter(models.values()))
        return replace(
            first,
            layer_time={},
            max_tokens_table={},
            head_time={},
            forward_layer_time={},
            forward_head_time={},
            knees={},
            source=" + ".join(f"{name}={m.source}" for name, m in models.items()),
            origin=None,
            pools=dict(models),
        )

    def pool_model(self, config: ParallelConfig) -> tuple[CostModel, ParallelConfig]:
        """The one-kind model that prices ``config`` and the config as that model knows it (its layout):
        its pool's in a fleet, else this model (ValueError for a pool the model has not)."""
        if not self.pools:
            if config.pool:
                raise ValueError(f"{config} names pool {config.pool!r}; this cost model prices no pools")
            return self, config
        try:
            return self.pools[config.pool], config.layout
        except KeyError:
            raise ValueError(
                f"{config}: the cost model has no pool {config.pool!r} ({', '.join(self.pools)})"
            ) from None

    def spanning(self, pools: Iterable[str]) -> CostModel:
        """The model a deployment whose replicas run on ``pools`` (their names, repeats allowed) is priced by:
        this fleet's, its step overheads syncing across pools when the deployment uses two or more of them
        (``spans_pools``), else on each pool's own ``grad_sync`` link; a one-kind model itself."""
        if not self.pools:
            return self
        spans = len(set(pools)) > 1
        if spans == self.spans_pools:
            return self
        key = ("spanning", spans)
        if key not in self._memo:
            self._memo[key] = replace(self, spans_pools=spans)
        return self._memo[key]

    def crossing(self) -> CostModel:
        """This one-kind model with the adapters' gradient all-reduce on its inter-node link: how its replicas
        sync with replicas on another pool (each pool's own NIC; the ring's pace is the slowest, which an
        overhead of a few milliseconds a step does not make worth modelling)."""
        if self.pools:
            raise ValueError("a fleet's pools cross one by one: price a deployment by spanning(pools)")
        key = ("crossing",)
        if key not in self._memo:
            link = self.interconnect.p2p_inter_node
            self._memo[key] = replace(self, interconnect=replace(self.interconnect, grad_sync=link))
        return self._memo[key]

    def origins(self) -> dict[str, CostModelOrigin | None]:
        """Where each pool's figures come from, by pool name (``""``: a one-kind model's own)."""
        return {name: m.origin for name, m in self.pools.items()} if self.pools else {"": self.origin}

    @property
    def configs(self) -> list[ParallelConfig]:
        """Configs with both a time model and a memory figure (each pool's, in a fleet), sorted."""
        if self.pools:
            return sorted(c.in_pool(name) for name, m in self.pools.items() for c in m.configs)
        return sorted(c for c in self.max_tokens_table if c.tp in self.layer_time)

    def times(self, config: ParallelConfig) -> bool:
        """Whether the model has a time model for ``config``'s TP degree (on its pool)."""
        model, layout = self.pool_model(config)
        return layout.tp in model.layer_time

    def max_tokens(self, config: ParallelConfig) -> int:
        """M of ``config``, what a plan gives it: the tokens that fit in memory (:meth:`memory_tokens`), capped
        where a token costs least past a knee (``MicroBatchKnee.efficient_tokens``); 0 when the model does not
        fit at all."""
        model, layout = self.pool_model(config)
        memory, knee = model.memory_tokens(layout), model.knees.get(layout)
        if knee is None or memory <= 0:
            return memory
        return knee.efficient_tokens(model.stage_coeffs(layout), memory)

    def memory_tokens(self, config: ParallelConfig) -> int:
        """The most tokens a micro-batch of ``config`` holds in memory (0 when the model does not fit at all):
        the bound a plan's M is checked against."""
        model, layout = self.pool_model(config)
        return int(model.max_tokens_table.get(layout, 0))

    def block_coeffs(self, config: ParallelConfig) -> LayerTimeCoeffs:
        """t(b, s) of one block of ``config``, ms: its TP degree's, grown by the forward share
        under activation recomputation (``LayerTimeCoeffs.recomputed``), the mean block of its busiest stage's
        sliding windows (``attention_span.stage_span``)."""
        model, layout = self.pool_model(config)
        block = model.layer_time[layout.tp]
        block = block.recomputed() if layout.recompute else block
        return block.windowed(stage_span(model.model, layout.pp))

    def stage_coeffs(self, config: ParallelConfig) -> LayerTimeCoeffs:
        """τ(b, s) of ``config`` in LobRA form, ms per stage (see the module docstring)."""
        key = ("stage", config)
        if key not in self._memo:
            self._memo[key] = self._stage_coeffs(config)
        return self._memo[key]

    def _stage_coeffs(self, config: ParallelConfig) -> LayerTimeCoeffs:
        model, layout = self.pool_model(config)
        if model is not self:
            return model.stage_coeffs(layout)
        head = self.head_time.get(config.tp, AffineTime())
        return self._stage(config, self.block_coeffs(config), head, P2P_MESSAGES)

    def _stage(
        self, config: ParallelConfig, block: LayerTimeCoeffs, head: AffineTime, messages: int
    ) -> LayerTimeCoeffs:
        """A stage of ``config`` in LobRA form, ms: L/pp blocks, the head, and ``messages`` pipeline transfers of a
        micro-batch's activations when pp > 1; its attention over the busiest stage's sliding windows
        (``attention_span.stage_span``; none for a model without)."""
        per_token, fixed = head.slope, head.fixed
        if config.pp > 1:
            p2p = self.interconnect.p2p(config).transfer()
            per_token += messages * p2p.slope * self.model.hidden * self.activation_bytes
            fixed += messages * p2p.fixed
        stage = block.extended(self.model.n_layers / config.pp, per_token, fixed)
        return stage.windowed(stage_span(self.model, config.pp))

    def forward_stage_coeffs(self, config: ParallelConfig) -> LayerTimeCoeffs:
        """τF(b, s) of ``config``, the forward alone of a stage, ms (see :meth:`forward_time`)."""
        key = ("forward", config)
        if key not in self._memo:
            self._memo[key] = self._forward_stage_coeffs(config)
        return self._memo[key]

    def _forward_stage_coeffs(self, config: ParallelConfig) -> LayerTimeCoeffs:
        model, layout = self.pool_model(config)
        if model is not self:
            return model.forward_stage_coeffs(layout)
        if config.tp not in self.forward_layer_time:  # not measured: the assumed shares of the stage's terms
            return self.stage_coeffs(config.with_recompute(False)).forward()
        return self._stage(config, self.forward_layer_time[config.tp], self.forward_head_time[config.tp], 1)

    def microbatch_time(
        self, config: ParallelConfig, b: np.ndarray | float, s: np.ndarray | float
    ) -> np.ndarray | float:
        """Stage time τ' of one padded micro-batch of b sequences of length s, fwd+bwd, seconds (vectorised)."""
        stage, knee, _ = self._pricing(config)
        t = stage(b, s)
        if knee is not None:  # the tokens are formed only where a knee prices them (load models: every length)
            t = t + knee.excess_ms(stage, np.where(np.asarray(b) > 0, np.multiply(b, s), 0))
        if np.ndim(t) == 0:
            return float(t) / MS_PER_S
        t /= MS_PER_S  # a new array: the stage's times (a load model's: thousands of lengths)
        return t

    def packed_microbatch_time(self, config: ParallelConfig, seq_lens: Sequence[int]) -> float:
        """Stage time τ' of one packed micro-batch, fwd+bwd, seconds."""
        return self.shape_time(config, MicroBatchShape.packed(seq_lens))

    def shape_time(self, config: ParallelConfig, mb: MicroBatchShape) -> float:
        """Stage time τ' of a micro-batch described by its shape (padded or packed), seconds."""
        if not mb.n_seqs:
            return 0.0
        return (self.stage_coeffs(config).shape(mb) + float(self._excess_ms(config, mb.tokens))) / MS_PER_S

    def _excess_ms(self, config: ParallelConfig, tokens: Sequence[int] | np.ndarray | int) -> np.ndarray | float:
        """``ρ c3 max(0, S − K)`` of micro-batches of ``tokens`` tokens past the knee, ms (0.0 without one: what
        it is added to stays bit for bit the LobRA form's)."""
        stage, knee, _ = self._pricing(config)
        return 0.0 if knee is None else knee.excess_ms(stage, np.asarray(tokens))

    def forward_time(self, config: ParallelConfig, microbatches: Sequence[MicroBatchShape]) -> float:
        """One replica's time to run ``microbatches`` forward only (an evaluation), seconds::

            T_F = Σ_k τF_k + (pp - 1) * max_k τF_k

        τF_k the forward of micro-batch k on a stage: L/pp blocks' forward, the head's forward and one pipeline
        message (the activations in). Measured where the profile timed the forward alone (``forward_layer_time``,
        ``forward_head_time``: ``lorafleet profile`` records it); otherwise, and always for the analytic model, each
        coefficient of the stage time without recomputation (an evaluation keeps no activations to recompute) times
        its assumed forward share (``LayerTimeCoeffs.forward``: 2/7 of attention, 1/2 of the projections, the LM
        head and the elementwise passes, one of the two pipeline messages); on this repository's CPU they hold: the
        demo's model measured so gives 0.471 of a training pass over an evaluation's micro-batches, the shares 0.473
        (docs/evaluation.md). No knee is priced (``knees``: a working set of the activations a step keeps, which a
        forward-only pass does not keep; assumed, not measured). A forward-only stream
        fills and drains the pipeline once, ``pp - 1`` slots, and no gradient is synchronised and no optimizer
        steps: no step overhead."""
        shapes = [mb for mb in microbatches if mb.n_seqs]
        if not shapes:
            return 0.0
        times = self.forward_stage_coeffs(config).shapes(shapes) / MS_PER_S
        return float(times.sum() + (config.pp - 1) * times.max())

    def adapter_params_per_device(self, config: ParallelConfig) -> float:
        """Adapter parameters on one device of ``config``: every task's, split over tp * pp."""
        return self.adapters.total_params(self.model) / config.n_gpus if self.adapters else 0.0

    def step_overhead(self, config: ParallelConfig) -> float:
        """Per-step time of one replica of ``config`` outside its micro-batches, seconds:
        the adapters' gradient all-reduce across ``sync_replicas`` and the optimizer step. The all-reduce runs
        on the ``grad_sync`` link of ``config``'s pool, or on its inter-node link when this fleet model prices a
        deployment that spans pools (``spans_pools``, :meth:`spanning`)."""
        key = ("overhead", config)
        if key not in self._memo:
            self._memo[key] = self._step_overhead(config)
        return self._memo[key]

    def _step_overhead(self, config: ParallelConfig) -> float:
        model, layout = self.pool_model(config)
        if model is not self:
            return (model.crossing() if self.spans_pools else model).step_overhead(layout)
        params = self.adapter_params_per_device(config)
        sync = self.interconnect.grad_sync.allreduce(self.sync_replicas)(params * self.activation_bytes)
        return (sync + self.optimizer_time(params)) / MS_PER_S

    @staticmethod
    def bubble_slots(
        config: ParallelConfig, microbatch_tasks: Sequence[Collection[int]] | None = None, window: int = 1
    ) -> float:
        """The pipeline bubble of one step of ``config`` streamed in windows of ``window`` steps, in
        multiples of its largest stage time: ``((pp - 1) + (W - 1) * min(stall, pp - 1)) / W``
        (:func:`schedule.bubble_slots`). With ``microbatch_tasks`` (the task ids of each micro-batch, in
        order) the stall is that order's; without, 0 (the steady state). ``pp - 1`` when W = 1; 0
        without a pipeline."""
        if window < 1:
            raise ValueError(f"a pipeline window is at least one step, got {window}")
        if window == 1:  # no inner step boundary: the stall is never charged, so never computed
            microbatch_tasks = None
        return schedule.bubble_slots(config.pp, window, microbatch_tasks)

    @staticmethod
    def drained_bubble_slots(config: ParallelConfig) -> float:
        """``pp - 1``: the bubble of a step that drains (LobRA Eq. 12), what load models charge
        before any micro-batch exists (``dispatch.load``)."""
        return float(config.pp - 1)

    def replica_time(
        self,
        config: ParallelConfig,
        microbatches: Sequence[MicroBatchShape],
        tasks: Sequence[Collection[int]] | None = None,
        window: int = 1,
    ) -> float:
        """One replica's step time, seconds, streamed in windows of ``window`` steps::

            T = Σ_k τ_k + bubble_slots(config, tasks, window) * max_k τ_k + overhead

        where τ_k is the stage time of micro-batch k: 1F1B pays every micro-batch once per
        stage in steady state and the largest one again for each slot of bubble. ``tasks``: the
        task ids of each micro-batch, in the same order (their stall at the window's step
        boundaries; None: the steady-state estimate). With W = 1 the bubble is ``pp - 1`` slots
        whatever the tasks: LobRA Eq. 12 plus the step overhead.
        """
        if not microbatches:
            return 0.0
        count_work("replicas_priced")
        if tasks is not None and len(tasks) != len(microbatches):
            raise ValueError(f"{len(tasks)} task sets for {len(microbatches)} micro-batches")
        stage, knee, overhead = self._pricing(config)
        times = stage.shapes(microbatches)  # a new array, the sums below in place: each time's arithmetic as written
        times += 0.0 if knee is None else knee.excess_ms(stage, np.asarray([mb.tokens for mb in microbatches]))
        times /= MS_PER_S
        bubble = self.bubble_slots(config, tasks, window)
        return float(times.sum() + bubble * times.max()) + overhead

    def _pricing(self, config: ParallelConfig) -> tuple[LayerTimeCoeffs, MicroBatchKnee | None, float]:
        """What pricing a replica of ``config`` reads, in one memo entry (a replica is priced thousands of times a
        plan): its :meth:`stage_coeffs`, its pool model's knee (None: none, :meth:`_excess_ms` is 0.0) and its
        :meth:`step_overhead`."""
        key = ("pricing", config)
        pricing = self._memo.get(key)
        if pricing is None:
            model, layout = self.pool_model(config)
            pricing = self._memo[key] = (self.stage_coeffs(config), model.knees.get(layout), self.step_overhead(config))
        return pricing
