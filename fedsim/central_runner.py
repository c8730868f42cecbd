"""The one runner of every centralised method (:data:`fedsim.registry.CENTRAL`): one MLflow run each.

See :mod:`fedsim.contracts.central` for what a method gets and returns.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from fedsim import config as C
from fedsim.contracts.central import CentralContext, CentralSummary
from fedsim.logs import quiet_third_party
from fedsim.registry import CENTRAL
from fedsim.run_lifecycle import tracked_run


def method_params(cfg: C.CentralConfig) -> Any:
    """The method's typed params (a one-line ConfigError for an unknown method or a bad key)."""
    return CENTRAL.params(cfg.method, cfg.params, "params")


def run_central(
    cfg: C.CentralConfig,
    *,
    tracking_uri: str | None = None,
    parent_run_id: str | None = None,
    run_name: str | None = None,
    show_progress: bool = False,
) -> CentralSummary:
    """Run one centralised experiment end to end (params checked before any MLflow run exists)."""
    import shutil
    import tempfile

    quiet_third_party(False)
    params = method_params(cfg)
    method: Callable[[CentralContext], dict[str, float]] = CENTRAL.get(cfg.method)
    check = getattr(method, "check", None)
    if check is not None:  # method-specific value checks, before anything is recorded
        check(params)
    recorder = None
    if cfg.tracking.enabled:
        from fedsim.tracking import MlflowRecorder, git_commit, resolve_tracking_uri

        tracking_uri = resolve_tracking_uri(tracking_uri, cfg.tracking.uri, check=True)  # flag > env > file
        tags = {"experiment": cfg.name, "method": cfg.method, "kind": "central", "seed": str(cfg.seed),
                "git_commit": git_commit()}
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        recorder = MlflowRecorder(tracking_uri, cfg.tracking.experiment,
                                  run_name=run_name or f"{cfg.name}-seed{cfg.seed}", tags=tags)
    artifact_dir = recorder.artifact_dir if recorder else Path(tempfile.mkdtemp(prefix="fedsim-central-"))
    ctx = CentralContext(cfg, params, recorder, artifact_dir, show_progress)
    start = time.perf_counter()
    # the recorder removes its artifact folder when it finishes; an untracked run's folder goes here
    cleanup = None if recorder else (lambda status: shutil.rmtree(artifact_dir, ignore_errors=True))
    with tracked_run(recorder, on_end=cleanup):
        if recorder is not None:
            recorder.log_params(C.flatten(C.to_container(cfg)))
            recorder.log_text(C.to_yaml(cfg), "config.yaml")
        headline = method(ctx)
        last = max((r.round for r in ctx.history.records), default=0)
        ctx.log_metrics(headline, step=last)
        wall = time.perf_counter() - start
        if recorder is not None:
            recorder.log_metrics({"run/wall_seconds": wall}, step=last)
    return CentralSummary({k: float(v) for k, v in headline.items()}, ctx.history, wall,
                          recorder.run_id if recorder else None, recorder.uri if recorder else None, ctx.tables)
