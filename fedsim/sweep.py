"""Sweeps on Ray Tune: a grid of configurations × seeds as parallel trials under one MLflow parent run.

``fedsim sweep fedsvd --grid eps=1,3,6 strategy=fedsvd,ffa_lora --seeds 3`` or a sweep file
``experiments/sweeps/<name>.yaml`` (the claim-spec keys of :mod:`fedsim.reproduce` plus
``cpus_per_trial`` and ``max_concurrent``).  Every (configuration, seed) is one Ray Tune trial; a
trial runs the experiment with fedsim's in-process ``local`` engine (never Flower's Ray backend or
fedsim's Ray actor pool inside a Ray trial: nested Ray runtimes are a known cause of out-of-memory
failures) and logs one MLflow child run under the sweep's parent run.

* **Where it runs:** a local Ray runtime by default; an existing cluster with ``--address auto`` or
  ``RAY_ADDRESS``, unchanged (the cluster's workers need fedsim installed and the tracking store
  reachable, e.g. an MLflow server URI instead of a local sqlite file).
* **Resources:** each trial reserves ``cpus_per_trial`` CPUs (Ray schedules as many at once as fit,
  capped by ``max_concurrent``) and runs its clients with that many torch threads.
* **Failures:** a failed trial is reported (its child run ends FAILED) and the others go on.
* **Resume:** ``--resume PARENT_RUN_ID`` reads back the children that finished and runs the rest
  (the MLflow parent is the ledger, as for claim checks); a child left RUNNING by a killed sweep is
  marked KILLED and rerun.
* **Results:** the same table and plots as a claim check (:mod:`fedsim.reproduce`), logged to the
  parent; ``fedsim compare PARENT_RUN_ID`` prints and plots them again at any time.

Ray Tune's own MLflow callback is not used: fedsim's runs already log params, per-round metrics,
plots and the model, and a second logger would duplicate every run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim import config as C
from fedsim.errors import ConfigError
from fedsim.validation import check_interpolations, check_writable_dir
from fedsim.reproduce import (
    EPS_KEY,
    ClaimSpec,
    ConfigResult,
    _finished_children,
    children_by_name,
    _log_results,
    add_logged_run,
    build_config,
    label_of,
    settings,
)

SWEEPS_DIR = C.EXPERIMENTS_DIR / "sweeps"
MAX_CPUS_PER_TRIAL = 1024


@dataclass
class SweepSpec(ClaimSpec):
    """A claim spec plus the trials' resources."""

    cpus_per_trial: float = 1.0
    max_concurrent: int = 0  # 0: as many trials at once as the CPUs allow


@dataclass
class SweepProgress:
    """Trial counts for the progress line."""

    total: int
    done: int = 0
    running: int = 0
    failed: int = 0
    read_back: int = 0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        pending = self.total - self.done - self.running - self.failed
        return (f"trials: {self.done} done, {self.running} running, {self.failed} failed, {pending} pending"
                + (f" ({self.read_back} read back)" if self.read_back else ""))


def list_sweeps() -> list[str]:
    return sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))


def parse_grid(items: list[str], experiment: str) -> dict[str, list[Any]]:
    """``["eps=1,3,6", "strategy=fedsvd,ffa_lora"]`` → ``{"eps": [1, 3, 6], "strategy.name": [...]}``.

    Values are read as YAML scalars (``1`` an int, ``.inf`` a float, ``true`` a bool); a bare section
    name that has a ``name`` field (``strategy``, ``data``, ``model``) means its ``name``.
    """
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ConfigError(f"--grid {item!r}: write KEY=V1,V2,... (e.g. eps=1,3,6 or client.lr=0.01,0.05)")
        grid[_expand_key(key, experiment)] = [_scalar(v.strip()) for v in values.split(",")]
    if not grid:
        raise ConfigError("a sweep needs a grid: --grid KEY=V1,V2 [KEY=...] or a sweep file")
    return grid


