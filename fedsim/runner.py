"""Run one experiment end to end: validate, start the engine, record to MLflow, summarise.

Everything that can be checked before a run starts is checked first (components, params,
resources), so a bad input never leaves a half-written run behind.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from fedsim import config as C
from fedsim.contracts.history import History, RoundObserver
from fedsim.engine.runtime import RunSpec, check_learner, get_learner
from fedsim.engine.server import ServerResult, build_strategy, required_results
from fedsim.errors import FedsimError, RunFailedError
from fedsim.logs import quiet_third_party
from fedsim.plots import plot_learning_curves
from fedsim.run_lifecycle import tracked_run
from fedsim.registry import DATASETS, ENGINES, MODELS, PARTITIONERS


@dataclass
class RunSummary:
    history: History
    final_arrays: dict[str, Any]
    wall_seconds: float
    run_id: str | None
    tracking_uri: str | None
    privacy_ledger: Any = None  # privacy.ledger.PrivacyLedger of a DP run: per-client rounds, steps, σ, ε


def preflight(spec: RunSpec) -> None:
    """Resolve every named component and validate its params before anything starts."""
    cfg = spec.cfg
    C.check_names(cfg)
    DATASETS.params(cfg.data.name, cfg.data.params, "data.params")
    PARTITIONERS.entry(cfg.data.partition.name)
    MODELS.params(cfg.model.name, cfg.model.params, "model.params")
    check_learner(cfg)
    build_strategy(spec)
    required_results(spec)
    bad = [p for p in cfg.engine.faults.fail_partitions if not 0 <= p < cfg.num_clients]
    if bad:
        raise C.ConfigError(f"engine.faults.fail_partitions: {bad} outside 0..{cfg.num_clients - 1}")
    engine = ENGINES.get(cfg.engine.name)
    if engine.preflight is not None:
        engine.preflight(spec)


def _engine(name: str) -> Callable[..., ServerResult]:
    """The run function of engine ``name`` (its module is imported now, not before)."""
    return ENGINES.get(name).run


def run_experiment(
    cfg: C.ExperimentConfig,
    *,
    observers: list[RoundObserver] | None = None,
    tracking_uri: str | None = None,
    parent_run_id: str | None = None,
    run_name: str | None = None,
    resume_run_id: str | None = None,
) -> RunSummary:
    """Run ``cfg``; every round goes to ``observers`` and, unless disabled, to MLflow.

    ``parent_run_id`` nests the MLflow run under a parent (sweeps and claim checks).
    ``resume_run_id`` continues that run from its last checkpoint, logging into the same MLflow run.
    """
    quiet_third_party(cfg.engine.verbose)
    _phase(observers, "checking the config")
    if cfg.tracking.enabled:  # flag > $MLFLOW_TRACKING_URI > the file's tracking.uri; checked before anything starts
        from fedsim.tracking import resolve_tracking_uri

        tracking_uri = resolve_tracking_uri(tracking_uri, cfg.tracking.uri, check=True)
    spec = RunSpec.from_config(cfg)
    preflight(spec)
    held, resume = _load_resume(cfg, resume_run_id) if resume_run_id else (None, None)
    try:  # the resumed run's lock is held from here: let it go if the run does not start
        sample_dp = cfg.privacy.enabled and cfg.privacy.level == "sample"
        _phase(observers, "loading data, calibrating DP noise" if sample_dp else "loading data")
        learner = get_learner(spec)
        # Build data now, so data errors surface before an MLflow run exists.
        learner.preflight()
        withheld = cfg.privacy.enabled and cfg.privacy.release == "strict"  # privacy/release.py
        setup = {} if withheld else learner.setup_summary()
        if cfg.privacy.enabled and not sample_dp:
            _phase(observers, "calibrating DP noise")
        ledger = _privacy_ledger(cfg, learner, setup)
        history = History()
        recorder = None
        if cfg.tracking.enabled:
            from fedsim.tracking import MlflowRecorder, git_commit

            _phase(observers, "opening the MLflow run")
            if resume_run_id:
                recorder = MlflowRecorder.reopen(tracking_uri, resume_run_id)
            else:
                tags = {"experiment": cfg.name, "strategy": cfg.strategy.name, "engine": cfg.engine.name,
                        "seed": str(cfg.seed), "git_commit": git_commit(), "learner": cfg.client.learner}
                if not learner.owns_environment:
                    tags["dataset"] = cfg.data.name
                if parent_run_id:
                    tags["mlflow.parentRunId"] = parent_run_id
                if setup:
                    from fedsim.tracking import DERIVED_PARAMS_TAG

                    tags[DERIVED_PARAMS_TAG] = ",".join(sorted(setup))
                recorder = MlflowRecorder(tracking_uri, cfg.tracking.experiment,
                                          run_name=run_name or default_run_name(cfg), tags=tags)
    except BaseException:
        if held is not None:
            held.release()
        raise
    checkpoint_dir = _checkpoint_dir(cfg, recorder.run_id if recorder else None, held)
    replayed: list[RoundObserver] = [*([ledger] if ledger else []), history, *(observers or [])]
    all_observers = [*replayed, *([recorder] if recorder is not None else [])]
    start = time.perf_counter()
    run_id = recorder.run_id if recorder else None
    settled = checkpoint_dir or held
    with tracked_run(recorder, on_end=lambda status: _settle_checkpoint(cfg, settled, status, run_id)):
        if recorder is not None and resume is None:
            _phase(observers, "recording the config to MLflow")
            params = C.flatten(C.to_container(cfg))
            if learner.owns_environment:  # its data and model live in client.params: cfg.data / cfg.model are unused
                params = {k: v for k, v in params.items() if not k.startswith(("data.", "model."))}
            recorder.log_params({**params, **setup})
            recorder.log_text(C.to_yaml(cfg), "config.yaml")
            for path in ([] if withheld else learner.setup_artifacts(recorder.artifact_dir)):
                recorder.log_artifact(path, "plots")
            if cfg.privacy.enabled:
                from privacy.release import statement

                recorder.log_text(statement(cfg), "privacy_release.md")
        if recorder is not None and checkpoint_dir is not None:
            recorder.set_tag("fedsim.checkpoint", str(checkpoint_dir.path))
        if resume is not None:
            for record in resume.records:  # the rounds before the checkpoint, for the ledger and the history
                for obs in replayed:
                    obs.on_round(record)
            if recorder is not None:
                _log_missing_rounds(recorder, resume.records)
                recorder.set_tag("fedsim.resumed_from_round", str(resume.round))
        server_kwargs = {"checkpoints": checkpoint_dir, "resume": resume} if checkpoint_dir or resume else {}
        _phase(observers, f"starting the {cfg.engine.name} engine")
        result = _engine(cfg.engine.name)(spec, all_observers, **server_kwargs)
        report, report_files = learner.final_report(history, recorder.artifact_dir if recorder else None)
        if report and history.records:
            history.records[-1].metrics.update(report)
        wall = time.perf_counter() - start
        if recorder is not None:
            if report:
                recorder.log_metrics(report, step=history.records[-1].round if history.records else cfg.rounds)
            for path in report_files:
                recorder.log_artifact(path, "plots")
            _log_outputs(recorder, cfg, history, result, wall)
            if ledger is not None:
                recorder.log_artifact(ledger.write_csv(recorder.artifact_dir / "privacy_ledger.csv"))
    return RunSummary(history, result.arrays, wall, recorder.run_id if recorder else None,
                      recorder.uri if recorder else None, ledger)


def default_run_name(cfg: C.ExperimentConfig, typed: list[str] | None = None, limit: int = 120) -> str:
    """``experiment-strategy-engine[-overrides]-seedN``: the MLflow run name that tells runs apart
    (``typed``: the overrides and flags the user gave, e.g. ``["client.lr=0.05", "eps=3"]``)."""
    extra = ",".join(t for t in typed or [] if not t.startswith(("seed=", "engine=")))
    if len(extra) > limit:
        extra = extra[:limit - 1] + "…"
    parts = [cfg.name, cfg.strategy.name, cfg.engine.name, *([extra] if extra else []), f"seed{cfg.seed}"]
    return "-".join(parts)


def _phase(observers: list[Any] | None, name: str) -> None:
    """Tell the observers that have an ``on_phase(name)`` (the progress display) what the run does now."""
    for obs in observers or []:
        on_phase = getattr(obs, "on_phase", None)
        if on_phase is not None:
            on_phase(name)


def _checkpoint_dir(cfg: C.ExperimentConfig, run_id: str | None, held: Any = None) -> Any:
    """Where this run checkpoints, a :class:`~fedsim.engine.checkpoint.CheckpointDir` (None: checkpoints
    off, untracked, or an engine that cannot); ``held`` is the resumed run's, already locked."""
    from fedsim.engine import checkpoint as ckpt

    if not cfg.engine.checkpoint or run_id is None or not ENGINES.get(cfg.engine.name).checkpointing:
        return None
    return held or ckpt.CheckpointDir(_checkpoint_path(cfg, run_id), run_id)


