"""Builders: a CostModel from a profile file, from a datasheet, or from whichever is given; and a
fleet's, one of these per pool (``fleet_cost_model``).

One path turns coefficients and a memory table into a CostModel (``profile_cost_model``);
the analytic source first writes its figures as a Profile (``analytic_profile``), so a
what-if model and a shipped ``profiles/*-analytic.json`` are the same thing.

The time coefficients are those of the profile's adapter load (ranks change t(b, s) only
through the small LoRA GEMMs); the memory table and the step overheads follow the
``adapters`` asked for: each config's M moves by the extra adapter state over its
bytes per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.analytic import (
    DEFAULT_CALIBRATION,
    Calibration,
    analytic_head_time,
    analytic_layer_time,
    analytic_links,
    analytic_optimizer_time,
)
from lorafleet.costmodel.cost_model import CostModel, CostModelOrigin
from lorafleet.costmodel.fitted import fit_profile
from lorafleet.costmodel.memory_model import busiest, stage_lines
from lorafleet.costmodel.microbatch_size import MicroBatchKnee
from lorafleet.costmodel.parallel_config import ParallelConfig, config_problems, enumerate_configs
from lorafleet.costmodel.profile_format import (
    AdaptersJSON,
    AffineJSON,
    Coefficients,
    LinkJSON,
    MemoryRecord,
    Profile,
    read_profile,
)
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.gpus import GIB, GPUSpec
from lorafleet.specs.io import file_sha256
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import ModelSpec
from lorafleet.specs.recompute import RecomputePolicy

BF16_BYTES = 2


def analytic_profile(
    model: ModelSpec,
    cluster: ClusterSpec,
    adapters: AdapterLoad,
    calibration: Calibration = DEFAULT_CALIBRATION,
    command: str = "",
    quantize: Quantization | None = None,
) -> Profile:
    """The analytic figures of every valid config of ``model`` on ``cluster``, with and without
    activation recomputation, as a profile (bf16); over a base stored as ``quantize`` (its weights' bytes in the
    memory lines, its dequantization in the layer times)."""
    gpu = cluster.gpu_spec
    configs = [c.layout for c in enumerate_configs(model, cluster)]
    memory = []
    for config in (c.with_recompute(rc) for c in configs for rc in (False, True)):
        line = busiest(
            stage_lines(
                model, config, adapters, gpu.memory_bytes, BF16_BYTES, calibration.memory_factors, quantize=quantize
            )
        )
        memory.append(
            MemoryRecord(
                tp=config.tp,
                pp=config.pp,
                recompute=config.recompute,
                max_tokens=line.max_tokens(),
                budget_bytes=line.budget_bytes,
                static_bytes=line.static_bytes,
                bytes_per_token=line.bytes_per_token,
            )
        )
    tps = sorted({c.tp for c in configs})
    intra, inter = analytic_links(gpu, calibration)
    coefficients = Coefficients(
        layer_ms={
            tp: analytic_layer_time(model, gpu, tp, adapters, calibration, BF16_BYTES, quantize=quantize).c
            for tp in tps
        },
        head_ms={tp: AffineJSON.of(analytic_head_time(model, gpu, tp, calibration, BF16_BYTES)) for tp in tps},
        p2p_intra_node=LinkJSON.of(intra),
        p2p_inter_node=LinkJSON.of(inter),
        grad_sync=LinkJSON.of(inter if cluster.nodes > 1 else intra),
        optimizer_ms=AffineJSON.of(analytic_optimizer_time(gpu, adapters, calibration, BF16_BYTES)),
    )
    return Profile(
        kind="analytic",
        model=model.name,
        gpu=gpu.name,
        gpus_per_node=cluster.gpus_per_node,
        dtype_bytes=BF16_BYTES,
        adapters=AdaptersJSON.of(adapters),
        command=command,
        settings={"nodes": cluster.nodes, **{f"calibration.{k}": v for k, v in _flat(calibration).items()}},
        memory=tuple(memory),
        coefficients=coefficients,
    )


def analytic_mask_tokens(
    model: ModelSpec,
    config: ParallelConfig,
    adapters: AdapterLoad,
    gpu: GPUSpec,
    calibration: Calibration = DEFAULT_CALIBRATION,
    quantize: Quantization | None = None,
) -> int:
    """The most tokens a micro-batch of ``config`` on ``gpu`` holds with its dropout keep-masks kept for the
    backward, by the memory lines :func:`analytic_profile` records (bf16): the least ``StageMemory.mask_tokens`` of
    its first and last stages (``memory_model``, "Keep-masks"). The executor keeps a call's mask up to it."""
    lines = stage_lines(
        model, config, adapters, gpu.memory_bytes, BF16_BYTES, calibration.memory_factors, quantize=quantize
    )
    return min(line.mask_tokens() for line in lines)


