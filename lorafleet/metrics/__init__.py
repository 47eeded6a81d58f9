"""Step reports to files, the console and experiment trackers, and read back into the run's summary.

    records.py   what a step's metrics hold: its JSONL object, flat CSV row and scalars by tag
                 (``json_record``, ``flat_record``, ``step_scalars``, ``MAPPING_COLUMNS``), and the
                 StepReport read back out of a row (``step_report``)
    sinks.py     the run directory's writers: ``JsonlWriter`` (``metrics.jsonl``), ``CsvWriter``
                 (``metrics.csv``), ``TensorBoardWriter``, and ``FanOut`` (several at once)
    console.py   ``ProgressBar`` (a terminal), ``LogLines`` (a file or a pipe), ``format_eta``
    trackers.py  ``--logger``: ``WandbWriter``, ``MlflowWriter`` (``TrackerWriter``), ``LOGGERS``,
                 ``experiment_logger``
    files.py     the metrics files read back: ``read_rows``, ``last_losses``, ``truncate_metrics``
    summary.py   ``RunSummary``, the one summary of a run's steps (simulated or trained), built by
                 ``summarize``, ``summarize_phases`` or ``summarize_rows``

Every writer has one interface, ``write(report, **extra)`` and ``close()`` (``MetricsWriter``); ``extra``
carries what the report does not (``records``'s docstring). Torch, rich, wandb and mlflow are imported only
by the writers that need them, when they are built.
"""

from lorafleet.metrics.console import LogLines, ProgressBar, format_eta
from lorafleet.metrics.files import last_losses, read_rows, truncate_metrics
from lorafleet.metrics.records import MAPPING_COLUMNS, flat_record, json_record, step_report, step_scalars
from lorafleet.metrics.sinks import ClosingWriter, CsvWriter, FanOut, JsonlWriter, MetricsWriter, TensorBoardWriter
from lorafleet.metrics.summary import (
    DeploymentSteps,
    RunSummary,
    sum_task_gpu_seconds,
    summarize,
    summarize_phases,
    summarize_rows,
)
from lorafleet.metrics.trackers import LOGGERS, MlflowWriter, TrackerWriter, WandbWriter, experiment_logger

__all__ = [
    "LOGGERS",
    "MAPPING_COLUMNS",
    "ClosingWriter",
    "CsvWriter",
    "DeploymentSteps",
    "FanOut",
    "JsonlWriter",
    "LogLines",
    "MetricsWriter",
    "MlflowWriter",
    "ProgressBar",
    "RunSummary",
    "TensorBoardWriter",
    "TrackerWriter",
    "WandbWriter",
    "experiment_logger",
    "flat_record",
    "format_eta",
    "json_record",
    "last_losses",
    "read_rows",
    "step_report",
    "step_scalars",
    "sum_task_gpu_seconds",
    "summarize",
    "summarize_phases",
    "summarize_rows",
    "truncate_metrics",
]