def _scalar(text: str) -> Any:
    """One grid value as a YAML scalar; brackets, braces or bad YAML are a one-line error."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
        ok = False
    else:
        ok = value is None or isinstance(value, (str, int, float, bool))
    if not ok or not text:
        raise ConfigError(f"--grid value {text!r} is not a plain value; write KEY=V1,V2,... with plain "
                          f"comma-separated values and no brackets (e.g. client.lr=0.01,0.05)")
    check_interpolations(value, f"--grid value {text!r}")
    return value


def _expand_key(key: str, experiment: str) -> str:
    if key == EPS_KEY or "." in key:
        return key
    try:
        node = OmegaConf.structured(C.ExperimentConfig)
    except OmegaConfBaseException:  # pragma: no cover - the schema always builds
        return key
    section = node.get(key) if key in node else None
    if section is not None and OmegaConf.is_dict(section) and "name" in section:
        return f"{key}.name"
    return key


def load_sweep(name: str, *, grid: list[str] | None = None, seeds: int | None = None,
               overrides: list[str] | None = None, cpus_per_trial: float | None = None,
               max_concurrent: int | None = None) -> tuple[str, SweepSpec]:
    """A sweep file (``experiments/sweeps/NAME.yaml`` or a path) or an experiment plus ``--grid``."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else SWEEPS_DIR / f"{name}.yaml"
    data = C.read_yaml(path) if path.is_file() else None
    if isinstance(data, dict) and "experiment" in data:  # a sweep file
        try:
            spec: SweepSpec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SweepSpec), data))  # type: ignore[assignment]
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
        label = path.stem
        if grid:
            spec.grid = {**spec.grid, **parse_grid(grid, spec.experiment)}
    else:  # an experiment and a --grid
        if not grid:
            known = ", ".join(list_sweeps()) or "none"
            raise ConfigError(f"no sweep file named {name!r} (known: {known}); to sweep the experiment "
                              f"{name!r} give a grid: fedsim sweep {name} --grid KEY=V1,V2")
        C.experiment_path(name)  # a clear error for an unknown experiment
        spec = SweepSpec(experiment=name, grid=parse_grid(grid, name))
        label = Path(name).stem
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {seeds}")
        spec.seeds = list(range(seeds))
    spec.overrides = [*spec.overrides, *(overrides or [])]
    if cpus_per_trial is not None:
        spec.cpus_per_trial = cpus_per_trial
    if max_concurrent is not None:
        spec.max_concurrent = max_concurrent
    if not spec.grid:
        raise ConfigError(f"sweep {label!r}: the grid is empty; give --grid KEY=V1,V2")
    if not (math.isfinite(spec.cpus_per_trial) and 0 < spec.cpus_per_trial <= MAX_CPUS_PER_TRIAL):
        raise ConfigError(f"cpus_per_trial must be > 0 (a finite number, at most {MAX_CPUS_PER_TRIAL}), "
                          f"got {spec.cpus_per_trial}")
    if not 0 <= spec.max_concurrent <= 100_000:
        raise ConfigError(f"max_concurrent must be in [0, 100000], got {spec.max_concurrent}")
    if not 1 <= len(spec.seeds) <= 10_000:
        raise ConfigError(f"a sweep needs 1 to 10000 seeds, got {len(spec.seeds)}")
    if C.is_central(spec.experiment):
        raise ConfigError(f"{spec.experiment!r} is a centralised-track method; sweep it with "
                          f"`fedsim reproduce` (a claim spec) for now")
    return label, spec


def trial_config(spec: SweepSpec, setting: dict[str, Any], seed: int) -> C.ExperimentConfig:
    """One trial's config: the in-process engine, ``cpus_per_trial`` torch threads, absolute paths."""
    from fedsim.engine.runtime import RunSpec
    from fedsim.runner import preflight

    cfg = build_config(spec, setting, seed)
    cfg.engine.name = "local"
    cfg.engine.threads_per_client = max(1, int(spec.cpus_per_trial))
    cfg.engine.checkpoint_dir = str(Path(cfg.engine.checkpoint_dir).expanduser().resolve())
    if cfg.engine.checkpoint and cfg.tracking.enabled:
        check_writable_dir(cfg.engine.checkpoint_dir, "engine.checkpoint_dir")
    preflight(RunSpec.from_config(cfg))  # unknown components and bad params fail here, before Ray starts
    return cfg


