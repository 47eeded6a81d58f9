"""The live task queue of a running ``lorafleet train``: request files, the run's task ledger, the changes
pending between two launches, and an optional HTTP front-end (docs/queue.md).

**Requests** (``requests.py``). A directory (``--queue``, by default ``<out>/queue``) of files, one request
each, YAML or JSON (``*.yaml``, ``*.yml``, ``*.json``; names starting with ``.`` are ignored, so a writer can
stage a file as ``.name`` and rename it in). A request is

- a task to **add**: a workload task, the same schema and the workload's ``defaults`` (relative data
  paths are relative to the request file); it needs ``data``. Optional keys: ``action: add``,
  ``at_step`` (not before this global step), and the task's own ``share``/``deadline``;
- ``{action: finish, name: T}`` or ``{action: cancel, name: T}``: task ``T`` stops; its adapter is
  exported to ``<out>/adapters/T`` (finish and cancel differ only in what the ledger records);
- ``{action: update, name: T, share: 0.3}`` (and/or ``deadline``): a new share or deadline.

**When** (``watcher.py``). Rank 0 reads the queue at every window boundary (``QueueWatcher.poll``). A
malformed request is rejected: one line in the run's log, and the file moved to ``queue/rejected/``
beside a ``<file>.reason``; the run goes on. Valid requests that are due are accepted (moved to
``queue/accepted/``) and applied together at that boundary, in the running workers: the run checkpoints
(when a task joins or leaves), leaves them in ``<queue>/.apply.json`` (``pending.py``), puts the changes into
the ledger, re-plans incrementally (``planner.incremental``) and changes its fleet in place
(``train.changes``, in ``train.live``'s order); the launcher applies what the running fleet cannot, between two
launches. Each change is a row of ``<out>/changes.jsonl`` (``train.change_log``).

**Ledger** (``ledger.py``). ``<out>/tasks.json``: every task the run has had, its state and the step it
left at, and the requests applied. A resume trains the ledger's active tasks.

**Over HTTP** (``http.py``). ``start_queue_server`` serves 127.0.0.1 only and turns HTTP calls into request
files; the watcher stays the one judge of them. It also serves the **live page** (``static/``: HTML, JS and CSS)
and its data, ``GET /v1/fleet``: each tenant's state, progress, curves and GPU-seconds, the replicas and the
queue, read from the run's files (``fleet_view.py``).

The request files, the ledger and the pending changes are typed: unknown keys are refused, a wrong
value is named by its field path, and ``lorafleet schema request|ledger|pending`` prints their JSON
Schemas (from the models in ``requests.py``, ``ledger.py`` and ``pending.py``). The names below are what the
rest of lorafleet uses; the package's modules import each other by module.
"""

from lorafleet.train.queue.http import QueueServer, bind_queue_server, remove_stale_token, start_queue_server
from lorafleet.train.queue.ledger import Ledger, LedgerEntry, TaskState
from lorafleet.train.queue.pending import (
    FleetState,
    Pending,
    PendingReplan,
    clear_pending,
    clear_pending_replan,
    has_pending,
    launcher_pending,
    load_pending,
    load_pending_replan,
    save_pending,
    save_pending_replan,
)
from lorafleet.train.queue.requests import Action, Request, RequestError, data_roots
from lorafleet.train.queue.watcher import QueueWatcher, read_request

__all__ = [
    "Action",
    "FleetState",
    "Ledger",
    "LedgerEntry",
    "Pending",
    "PendingReplan",
    "QueueServer",
    "QueueWatcher",
    "Request",
    "RequestError",
    "TaskState",
    "bind_queue_server",
    "clear_pending",
    "clear_pending_replan",
    "data_roots",
    "has_pending",
    "launcher_pending",
    "load_pending",
    "load_pending_replan",
    "read_request",
    "remove_stale_token",
    "save_pending",
    "save_pending_replan",
    "start_queue_server",
]
