"""Training, top to bottom: check everything, start the processes, run the step loop on rank 0.

    options.py    TrainOptions: what ``lorafleet train`` is told, and the command line that re-creates it
    preflight.py  prepare(options): every input checked (workload, plan, cost model, run directory,
                  checkpoint, data) before any process starts; claim(): the run directory locked and
                  made this run's
    resume.py     what a start takes over from the run before it: resume_step(), the tasks it trains
                  (training_workload(): the task ledger's, revisions checked), the plan it resumes by
    launcher.py   launch(options): the entry; the command re-run under ``torchrun --standalone``, one
                  process a rank, supervised (signals, exit codes), or, already under torchrun, this
                  process's rank
    trainer.py    train_rank(): one process joins the group and builds its part of the fleet; rank 0
                  trains, the others serve it. Trainer.train(): restore -> per step {dispatch (one step
                  ahead), run_step, recalibrate, watch for non-finite tasks, metrics, checkpoint every K}
                  -> final checkpoint -> PEFT adapters -> summary
    probe.py      probe(): each replica timed on a cut of the first step before it runs (the first
                  observation of the recalibrator)
    health.py     TaskHealth: non-finite updates counted per task; a task stopped after too many in a row
    summary.py    the closing lines: the run's RunSummary (lorafleet.metrics, from every launch's
                  metrics.jsonl rows), formatted

options, preflight, resume and launcher do not import torch: the torch executor's helpers are imported
inside the functions that need them (a resume's checks, a rank), so a fresh run's launcher calls
none of them. (Reading a task's data may still load torch, through its tokenizer's library.)

The plan runs under its own dispatch policy and with the cost model it was judged by (flags
may override either; the run says so). What each step measures corrects that cost model
replica by replica (``dispatch.recalibration``) for the steps that follow; the corrections
travel in the checkpoints. A resume on another number of GPUs re-plans for them with the
plan's cost model and policy (checkpoints do not depend on the plan). Reliability rules
(docs/reliability.md): one run per directory, ``--steps`` is the run's total, resume never
rolls back and uses the newest intact checkpoint, SIGINT/SIGTERM stop at a step boundary with a
checkpoint, workers die with their launcher, ``--max-restarts`` restarts failed workers from the
last checkpoint.

Writes, under ``out``: ``plan.json`` (the plan the run trains by), ``metrics.jsonl`` and
``metrics.csv`` (one line per step: loss per task, tokens/s, busy time per replica, the
dispatcher's prediction of it (``predicted_busy_s``, as recalibrated) and the cost model's own
(``model_busy_s``), each replica's tokens and correction, CPU seconds per rank, tasks skipped for
non-finite updates), ``tensorboard/``, ``checkpoints/`` and ``adapters/<task>/`` (the final PEFT
adapters).
"""