def _flat(cal: Calibration) -> dict[str, float]:
    """Every calibration factor by name, memory factors included (recorded in the profile's settings)."""
    raw = asdict(cal)
    factors = raw.pop("memory_factors")
    return {**raw, **factors}


def profile_cost_model(
    profile: Profile,
    model: ModelSpec,
    adapters: AdapterLoad | None = None,
    *,
    sync_replicas: int = 2,
    recompute: RecomputePolicy = RecomputePolicy.AUTO,
    source: str = "<profile>",
) -> CostModel:
    """The CostModel of a profile (fitting a measured one on the fly if it has no coefficients yet).

    ``adapters`` defaults to the profile's own load; ``recompute`` keeps the configs the
    policy allows (an InputError when it leaves none).
    """
    if model.name != profile.model:
        raise InputError(source, "model", f"profile is for {profile.model!r}, not {model.name!r}")
    coefficients = profile.coefficients or fit_profile(profile, source).coefficients
    profiled = profile.adapters.load
    adapters = adapters or profiled
    extra_per_layer = adapters.params_per_layer(model) - profiled.params_per_layer(model)
    table = {}
    records = [r for r in profile.memory if recompute.allows(r.recompute)]
    if not records:
        raise InputError(source, "memory", f"the profile has no config with recompute={recompute.value}")
    for record in records:
        config = record.config
        line = record.line
        delta = extra_per_layer * model.n_layers / config.n_gpus * adapters.state_bytes_per_param(profile.dtype_bytes)
        m = record.max_tokens + line.with_static_delta(delta).max_tokens() - line.max_tokens()
        if m > 0:
            table[config] = m
    return CostModel(
        model=model,
        layer_time=coefficients.layer_time,
        max_tokens_table=table,
        source=f"{profile.kind}:{source}",
        head_time=coefficients.head_time,
        interconnect=coefficients.interconnect(profile.gpus_per_node),
        optimizer_time=coefficients.optimizer_ms.time,
        forward_layer_time=coefficients.forward_layer_time,
        forward_head_time=coefficients.forward_head_time,
        adapters=adapters,
        activation_bytes=profile.dtype_bytes,
        sync_replicas=sync_replicas,
    )