def preflight_resources(spec: SweepSpec, address: str | None) -> None:
    """Before Ray or MLflow start: a local Ray cannot give a trial more CPUs than this machine has."""
    import sys

    if address or os.environ.get("RAY_ADDRESS") or ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        return  # a cluster's CPUs are known once connected (checked again in _run_trials)
    cpus = os.cpu_count() or 1
    if spec.cpus_per_trial > cpus:
        raise ConfigError(f"cpus_per_trial={spec.cpus_per_trial:g} exceeds the {cpus} CPUs of this machine; "
                          f"lower it (--cpus-per-trial) or join a cluster with --address")


def child_name(setting: dict[str, Any], seed: int) -> str:
    return f"{label_of(setting)} | seed {seed}"


def run_sweep(
    name: str,
    spec: SweepSpec,
    *,
    tracking_uri: str | None = None,
    address: str | None = None,
    resume_parent: str | None = None,
    on_progress: Callable[[SweepProgress], None] = lambda p: None,
    on_message: Callable[[str], None] = lambda msg: None,
) -> tuple[list[ConfigResult], str, SweepProgress]:
    """Run the grid × seeds on Ray Tune; returns the per-configuration results, the parent run id and
    the trial counts."""
    from fedsim.tracking import MlflowRecorder, git_commit, resolve_tracking_uri

    grid = settings(spec)
    trials = [(s, seed, trial_config(spec, s, seed)) for s in grid for seed in spec.seeds]  # validate all first
    tracking = trials[0][2].tracking
    if not tracking.enabled:
        raise ConfigError("a sweep records its trials as MLflow child runs; remove tracking.enabled=false")
    preflight_resources(spec, address)
    uri = resolve_tracking_uri(tracking_uri, tracking.uri, check=True)  # flag > env > file, checked before Ray
    params = {"claim": name, "base_experiment": spec.experiment, "seeds": len(spec.seeds),
              "grid": str(dict(spec.grid)), "overrides": " ".join(spec.overrides),
              "metric": spec.metric, "extra_metrics": str(list(spec.extra_metrics))}
    if resume_parent:
        parent = MlflowRecorder.reopen(uri, resume_parent)
        done = _finished_children(parent, params)
    else:
        parent = MlflowRecorder(uri, tracking.experiment, run_name=f"sweep-{name}",
                                tags={"experiment": f"sweep/{name}", "kind": "sweep", "git_commit": git_commit()})
        parent.log_params({**params, "cpus_per_trial": spec.cpus_per_trial, "max_concurrent": spec.max_concurrent})
        done = {}
    progress = SweepProgress(total=len(trials))
    pending = []
    for setting, seed, cfg in trials:
        previous = done.get(child_name(setting, seed))
        if previous is not None and previous.info.status == "FINISHED":
            progress.done += 1
            progress.read_back += 1
            continue
        if previous is not None and previous.info.status == "RUNNING":  # left behind by a killed sweep
            parent.client.set_terminated(previous.info.run_id, status="KILLED")
        pending.append((setting, seed, cfg))
    on_progress(progress)
    status = "FAILED"
    try:
        if pending:
            _run_trials(pending, uri, parent.run_id, spec, address, progress, on_progress, on_message)
        results = _read_back(parent, spec, grid)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if status == "FINISHED":
            _log_results(parent, name, spec, results)
        parent.finish(status)
    return results, parent.run_id, progress


def _run_trials(pending: list[tuple[dict[str, Any], int, C.ExperimentConfig]], uri: str, parent_id: str,
                spec: SweepSpec, address: str | None, progress: SweepProgress,
                on_progress: Callable[[SweepProgress], None], on_message: Callable[[str], None]) -> None:
    import ray
    from ray import tune

    started_here = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")  # trials keep the driver's working directory
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # no CSV/JSON/TensorBoard loggers
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"RAY_CHDIR_TO_TRIAL_DIR": "0"}} if address else None)
        started_here = True
    try:
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        if spec.cpus_per_trial > cpus:
            raise ConfigError(f"cpus_per_trial={spec.cpus_per_trial} exceeds the {cpus:g} CPUs Ray sees; "
                              f"lower it (--cpus-per-trial)")
        limit = max(1, int(cpus // spec.cpus_per_trial))
        concurrent = min(limit, spec.max_concurrent) if spec.max_concurrent else limit
        by_id = {f"t{i:04d}": (child_name(s, seed), cfg) for i, (s, seed, cfg) in enumerate(pending)}
        trainable = tune.with_resources(_make_trainable(uri, parent_id, spec, by_id), {"cpu": spec.cpus_per_trial})
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search(list(by_id))},
            tune_config=tune.TuneConfig(max_concurrent_trials=concurrent, reuse_actors=False),
            run_config=tune.RunConfig(
                name=f"fedsim-sweep-{parent_id}", storage_path=str(Path.cwd() / "fedsim-sweeps"), verbose=0,
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                callbacks=[_progress_callback(progress, by_id, on_progress, on_message)]),
        )
        with _quiet_tune():
            tuner.fit()
    finally:
        if started_here:
            ray.shutdown()


