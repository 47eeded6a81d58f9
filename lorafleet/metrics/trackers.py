"""Experiment trackers, ``--logger``: the step scalars (:func:`~lorafleet.metrics.records.step_scalars`, as
TensorBoard's tags) to a Weights & Biases run (:class:`WandbWriter`) or an MLflow run (:class:`MlflowWriter`).
Both packages are optional (the ``wandb`` and ``mlflow`` extras) and imported only when a writer is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from lorafleet.metrics.records import step_scalars
from lorafleet.metrics.sinks import ClosingWriter
from lorafleet.plans import StepReport


class TrackerWriter(ClosingWriter):
    """The step scalars (:func:`~lorafleet.metrics.records.step_scalars`, TensorBoard's tags) to an experiment
    tracker's run, named after the run directory ``out``, ``config`` its parameters. A launch that ``resume``s
    the run (a ``--resume``, a restart, a queued change) continues the tracker run the first launch started,
    its id kept in ``<out>/<ID_FILE>``; a fresh launch starts a new one."""

    ID_FILE = ""
    PACKAGE = ""
    """The package the writer imports when built (``pip install 'lorafleet[<logger>]'``)."""

    def __init__(
        self,
        out: str | Path,
        run_name: str | None = None,
        config: Mapping[str, object] | None = None,
        resume: bool = False,
    ) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / self.ID_FILE
        previous = id_file.read_text(encoding="utf-8").strip() or None if resume and id_file.is_file() else None
        self.run_id = self._start(out, previous, run_name or out.resolve().name, dict(config or {}))
        id_file.write_text(self.run_id + "\n", encoding="utf-8")

    def _start(self, out: Path, run_id: str | None, name: str, config: dict[str, object]) -> str:
        """Continue the tracker run ``run_id`` (None: start one called ``name``); its id."""
        raise NotImplementedError


class WandbWriter(TrackerWriter):
    """A Weights & Biases run (:class:`TrackerWriter`): project ``lorafleet`` (or ``WANDB_PROJECT``), files under
    ``WANDB_DIR`` (default the run directory). ``WANDB_MODE`` (``offline``, ``disabled``) and W&B's other
    variables apply as usual. W&B's console capture is off unless ``WANDB_CONSOLE`` says otherwise: the step
    lines stay the process's own."""

    ID_FILE = ".wandb-run-id"
    PACKAGE = "wandb"

    def _start(self, out: Path, run_id: str | None, name: str, config: dict[str, object]) -> str:
        import wandb  # lazily: an optional dependency (the ``wandb`` extra)

        directory = Path(os.environ.get("WANDB_DIR") or out)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "lorafleet",
            name=name,
            dir=str(directory),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(console=os.environ.get("WANDB_CONSOLE") or "off"),
        )
        return self.run.id

    def write(self, report: StepReport, **extra: object) -> None:
        self.run.log(step_scalars(report, **extra), step=report.step)

    def close(self) -> None:
        self.run.finish()


def _mlflow_key(tag: str) -> str:
    """An MLflow metric name: letters, digits and ``_-. /`` only."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in tag)


class MlflowWriter(TrackerWriter):
    """An MLflow run (:class:`TrackerWriter`): tracking URI ``MLFLOW_TRACKING_URI``, else a file store under
    ``<out>/mlruns``; experiment ``lorafleet`` (or ``MLFLOW_EXPERIMENT_NAME``)."""

    ID_FILE = ".mlflow-run-id"
    PACKAGE = "mlflow"

    def _start(self, out: Path, run_id: str | None, name: str, config: dict[str, object]) -> str:
        from mlflow.tracking import MlflowClient  # lazily: an optional dependency (the ``mlflow`` extra)

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lorafleet"
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        for key, value in config.items():
            self.client.log_param(run_id, _mlflow_key(key), str(value)[:6000])
        return run_id

    def write(self, report: StepReport, **extra: object) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, report.step) for k, v in step_scalars(report, **extra).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


LOGGERS: dict[str, type[TrackerWriter]] = {"wandb": WandbWriter, "mlflow": MlflowWriter}
"""``--logger`` name -> its writer (whose ``PACKAGE`` the ``lorafleet[<name>]`` extra installs)."""


def experiment_logger(
    name: str, out: str | Path, config: Mapping[str, object] | None = None, resume: bool = False
) -> ClosingWriter:
    """The ``--logger`` writer called ``name`` (a key of :data:`LOGGERS`) for the run directory ``out``."""
    return LOGGERS[name](out, config=config, resume=resume)
