"""MLflow recording of a run: params, per-round metrics, config, plots, final model.

Uses ``MlflowClient`` with an explicit run id (not the thread-local fluent API), because the Flower
engine reports rounds from its ServerApp thread.  The default store is ``sqlite:///mlflow.db`` in
the working directory; ``--tracking-uri`` or ``MLFLOW_TRACKING_URI`` override it.  A run that
crashes ends FAILED and one that is interrupted ends KILLED: never RUNNING.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from fedsim.engine.history import RoundRecord

MAX_PARAM_LEN = 500


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_tracking_uri(uri: str | None) -> str:
    """Normalise a user-given URI; a bare path to a ``.db`` file means an sqlite store."""
    if not uri:
        return default_tracking_uri()
    if "://" not in uri and uri.endswith(".db"):
        return f"sqlite:///{Path(uri).resolve()}"
    return uri


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _quiet_mlflow() -> None:
    """MLflow configures its loggers on import: import it first, then lower them."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import logging

    import mlflow  # noqa: F401

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


class MlflowRecorder:
    """One MLflow run; an observer of rounds."""

    def __init__(self, uri: str | None, experiment: str, run_name: str, tags: dict[str, str]) -> None:
        _quiet_mlflow()
        from mlflow import MlflowClient

        self.uri = resolve_tracking_uri(uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
        self.run_id: str = run.info.run_id
        self.experiment_id: str = exp_id
        self.artifact_dir = Path(tempfile.mkdtemp(prefix="fedsim-artifacts-"))

    @classmethod
    def reopen(cls, uri: str | None, run_id: str) -> "MlflowRecorder":
        """Continue an existing run (``--resume``): it is marked RUNNING again."""
        _quiet_mlflow()
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        from fedsim.errors import ConfigError

        self = cls.__new__(cls)
        self.uri = resolve_tracking_uri(uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            raise ConfigError(f"no MLflow run {run_id!r} in {self.uri}; check the id with `fedsim ui` "
                              f"or pass --tracking-uri") from None
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        self.artifact_dir = Path(tempfile.mkdtemp(prefix="fedsim-artifacts-"))
        self.client.update_run(run_id, status="RUNNING")
        return self

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import math
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if not math.isnan(float(v))]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def on_round(self, record: RoundRecord) -> None:
        self.log_metrics(record.as_metrics(), step=record.round)

    def finish(self, status: str) -> None:
        """``status`` is FINISHED, FAILED or KILLED."""
        self.client.set_terminated(self.run_id, status=status)

    def url(self) -> str:
        return f"experiment {self.experiment_id}, run {self.run_id}"
