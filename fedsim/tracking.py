"""MLflow recording of a run: params, per-round metrics, config, plots, final model.

Uses ``MlflowClient`` with an explicit run id (not the thread-local fluent API), because the Flower
engine reports rounds from its ServerApp thread.  The default store is ``sqlite:///mlflow.db`` in
the working directory.  Which store a run records to is decided by :func:`resolve_tracking_uri`
alone: ``--tracking-uri`` > ``$MLFLOW_TRACKING_URI`` > the experiment file's ``tracking.uri`` > the
default, so a downloaded experiment file cannot quietly send a user's runs to another server.  A run
that crashes ends FAILED and one that is interrupted ends KILLED: never RUNNING.  A recorder's
temporary artifact folder is removed when its run ends, whatever the status.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from fedsim.contracts.history import RoundRecord
from fedsim.run_lifecycle import interrupts_deferred

MAX_PARAM_LEN = 500
_LOCAL_SCHEMES = ("", "sqlite", "file")
_noticed: set[str] = set()


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def normalise_tracking_uri(uri: str) -> str:
    """A bare path to a ``.db`` file means an sqlite store; other URIs are kept as they are."""
    if "://" not in uri and uri.endswith(".db"):
        return f"sqlite:///{Path(uri).expanduser().resolve()}"
    return uri


def is_local_uri(uri: str) -> bool:
    """Whether ``uri`` is a store on this machine (sqlite, a file store, a plain path)."""
    return urllib.parse.urlparse(uri).scheme.lower() in _LOCAL_SCHEMES


def resolve_tracking_uri(flag: str | None, config_uri: str | None = None, *, check: bool = False) -> str:
    """The store to record to: ``--tracking-uri`` > ``$MLFLOW_TRACKING_URI`` > the experiment
    file's ``tracking.uri`` (``config_uri``) > ``sqlite:///mlflow.db`` in the working directory.

    A one-line notice goes to stderr when the file's URI is overridden, and when a file's
    non-local URI (a server) is used, so a downloaded experiment file cannot silently redirect runs.
    ``check``: first fail fast, on one line (and without the notice), when that store is unwritable
    or unreachable (:func:`fedsim.store.check_tracking_uri`).
    """
    env = os.environ.get("MLFLOW_TRACKING_URI")
    chosen = flag or env or config_uri or default_tracking_uri()
    uri = normalise_tracking_uri(chosen)
    if check:
        check_tracking_uri(uri)
    if config_uri and uri != normalise_tracking_uri(config_uri):
        by = "--tracking-uri" if flag else "$MLFLOW_TRACKING_URI"
        _notice(f"the experiment's tracking.uri ({_redact(config_uri)}) is overridden by {by}; "
                f"recording to {_redact(chosen)}")
    elif config_uri and not flag and not env and not is_local_uri(config_uri):
        _notice(f"recording to {_redact(config_uri)}, the tracking server named by the experiment's "
                f"tracking.uri; set --tracking-uri or $MLFLOW_TRACKING_URI to record elsewhere")
    return uri


def _redact(uri: str) -> str:
    from fedsim.store import redact

    return redact(uri)


def _notice(message: str) -> None:
    """One line on stderr, once per process for the same message."""
    if message not in _noticed:
        _noticed.add(message)
        sys.stderr.write(f"fedsim: note: {message}\n")
        sys.stderr.flush()


def check_tracking_uri(uri: str) -> None:
    """Fail fast, on one line, when the store at ``uri`` is unwritable or unreachable."""
    from fedsim.store import check_tracking_uri as check

    check(uri)


def mlflow_client(uri: str) -> Any:
    """An ``MlflowClient`` on ``uri``, after preparing an sqlite store once (under its file lock)."""
    _quiet_mlflow()
    from mlflow import MlflowClient

    from fedsim.store import prepare_store

    prepare_store(uri)
    return InterruptSafeClient(MlflowClient(tracking_uri=uri))


class InterruptSafeClient:
    """An ``MlflowClient`` whose calls finish before a Ctrl-C or SIGTERM is raised.

    Each call runs under :func:`fedsim.run_lifecycle.interrupts_deferred`, so an interrupt never
    lands between a store write and its commit (which left the sqlite store locked and the run
    RUNNING); the interrupt is raised as soon as the call returns.
    """

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        if name == "_client":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def deferred(*args: Any, **kwargs: Any) -> Any:
            with interrupts_deferred():
                return attr(*args, **kwargs)

        return deferred


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


#: Run tag listing the params a run derived from its setup (client sizes ...) rather than took from
#: its configuration: they differ whenever the configuration does, so ``fedsim compare`` never
#: groups or labels runs by them.
DERIVED_PARAMS_TAG = "fedsim.derived_params"


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
        from fedsim.store import get_or_create_experiment

        self.uri = resolve_tracking_uri(uri)
        self.client = mlflow_client(self.uri)
        exp_id = get_or_create_experiment(self.client, experiment)
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
        self.run_id: str = run.info.run_id
        self.experiment_id: str = exp_id
        self._artifact_dir: Path | None = None

    @classmethod
    def reopen(cls, uri: str | None, run_id: str) -> "MlflowRecorder":
        """Continue an existing run (``--resume``): it is marked RUNNING again."""
        from mlflow.exceptions import MlflowException

        from fedsim.errors import ConfigError

        self = cls.__new__(cls)
        self.uri = resolve_tracking_uri(uri)
        self.client = mlflow_client(self.uri)
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            raise ConfigError(f"no MLflow run {run_id!r} in {self.uri}; check the id with `fedsim ui` "
                              f"or pass --tracking-uri") from None
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        self._artifact_dir = None
        self.client.update_run(run_id, status="RUNNING")
        return self

    @property
    def artifact_dir(self) -> Path:
        """A temporary folder for files about to be logged (made on first use, removed by ``finish``)."""
        if self._artifact_dir is None:
            self._artifact_dir = Path(tempfile.mkdtemp(prefix="fedsim-artifacts-"))
        return self._artifact_dir

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
        """``status`` is FINISHED, FAILED or KILLED; the temporary artifact folder goes in any case."""
        try:
            self.client.set_terminated(self.run_id, status=status)
        finally:
            if self._artifact_dir is not None:
                shutil.rmtree(self._artifact_dir, ignore_errors=True)
                self._artifact_dir = None

    def url(self) -> str:
        return f"experiment {self.experiment_id}, run {self.run_id}"