def _checkpoint_path(cfg: C.ExperimentConfig, run_id: str) -> Path:
    return Path(cfg.engine.checkpoint_dir).expanduser().resolve() / run_id


def _settle_checkpoint(cfg: C.ExperimentConfig, checkpoints: Any, status: str, run_id: str | None) -> None:
    """Remove a finished run's checkpoint (unless kept), tell how to resume an unfinished one (or remove
    its directory if it stopped before its first checkpoint), drop the lock, and remove the checkpoint
    root if the run left it empty."""
    if checkpoints is None:
        return
    directory = checkpoints.path
    if status == "FINISHED" and not cfg.engine.keep_checkpoint:
        shutil.rmtree(directory, ignore_errors=True)
    elif status != "FINISHED" and checkpoints.exists():
        import logging

        logging.getLogger("fedsim").warning("run %s stopped (%s); continue it with: fedsim run %s --resume %s",
                                            run_id, status, cfg.name, run_id)
    elif status != "FINISHED":  # stopped before its first checkpoint: nothing to resume, only a lock (if that)
        shutil.rmtree(directory, ignore_errors=True)
    checkpoints.release()
    with contextlib.suppress(OSError):  # only if empty: other runs' checkpoints stay
        directory.parent.rmdir()


def _log_missing_rounds(recorder: Any, records: list[Any]) -> None:
    """Log the checkpointed rounds' metrics that the MLflow run lacks (a kill came between the two).

    Each (metric, step) reaches the run exactly once across any number of kills and resumes.
    """
    client, run_id = recorder.client, recorder.run_id
    logged = {key: {m.step for m in client.get_metric_history(run_id, key)}
              for key in client.get_run(run_id).data.metrics}
    for record in records:
        missing = {k: v for k, v in record.as_metrics().items() if record.round not in logged.get(k, ())}
        if missing:
            recorder.log_metrics(missing, step=record.round)


