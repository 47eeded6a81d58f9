"""One rank of a run its launcher started: ``python -m lorafleet.train.rank <out>/run.json`` (under torchrun).

The rank reads the run file its launcher wrote (``train.run_file``) and runs
:func:`lorafleet.train.trainer.train_rank`; there is no command line to parse again. Bad input found in the
rank is recorded as its one line and ends the rank with exit code 2: the launcher stops the job and says it
(once for the run, not once per rank); any other error is recorded under ``<out>/logs/`` (its traceback) and
ends the rank with exit code 1, for the launcher's one line (``train.failures``). A run file that cannot be
read is this process's own line, exit 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from lorafleet.errors import EXIT_INPUT_ERROR, InputError, exit_code


def main(argv: Sequence[str]) -> int:
    """Run this process's rank of the run file ``argv[0]``."""
    from lorafleet.runtime.gc_policy import fewer_collections
    from lorafleet.runtime.processes import catch_stop_signals, die_with_torchrun

    die_with_torchrun()  # first, before the imports and reads of start-up: never outlive the run
    catch_stop_signals()  # a job-wide SIGINT/SIGTERM is a stop request, never a death mid-step
    from lorafleet.train.run_file import ResolvedRun
    from lorafleet.train.trainer import train_rank

    if len(argv) != 1:
        raise InputError("<args>", "", "usage: python -m lorafleet.train.rank RUN_FILE (started by lorafleet train)")
    resolved = ResolvedRun.load(argv[0])
    try:
        with fewer_collections():  # as every command: rank 0 dispatches each step (runtime.gc_policy)
            return train_rank(resolved.options, resolved.prepared())
    except InputError as err:  # the launcher says it, once for the run (train.failures)
        from lorafleet.train.failures import record_input_error

        record_input_error(resolved.options.run_dir, err)
        return EXIT_INPUT_ERROR
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # before the process group (train_rank records its own): logs/, exit 1
        from lorafleet.train.failures import record_worker_error

        record_worker_error(resolved.options.run_dir, int(os.environ.get("RANK", "0")), err)
        return 1


if __name__ == "__main__":
    from lorafleet.runtime.processes import skip_teardown

    exiting = skip_teardown()  # first: its exit hook runs after every other one
    sys.exit(exiting(exit_code(lambda: main(sys.argv[1:]))))