def _make_trainable(uri: str, parent_id: str, spec: SweepSpec,
                    by_id: dict[str, tuple[str, C.ExperimentConfig]]) -> Callable[[dict[str, Any]], dict[str, float]]:
    """The Ray Tune function trainable: run one trial's experiment as an MLflow child of ``parent_id``."""
    metric, extras = spec.metric, list(spec.extra_metrics)

    def trainable(config: dict[str, Any]) -> dict[str, float]:
        from fedsim.errors import FedsimError
        from fedsim.runner import run_experiment

        name, cfg = by_id[config["trial"]]
        try:
            summary = run_experiment(cfg, tracking_uri=uri, parent_run_id=parent_id, run_name=name)
        except FedsimError as exc:
            raise RuntimeError(f"{name}: {exc}") from None
        final = summary.history.final()
        return {k: float(final.get(k, math.nan)) for k in [metric, *extras]}

    return trainable


def _progress_callback(*args: Any) -> Any:
    """A Ray Tune callback keeping the trial counts (the class is defined here: ray imports lazily)."""
    from ray.tune import Callback

    class ProgressCallback(Callback):
        def __init__(self, progress: SweepProgress, by_id: dict[str, tuple[str, Any]],
                     on_progress: Callable[[SweepProgress], None], on_message: Callable[[str], None]) -> None:
            self.progress, self.by_id, self.on_progress, self.on_message = progress, by_id, on_progress, on_message

        def __getstate__(self) -> dict[str, Any]:  # Tune saves its state: the driver-side hooks stay out
            return {"progress": self.progress, "by_id": self.by_id}

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state, on_progress=lambda p: None, on_message=lambda m: None)

        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.progress.running += 1
            self.on_progress(self.progress)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.progress.running -= 1
            self.progress.done += 1
            self.on_progress(self.progress)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.progress.running -= 1
            self.progress.failed += 1
            name = self.by_id[trial.config["trial"]][0]
            self.progress.failures.append(name)
            self.on_message(f"trial failed: {_trial_error(trial) or name}")
            self.on_progress(self.progress)

    return ProgressCallback(*args)


def _trial_error(trial: Any) -> str:
    """A failed trial's own error message (Tune writes the trace next to the trial)."""
    try:
        path = trial.error_file
        text = Path(path).read_text() if path and Path(path).is_file() else str(trial.get_error() or "")
    except Exception:  # noqa: BLE001 - the report falls back to the trial's name
        return ""
    return _last_line(text)


def _last_line(error: Any) -> str:
    """The last line of a trial's error (its exception message), for a one-line report."""
    lines = [ln.strip() for ln in str(error or "").splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last.split(": ", 1)[1] if last.startswith(("RuntimeError: ", "TuneError: ")) else last


@contextlib.contextmanager
def _quiet_tune() -> Iterator[None]:
    """Tune logs each failed trial's traceback: the sweep reports it on one line instead."""
    loggers = [logging.getLogger(n) for n in ("ray", "ray.tune", "ray.train")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _read_back(parent: Any, spec: SweepSpec, grid: list[dict[str, Any]]) -> list[ConfigResult]:
    """Per-configuration results from the parent's children in MLflow (the sweep's ledger)."""
    children = children_by_name(parent)
    results = []
    for setting in grid:
        res = ConfigResult(label_of(setting), setting)
        for seed in spec.seeds:
            run = children.get(child_name(setting, seed))
            if run is None or run.info.status != "FINISHED":
                res.failed.append(f"seed {seed}: " + ("not run" if run is None else run.info.status.lower()))
                continue
            add_logged_run(res, parent, run, spec)
        results.append(res)
    return results
