"""Training, top to bottom: check everything, start the processes, run the step loop on rank 0.

    options.py    TrainOptions: what ``lorafleet train`` is told, and the command line that re-creates it
    preflight.py  prepare(options): every input checked (workload, plan, cost model, run directory,
                  checkpoint, data) before any process starts; claim(): the run directory locked and
                  made this run's
    resume.py     what a start takes over from the run before it: resume_step(), the tasks it trains
                  (training_workload(): the task ledger's, revisions checked), the plan it resumes by
    revisions.py  what a resume may not change silently: a task's spec compared field by field (Revision)
    replan.py     replan_run(): a running job's re-plan, for other GPUs (a resume) or other tasks (the queue)
    run_file.py   ResolvedRun: ``<out>/run.json``, what the launcher resolved for its workers (each dataset
                  task's token-length histogram included, so a rank does not tokenize for lengths)
    launcher.py   launch(options): the entry; the command re-run under ``torchrun --standalone``, one
                  process a rank, supervised (signals, exit codes), or, already under torchrun, this
                  process's rank
    agent.py      torchrun's agent as the launcher runs it: failed workers reported as data
    failures.py   a failed run in one line: the workers' records under ``<out>/logs/``, failure_line()
    phases.py     the start-up lines on the console, each with its time (phase())
    rank.py       one rank: ``python -m lorafleet.train.rank <out>/run.json``
    trainer.py    train_rank(): one process joins the group and builds its part of the fleet; rank 0
                  trains, the others serve it. Trainer.train(): restore -> probe -> per window {dispatch
                  (one window ahead), run_steps, recalibrate, watch for non-finite tasks, metrics,
                  checkpoint every K} and the fleet's changes at its boundaries -> final checkpoint -> PEFT
                  adapters -> summary
    running.py    Running: what the loop runs between two changes, one value swapped whole; Stop; FleetPort
    changes.py    FleetChanges: rank 0's one component of fleet changes (the queue's watcher, the requests
                  due and departures, the ledger, the added tasks' data, tokenized once, the migration
                  model, the re-plan beside the steps), by ``planner.decision``'s rule
    evaluation.py Evaluations: rank 0's evaluations of the tasks with an ``eval`` (when each is due, run on the
                  fleet, reported), their best adapters kept and their early stops (``lorafleet.stopping``)
    change_costs.py  what a change costs and says: the next move's learnt price, a fleet's cost model, the
                  hand-off's line
    torch_fleet.py  TorchFleet: the FleetPort (and EvalPort) over rank 0's torch executor
    joining.py    Joining: a task the queue adds has its data prepared beside the steps, and joins when ready
    promote.py    a sweep's winner promoted to ``adapters/<sweep>/`` at the run's end, with its card and
                  ``sweep.json``; run_tasks(): every task a run has had
    inflight.py   a change as a transaction: .apply.json begun with the fleet before it, decided with the fleet
                  after it, settled once a checkpoint after it commits (the ledger, plan.json, run.json)
    live.py       what the fleet and the launcher share of a change (its workload, exports, re-plan);
                  apply_pending(), in the launcher, for a change the running fleet hands to it
    background.py BackgroundReplan: the incremental re-plan of a change, run beside the next steps
    change_log.py ChangeRecord: a row of ``<out>/changes.jsonl`` per change, departure and re-plan answer
    queue/        the live task queue: request files, the task ledger, the pending changes, HTTP
    probe.py      probe(): each replica timed on a cut of the first step before it runs (the first
                  observation of the recalibrator)
    health.py     TaskHealth: non-finite updates counted per task; a task stopped after too many in a row
    summary.py    the closing lines: the run's RunSummary (lorafleet.metrics, from every launch's
                  metrics.jsonl rows), formatted
    own_plan.py   without --plan, on one machine: the run plans for itself (as ``lorafleet plan`` would) and keeps
                  it as ``<out>/plan.json``
    run_length.py what a run's length means for its tasks: --steps resolved when not given (until the tasks are
                  done), each task's steps in the run and the rows it sees (``<out>/run_length.json``), a line for
                  each task the run cuts short

The launcher's modules (options, preflight, resume, revisions, replan, run_file, launcher, failures,
phases, live, queue, summary, run_length, own_plan) and the torch-free part of the fleet changes (running, changes,
inflight, joining, change_log)
import no torch (an import-linter contract): the checks of data, checkpoints and processes are
``lorafleet.runtime``'s, torch-free, and torch is imported only on a rank (rank, trainer, torch_fleet) and by
torchrun's agent. (Measuring a task's data loads torch, through its tokenizer's library, unless its lengths
are in the token-length cache, ``data.length_cache``: a launch of data tokenized before imports no torch.)

The plan runs under its own dispatch policy and with the cost model it was judged by (flags
may override either; the run says so). What each step measures corrects that cost model
replica by replica (``dispatch.recalibration``) for the steps that follow; the corrections
travel in the checkpoints. A resume on another number of GPUs re-plans for them with the
plan's cost model and policy (checkpoints do not depend on the plan). Reliability rules
(docs/reliability.md): one run per directory, ``--steps`` is the run's total, resume never
rolls back and uses the newest intact checkpoint, SIGINT/SIGTERM stop at a step boundary with a
checkpoint, workers die with their launcher, ``--max-restarts`` restarts failed workers from the
last checkpoint.

Writes, under ``out`` (every path named by ``lorafleet.rundir.RunDir``): ``plan.json`` (the plan the run
trains by), ``run.json`` (the run file), ``metrics.jsonl`` and
``metrics.csv`` (one line per step: loss per task, tokens/s, busy time per replica, the
dispatcher's prediction of it (``predicted_busy_s``, as recalibrated) and the cost model's own
(``model_busy_s``), each replica's tokens and correction, CPU seconds per rank, tasks skipped for
non-finite updates), ``tensorboard/``, ``checkpoints/``, ``adapters/<task>/`` (the final PEFT
adapters, and each task's that left earlier), ``tasks.json`` (the task ledger) and ``changes.jsonl`` (a row
per change) once the fleet's tasks changed (a queued request, a task that took its steps), and ``logs/`` when a
worker failed.
"""
