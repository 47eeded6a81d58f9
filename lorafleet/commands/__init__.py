"""One module per CLI subcommand.

Each subcommand's module defines ``register(subparsers)``, which adds its argparse subparser(s) with
``set_defaults(func=run)``, and ``run(args) -> int``. Modules import heavy dependencies
(torch, solvers) inside ``run`` so that ``lorafleet --help`` stays fast.

    validate.py        ``lorafleet validate``: a workload loaded, every task's lengths summarised
    plan.py            ``lorafleet plan``: the deployment plan against the baselines (``--gpus auto``: the fleet sized)
    simulate.py        ``lorafleet simulate``: the plan and every baseline through the simulator; ``--arrivals``
    dispatch.py        ``lorafleet dispatch``: sampled global batches dispatched on a plan
    whatif.py          ``lorafleet whatif``: the workload re-planned and re-simulated per variation
    train.py           ``lorafleet train``: the flags into ``TrainOptions``, then ``train.launcher.launch``
    profile.py         ``lorafleet profile`` (a profile measured on this machine) and ``lorafleet fit``
    costmodel.py       ``lorafleet costmodel predict|check``
    schema.py          ``lorafleet schema [KIND]``: the JSON Schema of each of lorafleet's files
    sweep_report.py    ``lorafleet sweep-report RUN``: a training run's sweeps, their members and winners

Modules whose name starts with ``_`` are helpers the commands share, not commands (``cli`` skips them):
``_plan_flags.py`` (the flags of plan-reading commands, the policy's generated from its field table),
``_set_flags.py`` (``--set KEY=VALUE``), ``_option_flags.py`` (the flags of a settings dataclass's field table,
``specs.fields``: ``train``'s and the re-plan's) and ``_replica_groups.py`` (a plan's replicas grouped by config,
for tables that stay readable with hundreds of replicas).
"""
