"""``lorafleet costmodel predict|check``: query a cost model, or check a profile against its held-out records.

lorafleet costmodel predict --model llama2-7b --gpu A100-40GB --tp 2 --seq-len 2048 --mbs 4
lorafleet costmodel predict --model llama2-70b --gpu A800-80GB --tp 4 --recompute --seq-len 16384 --mbs 1
lorafleet costmodel predict --model llama2-7b --csv ../shared/reference/lobra_a100_40gb_llama2_7b_layer_time.csv
lorafleet costmodel predict --profile profiles/tiny-llama-cpu.json --model tiny-llama --tp 1 --seq-len 256 --mbs 4
lorafleet costmodel check profiles/tiny-llama-cpu.json
"""

from __future__ import annotations

import argparse
import csv
import io
import sys

from lorafleet.errors import InputError

ARGS = "<args>"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("costmodel", help="predict with a cost model, or check a profile's accuracy")
    sub = parser.add_subparsers(dest="costmodel_action", metavar="ACTION", required=True)

    predict = sub.add_parser(
        "predict",
        help="per-layer, stage and replica times and max tokens of micro-batches",
        description="Analytic from --gpu when no --profile is given. With --csv (columns tp, seq_len, mbs, optional pp "
        "and time), writes the rows back with pred_ms (ms per layer, LobRA's unit), stage_ms and max_tokens.",
    )
    predict.add_argument("--profile", help="profile JSON; analytic from the GPU datasheet when omitted")
    predict.add_argument("--model", required=True, help="model preset or HF config.json path")
    predict.add_argument("--gpu", default="A100-40GB", help="GPU preset of the analytic model (default A100-40GB)")
    predict.add_argument("--nodes", type=int, default=1, help="nodes of the analytic cluster (default 1)")
    predict.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node of the analytic cluster (default 8)"
    )
    predict.add_argument("--tasks", type=int, help="task adapters on every replica (default: the profile's, else 6)")
    predict.add_argument("--rank", type=int, help="LoRA rank of every task (default: the profile's, else 16)")
    predict.add_argument("--optimizer", help="adamw | adam | sgd (default: the profile's, else adamw)")
    predict.add_argument("--sync-replicas", type=int, default=2, help="replicas in the adapters' gradient all-reduce")
    predict.add_argument("--tp", type=int, help="tensor-parallel degree")
    predict.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    predict.add_argument("--recompute", action="store_true", help="with activation recomputation (<tp,pp,rc>)")
    predict.add_argument("--seq-len", type=int, help="padded sequence length s")
    predict.add_argument("--mbs", type=int, help="sequences per micro-batch b")
    predict.add_argument("--csv", help="CSV of micro-batches instead of --tp/--seq-len/--mbs")
    predict.add_argument("--out", help="write the CSV here instead of stdout")
    predict.set_defaults(func=run)

    check = sub.add_parser("check", help="predicted vs measured on a profile's held-out records")
    check.add_argument("profile", help="measured profile JSON")
    check.set_defaults(func=run)