def _load_resume(cfg: C.ExperimentConfig, run_id: str) -> tuple[Any, Any]:
    """The locked checkpoint directory of ``run_id`` and its checkpoint, checked to continue under ``cfg``.

    A run still alive elsewhere holds the lock: that is a one-line ConfigError, before anything starts.
    """
    from fedsim.engine import checkpoint as ckpt

    if not cfg.tracking.enabled:
        raise C.ConfigError("--resume continues an MLflow run, so it needs tracking; drop --no-tracking")
    if not ENGINES.get(cfg.engine.name).checkpointing:
        raise C.ConfigError(f"--resume works on the {' and '.join(ENGINES.checkpointing_names())} engines, not "
                            f"{cfg.engine.name!r}; add --engine local")
    held = ckpt.CheckpointDir(_checkpoint_path(cfg, run_id), run_id)
    if held.path.is_dir():  # no directory: nothing to lock, and load says there is no checkpoint
        held.lock()
    try:
        return held, _check_resumable(cfg, run_id, held.load())
    except BaseException:
        held.release()
        raise


def _check_resumable(cfg: C.ExperimentConfig, run_id: str, checkpoint: Any) -> Any:
    """``checkpoint`` if it may continue under ``cfg`` (same config but engine/tracking/rounds)."""
    from fedsim.engine.runtime import RunSpec as _Spec

    saved = _Spec(checkpoint.config_yaml).cfg
    if checkpoint.round > cfg.rounds:
        raise C.ConfigError(f"run {run_id} already completed round {checkpoint.round} but --rounds is {cfg.rounds}; "
                            f"resume with --rounds >= {checkpoint.round}")
    ignored = ("engine.", "tracking.", "rounds", "description")
    a, b = C.flatten(C.to_container(saved)), C.flatten(C.to_container(cfg))
    diff = sorted(k for k in set(a) | set(b) if not k.startswith(ignored) and a.get(k) != b.get(k))
    if diff:
        k = diff[0]
        raise C.ConfigError(f"--resume {run_id}: this config differs from the checkpointed one at {k} "
                            f"({b.get(k)!r} vs {a.get(k)!r}{f', and {len(diff) - 1} more' if len(diff) > 1 else ''}); "
                            f"resume with the run's own experiment and overrides")
    return checkpoint


