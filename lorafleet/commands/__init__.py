"""One module per CLI subcommand.

Each module defines ``register(subparsers)``, which adds its argparse subparser(s) with
``set_defaults(func=run)``, and ``run(args) -> int``. Modules import heavy dependencies
(torch, solvers) inside ``run`` so that ``lorafleet --help`` stays fast.
"""