def _cost_model(args: argparse.Namespace):
    from lorafleet.costmodel.adapters import AdapterLoad
    from lorafleet.costmodel.build import load_cost_model
    from lorafleet.specs.cluster import ClusterSpec
    from lorafleet.specs.lora import OptimizerName
    from lorafleet.specs.model import resolve_model

    model = resolve_model(args.model)
    for flag, value in (("--tasks", args.tasks), ("--rank", args.rank), ("--sync-replicas", args.sync_replicas)):
        if value is not None and value < 1:
            raise InputError(ARGS, flag, f"must be >= 1, got {value}")
    adapters = None  # a profile's own load, unless the adapters are given
    if args.profile is None or (args.tasks, args.rank, args.optimizer) != (None, None, None):
        try:
            optimizer = OptimizerName(args.optimizer or "adamw")
        except ValueError:
            raise InputError(
                ARGS, "--optimizer", f"unknown optimizer {args.optimizer!r}; choose from adamw, adam, sgd"
            ) from None
        adapters = AdapterLoad.uniform(args.tasks or 6, args.rank or 16, optimizer=optimizer)
    cluster = None
    if args.profile is None:
        try:
            cluster = ClusterSpec(gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
        except ValueError as err:
            raise InputError(ARGS, "--gpu", str(err).splitlines()[-1]) from None
    return load_cost_model(args.profile, model, cluster, adapters, sync_replicas=args.sync_replicas)


def _config(cm, tp: int, pp: int, source: str, field: str):
    from lorafleet.costmodel.parallel_config import ParallelConfig

    if tp is None or tp < 1 or pp < 1:
        raise InputError(source, field, f"need tp >= 1 and pp >= 1, got tp={tp}, pp={pp}")
    if tp not in cm.layer_time:
        raise InputError(source, field, f"the cost model has no tp={tp}; it has {sorted(cm.layer_time)}")
    if cm.model.n_layers % pp:
        raise InputError(source, field, f"pp={pp} does not divide {cm.model.n_layers} layers")
    return ParallelConfig(tp, pp)


def _predict_one(cm, args: argparse.Namespace) -> None:
    from lorafleet.costmodel.time_model import MS_PER_S, MicroBatchShape

    if args.seq_len is None or args.mbs is None or args.seq_len < 1 or args.mbs < 1:
        raise InputError(ARGS, "--seq-len/--mbs", "give positive --tp, --seq-len and --mbs, or --csv")
    config = _config(cm, args.tp, args.pp, ARGS, "--tp").with_recompute(args.recompute)
    mb = MicroBatchShape.padded(args.mbs, args.seq_len)
    m = cm.max_tokens(config)
    tau = cm.shape_time(config, mb)
    print(f"cost model        {cm.source}")
    print(f"config            {config}  max tokens M = {m}")
    print(
        f"micro-batch       {args.mbs} x {args.seq_len} = {mb.tokens} tokens: "
        f"{'fits' if 0 < mb.tokens <= m else 'exceeds M'}"
    )
    print(
        f"per-layer time    {cm.block_coeffs(config)(args.mbs, args.seq_len):.3f} ms  (LobRA t(b, "
        f"s){', recomputed' if config.recompute else ''})"
    )
    print(f"stage time        {tau * MS_PER_S:.3f} ms  ({cm.model.n_layers // config.pp} layers + head + transfers)")
    print(
        f"step overhead     {cm.step_overhead(config) * MS_PER_S:.3f} ms  (adapter all-reduce over "
        f"{cm.sync_replicas} + optimizer)"
    )
    print(f"replica step      {cm.replica_time(config, [mb]) * MS_PER_S:.3f} ms  (this micro-batch alone)")


def _predict_csv(cm, args: argparse.Namespace) -> None:
    import numpy as np

    from lorafleet.costmodel.fit import ErrorSummary
    from lorafleet.costmodel.profile_format import read_layer_csv
    from lorafleet.costmodel.time_model import MS_PER_S
    from lorafleet.specs.io import write_text_atomic

    rows = read_layer_csv(args.csv)
    configs = [_config(cm, r.tp, r.pp, args.csv, f"line {i}: tp") for i, r in enumerate(rows, start=2)]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["tp", "pp", "seq_len", "mbs", "time", "pred_ms", "stage_ms", "max_tokens"])
    for r, config in zip(rows, configs):
        pred = cm.layer_time[r.tp](r.mbs, r.seq_len)
        stage = cm.shape_time(config, r.shape) * MS_PER_S
        time = "" if r.time is None else r.time
        writer.writerow([r.tp, r.pp, r.seq_len, r.mbs, time, f"{pred:.4f}", f"{stage:.3f}", cm.max_tokens(config)])
    if args.out:
        write_text_atomic(args.out, out.getvalue())
    else:
        sys.stdout.write(out.getvalue())
    measured = [(cm.layer_time[r.tp](r.mbs, r.seq_len), r.time) for r in rows if r.time is not None]
    if measured:
        pred, meas = np.array(measured).T
        print(f"pred_ms vs time: {ErrorSummary.of(pred, meas)}", file=sys.stderr)


def _check(args: argparse.Namespace) -> None:
    from lorafleet.costmodel.check import heldout_comparisons, summarize
    from lorafleet.costmodel.profile_format import read_profile
    from lorafleet.specs.model import resolve_model

    profile = read_profile(args.profile)
    comparisons = heldout_comparisons(profile, resolve_model(profile.model, args.profile, "model"), args.profile)
    if not comparisons:
        raise InputError(args.profile, "records", f"no held-out records to check ({profile.kind} profile)")
    print(f"{'kind':8s} {'measured ms':>12s} {'predicted ms':>12s} {'error':>7s}  record")
    for c in comparisons:
        print(f"{c.kind:8s} {c.measured_ms:12.3f} {c.predicted_ms:12.3f} {c.rel_error:+7.1%}  {c.label}")
    print()
    for name, summary in summarize(comparisons).items():
        print(f"{name:16s} {summary}")
    for name, stored in sorted(profile.quality.items()):
        if "layer_cv" in name:  # t(b, s)'s, and the forward's (forward_layer_cv)
            print(
                f"{name:16s} n={stored['n']} median={stored['median']:.1%} p90={stored['p90']:.1%} (k-fold CV of the "
                "fit)"
            )


def run(args: argparse.Namespace) -> int:
    if args.costmodel_action == "check":
        _check(args)
        return 0
    if args.out:
        from lorafleet.specs.io import check_writable

        check_writable(args.out)
    cm = _cost_model(args)
    if args.csv:
        _predict_csv(cm, args)
    else:
        _predict_one(cm, args)
    return 0