def _privacy_ledger(cfg: C.ExperimentConfig, learner: Any, setup: dict[str, Any]) -> Any:
    """The server-side privacy ledger of a DP run (None without DP); adds the privacy params."""
    if not cfg.privacy.enabled:
        return None
    from privacy.ledger import PrivacyLedger

    if cfg.privacy.level == "client":
        from privacy.client_level import plan_client_level
        from fedsim.contracts.strategy import StrategyContext

        plan = plan_client_level(cfg, StrategyContext(cfg, cfg.num_clients).train_sample_size)
        setup.update({"privacy.noise_multiplier": plan.noise_multiplier, "privacy.target_epsilon": cfg.privacy.epsilon,
                      "privacy.delta": cfg.privacy.delta})
        charge = {pid: (1, plan.sample_rate, plan.noise_multiplier) for pid in range(cfg.num_clients)}
        return PrivacyLedger(cfg.num_clients, cfg.privacy.delta, cfg.privacy.accountant, charge)

    plans = {pid: learner.privacy_plan(pid) for pid in range(cfg.num_clients)}
    sigmas = [p.noise_multiplier for p in plans.values()]
    setup.update({"privacy.noise_multiplier": max(sigmas), "privacy.noise_multiplier_min": min(sigmas),
                  "privacy.target_epsilon": cfg.privacy.epsilon, "privacy.delta": cfg.privacy.delta})
    return PrivacyLedger(cfg.num_clients, cfg.privacy.delta, cfg.privacy.accountant)


def _log_outputs(recorder: Any, cfg: C.ExperimentConfig, history: History, result: ServerResult, wall: float) -> None:
    recorder.log_metrics({"run/wall_seconds": wall}, step=cfg.rounds)
    curve = plot_learning_curves(history, recorder.artifact_dir / "learning_curve.png",
                                 f"{cfg.name}: {cfg.strategy.name}, {cfg.num_clients} clients, seed {cfg.seed}")
    recorder.log_artifact(curve, "plots")
    if cfg.tracking.log_model:
        path = recorder.artifact_dir / "global_model.pt"  # removed with the folder when the run ends
        torch.save(result.arrays, path)
        recorder.log_artifact(path, "model")


__all__ = ["RunSummary", "run_experiment", "preflight", "FedsimError", "RunFailedError"]
