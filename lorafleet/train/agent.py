"""torchrun as ``lorafleet train``'s launcher runs it: ``python -m lorafleet.train.agent OUT <torchrun arguments>``.

torch's own entry (``python -m torch.distributed.run``) answers a failed worker with a table of the failures
and a traceback of its own. Here the same agent (``torch.distributed.run.run``) reports them as data
instead, into ``OUT/logs/failures.json`` (``train.failures``, which the launcher turns into one line), and
exits 1 without a word. Its log lines are quiet too (``LOGLEVEL``, torch elastic's own setting, is
``CRITICAL`` unless the user set it): the OpenMP banner of every multi-rank start, each failed worker and
each signal sent at a shutdown are said by the launcher's lines instead (a restart by rank 0's "process
group up ..., restart k of K").
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Run torchrun's agent over ``argv[1:]`` for the run directory ``argv[0]``."""
    quiet = "LOGLEVEL" not in os.environ
    if quiet:
        os.environ["LOGLEVEL"] = "CRITICAL"  # read as torch's elastic loggers are made: before the imports
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if quiet:  # the loggers made without a level of their own (the worker processes' handler) inherit this
        logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)

    from lorafleet.rundir import RunDir
    from lorafleet.train.failures import WorkerFailure, write_failures

    run_dir = RunDir(argv[0])
    run_dir.failures.unlink(missing_ok=True)
    try:
        run(parse_args(list(argv[1:])))
    except ChildFailedError as err:
        failed = [WorkerFailure(r, f.pid, f.exitcode, int(f.timestamp)) for r, f in sorted(err.failures.items())]
        write_failures(run_dir.failures, failed)
        return 1
    return 0


if __name__ == "__main__":
    from lorafleet.runtime.processes import skip_teardown

    exiting = skip_teardown()  # first: its exit hook runs after every other one (torch elastic's among them)
    sys.exit(exiting(main(sys.argv[1:])))