def analytic_cost_model(
    model: ModelSpec,
    cluster: ClusterSpec,
    adapters: AdapterLoad,
    *,
    calibration: Calibration = DEFAULT_CALIBRATION,
    sync_replicas: int = 2,
    recompute: RecomputePolicy = RecomputePolicy.AUTO,
    quantize: Quantization | None = None,
) -> CostModel:
    """The analytic CostModel of ``model`` on ``cluster`` (its GPU kind, nodes and GPUs per node), over a base
    stored as ``quantize``."""
    profile = analytic_profile(model, cluster, adapters, calibration, quantize=quantize)
    cm = profile_cost_model(
        profile, model, adapters, sync_replicas=sync_replicas, recompute=recompute, source=cluster.gpu
    )
    gpu = cluster.gpu_spec
    knees = {}
    if gpu.microbatch_knee_gib is not None:  # K = the knee's activation bytes over each config's bytes a token
        per_token = {r.config: r.bytes_per_token for r in profile.memory}
        knee_bytes = gpu.microbatch_knee_gib * GIB
        knees = {
            c: MicroBatchKnee(max(1, int(knee_bytes // per_token[c])), gpu.microbatch_knee_penalty) for c in cm.configs
        }
    origin = CostModelOrigin(kind="analytic", gpu=cluster.gpu, quantize=quantize)
    return replace(cm, knees=knees, origin=origin, source=origin.describe())  # ``analytic:L40S over nf4``: the base


def load_cost_model(
    profile_path: str | Path | None,
    model: ModelSpec,
    cluster: ClusterSpec | None,
    adapters: AdapterLoad | None,
    *,
    sync_replicas: int = 2,
    recompute: RecomputePolicy = RecomputePolicy.AUTO,
    quantize: Quantization | None = None,
) -> CostModel:
    """The model of one GPU kind: analytic when ``profile_path`` is None, else from that file.

    ``cluster`` has one pool (a fleet's models are built pool by pool, ``fleet_cost_model``). With a
    profile and a cluster, the profile must be for the cluster's GPU kind, and configs the cluster
    cannot run are dropped; ``recompute`` keeps the configs the policy allows. A quantized base (``quantize``) is
    priced analytically only: a profile measured over an unquantized base is an InputError.
    """
    if profile_path is None:
        if cluster is None or adapters is None:
            raise ValueError("an analytic cost model needs a cluster and an adapter load")
        return analytic_cost_model(
            model, cluster, adapters, sync_replicas=sync_replicas, recompute=recompute, quantize=quantize
        )
    source = str(profile_path)
    if quantize is not None:
        raise InputError(
            source, "quantize", f"{quantize.value}: a profile is measured over an unquantized base; plan analytically"
        )
    profile = read_profile(profile_path)
    if cluster is not None and profile.gpu.lower() != cluster.gpu.lower():
        raise InputError(source, "gpu", f"profile is for {profile.gpu!r}, the cluster has {cluster.gpu!r}")
    cm = profile_cost_model(profile, model, adapters, sync_replicas=sync_replicas, recompute=recompute, source=source)
    cm = replace(
        cm, origin=CostModelOrigin(kind="profile", gpu=profile.gpu, profile=source, sha256=file_sha256(profile_path))
    )
    if cluster is None:
        return cm
    pool = cluster.pools[0].name  # one pool: its cluster.gpu was checked above
    table = {c: m for c, m in cm.max_tokens_table.items() if not config_problems(c.in_pool(pool), model, cluster)}
    return replace(cm, max_tokens_table=table)


def fleet_cost_model(
    model: ModelSpec,
    cluster: ClusterSpec,
    adapters: AdapterLoad,
    profiles: Mapping[str, str | Path | None],
    *,
    sync_replicas: int = 2,
    recompute: RecomputePolicy = RecomputePolicy.AUTO,
    quantize: Quantization | None = None,
) -> CostModel:
    """The CostModel of every pool of ``cluster`` (``CostModel.of_pools``): pool ``name``'s from the profile
    ``profiles[name]``, or its GPU kind's analytic model where that is None or absent; over a base stored as
    ``quantize``.

    Each pool's model prices the adapters' gradient all-reduce on that pool's own ``grad_sync`` link: the
    all-reduce runs over a deployment's replicas, so a deployment on one pool never crosses pools; one on
    several is priced by ``CostModel.spanning``, which moves it to each pool's inter-node link.
    """
    models = {}
    for pool in cluster.pools:
        models[pool.name] = load_cost_model(
            profiles.get(pool.name),
            model,
            cluster.only(pool.name),
            adapters,
            sync_replicas=sync_replicas,
            recompute=recompute,
            quantize=quantize,
        )
    return CostModel.of_pools(models)
