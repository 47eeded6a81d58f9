"""Experiment trackers, ``--logger``: the step scalars (:func:`~lorafleet.metrics.records.step_scalars`, as
TensorBoard's tags) to a Weights & Biases run (:class:`WandbWriter`) or an MLflow run (:class:`MlflowWriter`).
Both packages are optional (the ``wandb`` and ``mlflow`` extras) and imported only when a writer is built.

What would make a writer fail as it starts, and can be found without training, is found by the launcher
before any process starts (:meth:`TrackerWriter.start_problem`: W&B online without an API key, an MLflow
tracking server that does not answer): one line, exit 2, rather than rank 0 failing after start-up.
"""

from __future__ import annotations

import configparser
import netrc
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from lorafleet.metrics.records import step_scalars
from lorafleet.metrics.sinks import ClosingWriter
from lorafleet.plans import StepReport
from lorafleet.rundir import TRACKER_IDS

CONNECT_S = 5.0
"""How long the launcher waits for a tracking server to accept a connection."""


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

    @classmethod
    def start_problem(cls, env: Mapping[str, str]) -> str | None:
        """Why the writer would fail to start under the environment ``env``, found without starting it (None:
        nothing found)."""
        return None


class WandbWriter(TrackerWriter):
    """A Weights & Biases run (:class:`TrackerWriter`): project ``lorafleet`` (or ``WANDB_PROJECT``), files under
    ``WANDB_DIR`` (default the run directory). ``WANDB_MODE`` (``offline``, ``disabled``) and W&B's other
    variables apply as usual. W&B's console capture is off unless ``WANDB_CONSOLE`` says otherwise: the step
    lines stay the process's own."""

    ID_FILE = TRACKER_IDS["wandb"]
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

    @classmethod
    def start_problem(cls, env: Mapping[str, str]) -> str | None:
        """Online (``WANDB_MODE``, else W&B's settings files, not ``offline``/``disabled``) without an API key:
        none in ``WANDB_API_KEY`` (or an identity token file) nor in the ``.netrc`` entry ``wandb login``
        writes for the server's host. Offline nothing is needed."""
        settings = configparser.ConfigParser()
        config_dir = env.get("WANDB_CONFIG_DIR") or str(Path.home() / ".config" / "wandb")
        settings.read([Path(config_dir) / "settings", Path(env.get("WANDB_DIR") or ".") / "wandb" / "settings"])
        mode = (env.get("WANDB_MODE") or settings.get("default", "mode", fallback="")).lower()
        if mode in ("offline", "dryrun", "disabled") or env.get("WANDB_DISABLED", "").lower() in ("1", "true"):
            return None
        if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
            return None
        base = env.get("WANDB_BASE_URL") or settings.get("default", "base_url", fallback="https://api.wandb.ai")
        host = urlsplit(base).hostname or base
        try:
            if netrc.netrc(env.get("NETRC") or str(Path.home() / ".netrc")).authenticators(host):
                return None
        except (OSError, netrc.NetrcParseError):
            pass
        return (
            f"online, and no API key for {host} (WANDB_API_KEY, or `wandb login`); to log without one, "
            "set WANDB_MODE=offline"
        )

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

    ID_FILE = TRACKER_IDS["mlflow"]
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

    @classmethod
    def start_problem(cls, env: Mapping[str, str]) -> str | None:
        """An HTTP(S) ``MLFLOW_TRACKING_URI`` whose server does not accept a connection within
        :data:`CONNECT_S` seconds (other stores are not checked). The message names the server without the
        URI's credentials."""
        uri = env.get("MLFLOW_TRACKING_URI") or ""
        parts = urlsplit(uri)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return f"MLFLOW_TRACKING_URI has a bad port: {parts.scheme}://{parts.hostname}"
        server = f"{parts.scheme}://{parts.hostname}:{port}"
        try:
            socket.create_connection((parts.hostname, port), timeout=CONNECT_S).close()
        except OSError as err:
            return f"the tracking server {server} (MLFLOW_TRACKING_URI) does not answer ({err.strerror or err})"
        return None

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
