"""``lorafleet profile`` (measure a profile on this machine) and ``lorafleet fit`` (fit its coefficients).

lorafleet profile --model tiny-llama --configs 1x1,1x2,2x1,2x2 --out profiles/tiny-llama-cpu.json
lorafleet profile --device cuda --dtype bf16 --model smollm2-135m --configs 1x1,1x2 --out P.json
lorafleet fit profiles/tiny-llama-cpu.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from lorafleet.errors import InputError
from lorafleet.specs.device import Precision

ARGS = "<args>"
DEVICE_KINDS = ("cpu", "cuda")
CPU_BUDGET_MIB = 48


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure per-layer, head, step, transfer and memory records of a model on this machine",
        description="Spawns one process per device (cpu: gloo processes of one CPU thread each; cuda: one GPU "
        "each, NCCL) and writes a measured, fitted profile.",
    )
    p.add_argument("--model", required=True, help="model preset or HF config.json path")
    p.add_argument(
        "--configs",
        required=True,
        help="comma-separated <tp,pp> to profile, e.g. 1x1,1x2,2x1; "
        "a config with recompute (1x1rc) gets its own max tokens",
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--tasks", type=int, default=3, help="number of task adapters (default 3)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of every task (default 8)")
    p.add_argument("--optimizer", default="adamw", help="adamw | adam | sgd (default adamw)")
    p.add_argument("--seq-lens", default="16,32,64,128,256,512,1024", help="grid of padded lengths")
    p.add_argument("--mbs", default="1,2,4,8,16", help="grid of micro-batch sizes")
    p.add_argument("--max-grid-tokens", type=int, default=4096, help="largest b*s of the grid and of random shapes")
    p.add_argument(
        "--packed", type=int, default=12, help="random packed micro-batches fitted with the grid, per TP degree"
    )
    p.add_argument("--heldout", type=int, default=6, help="held-out padded (and packed) layer records per TP degree")
    p.add_argument("--replica-steps", type=int, default=5, help="timed whole steps per TP degree and sync setting")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before each timing (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls; a record is their median (default 5)")
    p.add_argument(
        "--rounds", type=int, default=2, help="passes over all timings; a record keeps its smallest median (default 2)"
    )
    p.add_argument(
        "--memory-budget-mib",
        type=float,
        help="memory of one device for the max-tokens search (default: 48 on cpu, the GPU's memory on cuda)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=DEVICE_KINDS,
        help="cpu (default): one CPU thread per process, gloo; cuda: one GPU per process, NCCL, "
        "times synchronised with the GPU",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=[p.value for p in Precision],
        help="of the base model and the activations "
        "(default fp32); adapters stay fp32 master weights over bf16, as in training",
    )
    p.add_argument(
        "--gpu",
        help="GPU preset the profile is for (default: cpu on cpu; on cuda the preset that "
        "matches the device's name and memory)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, profile_action="profile")

    f = subparsers.add_parser("fit", help="fit a profile's cost-model coefficients and record the fit quality")
    f.add_argument("profile", help="profile JSON (rewritten in place unless --out)")
    f.add_argument("--out", help="write the fitted profile here instead")
    f.add_argument("--folds", type=int, default=5, help="cross-validation folds (default 5)")
    f.set_defaults(func=run, profile_action="fit")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InputError(ARGS, flag, f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InputError(ARGS, flag, f"expected positive integers, got {text!r}")
    return values


def _at_least(value: float, minimum: float, flag: str) -> None:
    if value < minimum:
        raise InputError(ARGS, flag, f"must be >= {minimum}, got {value}")


def _settings(args: argparse.Namespace):
    from lorafleet.costmodel.adapters import AdapterLoad
    from lorafleet.costmodel.parallel_config import ParallelConfig, config_problems
    from lorafleet.profiling.device import DeviceKind
    from lorafleet.profiling.run import MIB, ProfileSettings
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.specs.lora import OptimizerName
    from lorafleet.specs.model import resolve_model

    model = resolve_model(args.model)
    try:
        configs = tuple(ParallelConfig.parse(c) for c in args.configs.split(",") if c.strip())
    except ValueError as err:
        raise InputError(ARGS, "--configs", str(err)) from None
    try:
        optimizer = OptimizerName(args.optimizer)
    except ValueError:
        raise InputError(
            ARGS, "--optimizer", f"unknown optimizer {args.optimizer!r}; choose from adamw, adam, sgd"
        ) from None
    if not configs:
        raise InputError(ARGS, "--configs", "names no config")
    device = DeviceKind(args.device)
    gpu, budget_mib, transfers = _device_choices(args, device, configs)
    # Pipeline stages are emulated one at a time, so a config needs only its TP group of processes.
    host = ClusterSpec(gpu=gpu, nodes=max(c.pp for c in configs), gpus_per_node=max(2, *(c.tp for c in configs)))
    for config in configs:
        problems = config_problems(config, model, host)
        if problems:
            raise InputError(ARGS, "--configs", f"{config}: {problems[0]}")
    for flag, value, minimum in (
        ("--tasks", args.tasks, 1),
        ("--rank", args.rank, 1),
        ("--max-grid-tokens", args.max_grid_tokens, 16),
        ("--packed", args.packed, 0),
        ("--heldout", args.heldout, 0),
        ("--replica-steps", args.replica_steps, 0),
        ("--warmup", args.warmup, 0),
        ("--repeats", args.repeats, 1),
        ("--rounds", args.rounds, 1),
        ("--memory-budget-mib", budget_mib, 1),
    ):
        _at_least(value, minimum, flag)
    return ProfileSettings(
        model=model,
        configs=configs,
        adapters=AdapterLoad.uniform(args.tasks, args.rank, optimizer=optimizer),
        seq_lens=_ints(args.seq_lens, "--seq-lens"),
        mbs=_ints(args.mbs, "--mbs"),
        max_grid_tokens=args.max_grid_tokens,
        packed=args.packed,
        heldout=args.heldout,
        replica_steps=args.replica_steps,
        warmup=args.warmup,
        repeats=args.repeats,
        rounds=args.rounds,
        memory_budget_bytes=int(budget_mib * MIB),
        seed=args.seed,
        transfers=transfers,
        device=device,
        precision=Precision(args.dtype),
        gpu=gpu,
        command=shlex.join(["lorafleet", *sys.argv[1:]]),
    )


def _device_choices(args: argparse.Namespace, device, configs) -> tuple[str, float, bool]:
    """(GPU preset, memory budget in MiB, whether to time transfers) for ``--device``.

    On cuda every process takes one GPU: a world larger than the GPUs this process sees is an
    InputError, and on one GPU the world is one process (TP1 only, no transfer records).
    """
    from lorafleet.profiling.device import DeviceKind, cuda_device_count, cuda_memory_bytes
    from lorafleet.profiling.run import MIB
    from lorafleet.specs.gpus import gpu_preset_for, resolve_gpu

    if device is DeviceKind.CPU:
        gpu = resolve_gpu(args.gpu or "cpu", ARGS, "--gpu").name
        return gpu, CPU_BUDGET_MIB if args.memory_budget_mib is None else args.memory_budget_mib, True
    import torch

    n_gpus = cuda_device_count()
    if n_gpus == 0:
        raise InputError(ARGS, "--device", f"cuda: no CUDA device is visible (torch {torch.__version__})")
    tp = max(c.tp for c in configs)
    if tp > n_gpus:
        raise InputError(
            ARGS,
            "--configs",
            f"tp={tp} needs {tp} processes of one GPU each; this machine has "
            f"{n_gpus} GPU{'s' if n_gpus > 1 else ''}: profile configs of tp <= {n_gpus}",
        )
    memory = cuda_memory_bytes(0)
    name = torch.cuda.get_device_name(0)
    if args.gpu is not None:
        gpu = resolve_gpu(args.gpu, ARGS, "--gpu").name
    else:
        gpu = gpu_preset_for(name, memory)
        if gpu is None:
            raise InputError(ARGS, "--gpu", f"no GPU preset matches {name!r}; name the closest one with --gpu")
    budget_mib = memory / MIB if args.memory_budget_mib is None else args.memory_budget_mib
    return gpu, budget_mib, n_gpus >= 2


def fit_and_report(profile, source: str, folds: int):
    """Fit ``profile``, add the held-out summaries to its quality, and print both; returns the fitted profile."""
    from lorafleet.costmodel.check import heldout_comparisons, summarize
    from lorafleet.costmodel.fitted import fit_profile
    from lorafleet.specs.model import resolve_model

    fitted = fit_profile(profile, source, folds)
    heldout = summarize(heldout_comparisons(fitted, resolve_model(fitted.model, source, "model"), source))
    quality = {**fitted.quality, **{name: s.to_json() for name, s in heldout.items()}}
    for name, summary in sorted(quality.items()):
        print(
            f"{name:22s} n={summary['n']:<4} median={summary['median']:.1%} p90={summary['p90']:.1%} "
            f"max={summary['max']:.1%}"
        )
    return fitted.model_copy(update={"quality": quality})


def _check_output(path: str) -> None:
    """An InputError naming ``path`` now, before minutes of measuring or fitting, when the profile could not be
    written there later: ``specs.io.check_writable``'s checks, then a folder made (and removed at once) in
    the nearest folder of ``path`` that exists, as the write would make the missing ones or its file there.
    Asking is not enough: ``os.access`` lets root write anywhere, ``/proc`` and read-only mounts included."""
    from lorafleet.specs.io import check_writable

    check_writable(path)
    folder = Path(path).absolute().parent
    while not folder.exists() and not folder.is_symlink():
        folder = folder.parent
    try:
        tempfile.TemporaryDirectory(prefix=".lorafleet-check-", dir=folder).cleanup()
    except OSError as err:
        why = err.strerror or err
        raise InputError(path, "", f"cannot write here (nothing can be created in {folder}: {why})") from None


def run(args: argparse.Namespace) -> int:
    from lorafleet.costmodel.profile_format import read_profile, write_profile

    if args.profile_action == "fit":
        _at_least(args.folds, 2, "--folds")
        profile = read_profile(args.profile)
        _check_output(args.out or args.profile)  # before the fit, not after it
        write_profile(fit_and_report(profile, args.profile, args.folds), args.out or args.profile)
        return 0

    from lorafleet.profiling.run import measure_profile

    _check_output(args.out)  # before the measurements, not after them
    settings = _settings(args)
    profile = fit_and_report(measure_profile(settings), args.out, folds=5)
    write_profile(profile, args.out)
    for m in profile.memory:
        print(f"max tokens {m.config}: {m.max_tokens}")
    print(f"wrote {args.out}")
    return 0
