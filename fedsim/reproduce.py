"""Claim checks: run a grid of configurations × seeds as one MLflow parent run with nested children.

A claim spec lives in ``experiments/reproduce/<name>.yaml``::

    description: FedSVD vs FFA-LoRA vs FedAvg-LoRA under DP
    experiment: fedsvd                      # the base experiment
    overrides: [rounds=10]                  # applied to every run
    grid:                                   # every combination is one configuration
      strategy.name: [fedsvd, ffa_lora]
      eps: [1, 3, .inf]                     # special key: privacy target; .inf = no DP
      data.partition:                       # a mapping value sets several keys under its key
        - {name: dirichlet, alpha: 0.3}
        - {name: iid}
    exclude:                                # optional: drop the combinations that match an entry
      - {strategy.name: ffa_lora, eps: .inf}
    seeds: [0, 1, 2]
    metric: eval/accuracy
    moving_average: 10                      # also report the best k-round moving average
    extra_metrics: [eval/loss]              # more columns: each run's final value of these metrics

The result is a table of mean ± std over seeds of the final metric (and the best moving average)
per configuration, printed and logged to the parent run as ``results.csv`` / ``results.md``, with
plots: the metric per round (mean over seeds) per configuration and, when ``eps`` is in the grid,
final metric vs ε.

A spec may also declare the claim protocol (``claim:``, ``controls:``, ``tune:``, ``confidence:``,
``interval:``; see :mod:`fedsim.claim_protocol`): with ``tune:`` each method's grid first runs on
the tuning seeds (children tagged ``claim_stage=tune``) and the best value on the validation metric
is then run on every seed; the parent also gets a verdicts table (in ``results.md`` and
``verdicts.csv``, see :mod:`fedsim.claims`), the references, the tuning table and the floor and
ceiling as lines on the curves plot. :func:`plan_claim` lists the runs and a time estimate without
running or recording anything.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim import claim_protocol as P
from fedsim import config as C
from fedsim.contracts.history import History
from fedsim.errors import ConfigError, FedsimError
from fedsim.registry import LEARNERS

REPRODUCE_DIR = C.EXPERIMENTS_DIR / "reproduce"
EPS_KEY = "eps"


@dataclass
class ClaimSpec:
    experiment: str
    description: str = ""
    overrides: list[str] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    exclude: list[dict[str, Any]] = field(default_factory=list)  # grid combinations left out
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    metric: str = "eval/accuracy"
    moving_average: int = 0
    extra_metrics: list[str] = field(default_factory=list)  # more table columns (final values)
    # the claim protocol (fedsim.claim_protocol): what must beat what, controls, tuning, interval
    claim: list[P.Comparison] = field(default_factory=list)
    controls: P.Controls = field(default_factory=P.Controls)
    tune: Optional[P.TuneSpec] = None
    confidence: float = 0.95
    interval: str = "t"  # t | bootstrap
    minutes_per_run: Optional[float] = None  # per-run estimate for --plan

    @property
    def has_protocol(self) -> bool:
        return bool(self.claim or self.controls.positive)

    def tracked_metrics(self) -> list[str]:
        """Final values kept per seed: the extra columns and every claim/control metric."""
        comparisons = [*self.claim, *self.controls.positive]
        wanted = [*self.extra_metrics, *(m for c in comparisons for m in c.metrics(self.metric))]
        return [m for m in dict.fromkeys(wanted) if m != self.metric]


#: The per-round count of failed client calls every engine round logs.
CLIENTS_FAILED = "round/clients_failed"


@dataclass
class ConfigResult:
    label: str
    setting: dict[str, Any]
    finals: list[float] = field(default_factory=list)
    best_moving: list[float] = field(default_factory=list)
    curves: list[list[float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)  # extra metric -> one final value per seed
    client_failures: int = 0  # failed client calls summed over the finished runs' rounds (timeouts included)
    seeds: list[int] = field(default_factory=list)  # the seed of each finished run, in the order of finals
    tuned: dict[str, Any] = field(default_factory=dict)  # hyper-parameters chosen by the tuning stage
    role: str = ""  # "" (a grid configuration), "floor" or "ceiling" (a reference configuration)

    def add_extras(self, finals: dict[str, float]) -> None:
        """One seed's final values of the spec's extra metrics (NaN where a run did not log one)."""
        for key, value in finals.items():
            self.extras.setdefault(key, []).append(value)

    def add(self, curve: list[float], moving_average: int, seed: int | None = None) -> None:
        """One seed's metric curve (round 0 first)."""
        self.seeds.append(len(self.seeds) if seed is None else seed)
        self.curves.append(curve)
        self.finals.append(curve[-1] if curve else float("nan"))
        self.best_moving.append(best_moving_average(curve[1:], moving_average))

    @staticmethod
    def mean_std(values: list[float]) -> tuple[float, float]:
        if not values:
            return float("nan"), float("nan")
        arr = np.asarray(values, dtype=float)
        return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def list_claims() -> list[str]:
    return sorted(p.stem for p in REPRODUCE_DIR.glob("*.yaml"))


#: ``--scale`` values: the spec file each selects for a claim NAME (quick: NAME_quick.yaml, ...).
SCALES = {"quick": "_quick", "default": "", "paper": "_paper"}


def scales_of(name: str) -> list[str]:
    """The scales whose spec file exists for claim ``name``."""
    return [s for s, suffix in SCALES.items() if (REPRODUCE_DIR / f"{name}{suffix}.yaml").is_file()]


def claim_name(name: str, scale: str = "default") -> str:
    """The spec name for ``name`` at ``scale`` (``fedphoenix`` + paper -> ``fedphoenix_paper``); ConfigError if absent."""
    if scale not in SCALES:
        raise ConfigError(f"--scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if scale == "default":
        return name
    if name.endswith((".yaml", ".yml")):
        raise ConfigError(f"--scale {scale} selects a claim by name (experiments/reproduce/NAME_{scale}.yaml), "
                          f"not a path: {name}")
    resolved = f"{name}{SCALES[scale]}"
    if not (REPRODUCE_DIR / f"{resolved}.yaml").is_file():
        found = scales_of(name)
        raise ConfigError(f"no {scale!r} scale for claim check {name!r} (no {REPRODUCE_DIR / resolved}.yaml); "
                          f"scales of {name}: {', '.join(found) or 'none (unknown claim)'}")
    return resolved


def load_claim(name: str, seeds: int | None = None, extra_overrides: list[str] | None = None,
               scale: str = "default") -> ClaimSpec:
    """The claim spec ``name`` (a name in experiments/reproduce/ or a YAML path) at ``scale``.

    ``extra_overrides`` (the command line's) go after the spec's own, so they win.
    """
    name = claim_name(name, scale)
    path = Path(name) if name.endswith((".yaml", ".yml")) else REPRODUCE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no claim check named {name!r}; known: {', '.join(list_claims()) or 'none'}")
    try:
        raw = P.normalise_raw(C.read_yaml(path))
        spec: ClaimSpec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClaimSpec), raw))  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {seeds}")
        spec.seeds = list(range(seeds))
    spec.overrides = [*spec.overrides, *(extra_overrides or [])]
    if not spec.grid:
        raise ConfigError(f"{path}: grid is empty; list at least one key with values")
    _check_exclude(spec, str(path))
    P.validate_protocol(spec, settings(spec), str(path))
    return spec


def settings(spec: ClaimSpec) -> list[dict[str, Any]]:
    """The grid's combinations, less those matching an ``exclude`` entry (every key of the entry equal)."""
    excluded = getattr(spec, "exclude", None) or []
    return [c for c in _combinations(spec) if not any(P.matches(c, entry) for entry in excluded)]


def _combinations(spec: Any) -> list[dict[str, Any]]:
    """Every combination of the grid's values (its cross product)."""
    keys = list(spec.grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(spec.grid[k] for k in keys))]


def _check_exclude(spec: ClaimSpec, path: str) -> None:
    """One-line errors for an ``exclude`` entry that names no grid key or matches no combination."""
    keys, combos = list(spec.grid), _combinations(spec)
    for i, entry in enumerate(spec.exclude):
        unknown = [k for k in entry if k not in spec.grid]
        if not entry or unknown:
            raise ConfigError(f"{path}: exclude {i + 1} names {', '.join(unknown) or 'no key'}, not a grid key "
                              f"({', '.join(keys)})")
        if not any(P.matches(c, entry) for c in combos):
            raise ConfigError(f"{path}: exclude {i + 1} ({entry}) matches no grid combination; check its values")
    if not settings(spec):
        raise ConfigError(f"{path}: exclude leaves no grid combination to run")


def label_of(setting: dict[str, Any]) -> str:
    def fmt(k: str, v: Any) -> str:
        parts = k.split(".")
        short = "ε" if k == EPS_KEY else (parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1])
        if isinstance(v, dict):
            rest = ",".join(f"{a}={b}" for a, b in C.flatten(v).items() if a != "name")
            return f"{short}={v.get('name', '')}" + (f"({rest})" if rest else "")
        if k == EPS_KEY and (v is None or (isinstance(v, float) and math.isinf(v))):
            return "ε=∞"
        return f"{short}={v}"

    return ", ".join(fmt(k, v) for k, v in setting.items())


def build_config(spec: ClaimSpec, setting: dict[str, Any], seed: int, extra: list[str] | None = None) -> Any:
    """The config of one (setting, seed): an ExperimentConfig, or a CentralConfig for the centralised track.

    ``extra`` overrides go last (a tuned hyper-parameter, a reference configuration's overrides).
    """
    overrides = list(spec.overrides)
    eps = setting.get(EPS_KEY, "absent")
    for key, value in setting.items():
        if isinstance(value, dict):
            overrides += [f"{key}.{k}={v}" for k, v in C.flatten(value).items()]
        elif key != EPS_KEY:
            overrides.append(f"{key}={_dotlist_value(value)}")
    overrides += list(extra or [])
    if C.is_central(spec.experiment):
        if eps != "absent":
            raise ConfigError(f"claim grid key 'eps' applies to federated experiments, not {spec.experiment!r}")
        cfg_central = C.load_central_config(spec.experiment, overrides, seed)
        from fedsim.central_runner import method_params

        method_params(cfg_central)
        return cfg_central
    cfg = C.load_config(spec.experiment, overrides, {"seed": seed})
    if eps != "absent":
        if eps is None or (isinstance(eps, float) and math.isinf(eps)):
            cfg.privacy.enabled = False
        else:
            cfg.privacy.enabled, cfg.privacy.epsilon, cfg.privacy.noise_multiplier = True, float(eps), None
    C.validate(cfg)
    return cfg


def _dotlist_value(value: Any) -> str:
    """A grid value as OmegaConf dotlist text (lists keep their brackets)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_dotlist_value(v) for v in value) + "]"
    return str(value)


def _default_runner(cfg: Any) -> Callable[..., Any]:
    if isinstance(cfg, C.CentralConfig):
        from fedsim.central_runner import run_central

        return run_central
    from fedsim.runner import run_experiment

    return run_experiment


def best_moving_average(values: list[float], k: int) -> float:
    if k <= 1 or len(values) < k:
        return max(values) if values else float("nan")
    kernel = np.ones(k) / k
    return float(np.convolve(np.asarray(values), kernel, mode="valid").max())


@dataclass
class Job:
    """One child run of a claim check."""

    stage: str  # tune | final | floor | ceiling
    name: str  # the child's MLflow run name (the key resume looks it up by)
    setting: dict[str, Any]
    seed: int
    extra: list[str] = field(default_factory=list)  # overrides after the setting's
    method: str = ""  # tuning: the method this candidate belongs to
    candidate: dict[str, Any] = field(default_factory=dict)  # tuning: the hyper-parameters tried


@dataclass
class Outcome:
    """What a finished child contributes: its metric curve and the final values of tracked metrics."""

    curve: list[float]
    finals: dict[str, float]
    client_failures: int


def _overrides_of(candidate: dict[str, Any]) -> list[str]:
    return [f"{k}={_dotlist_value(v)}" for k, v in candidate.items()]


def tuning_jobs(spec: ClaimSpec, grid: list[dict[str, Any]]) -> list[Job]:
    """Every method's candidates × its configurations (those matching ``tune.at``) × the tuning seeds."""
    tune = spec.tune
    if tune is None:
        return []
    seeds = tune.seeds if tune.seeds is not None else spec.seeds[:1]
    jobs = []
    for setting in grid:
        if tune.at and not P.matches(setting, tune.at):
            continue
        method = P.method_of(setting, tune.by)
        for cand in P.tune_candidates(tune, method):
            for seed in seeds:
                jobs.append(Job("tune", f"tune | {label_of(setting)} | {P.candidate_text(cand)} | seed {seed}",
                                setting, seed, _overrides_of(cand), method, cand))
    return jobs


def final_jobs(spec: ClaimSpec, grid: list[dict[str, Any]], chosen: dict[str, dict[str, Any]]) -> list[Job]:
    """Every configuration × seed with its method's chosen values, then the reference configurations."""
    jobs = []
    for setting in grid:
        cand = chosen.get(P.method_of(setting, spec.tune.by), {}) if spec.tune else {}
        jobs += [Job("final", f"{label_of(setting)} | seed {seed}", setting, seed, _overrides_of(cand))
                 for seed in spec.seeds]
    for role in ("floor", "ceiling"):
        ref = getattr(spec.controls, role)
        if ref is not None and ref.overrides:
            jobs += [Job(role, f"{role} | seed {seed}", {}, seed, list(ref.overrides)) for seed in spec.seeds]
    return jobs


def _reference_label(spec: ClaimSpec, role: str) -> str:
    return f"{role}: {' '.join(getattr(spec.controls, role).overrides)}"


def _check_tuning_configs(spec: ClaimSpec, cfgs: list[Any]) -> None:
    for cfg in cfgs:
        if (isinstance(cfg, C.ExperimentConfig) and spec.tune is not None and cfg.evaluation.validation_fraction <= 0
                and getattr(LEARNERS.get(cfg.client.learner), "validation_split", False)):
            raise ConfigError(f"tune selects on {spec.tune.metric}, which the {cfg.client.learner} learner logs only "
                              "with a validation split: add evaluation.validation_fraction=0.1 (say) to the overrides")


def preflight_data(cfg: Any) -> None:
    """Build the first run's components and data before the parent run exists.

    A setting error that every child would hit (a missing dataset directory, a model path that is not
    a model) is then one :class:`ConfigError` before anything is recorded, instead of a parent whose
    every child failed.  Centralised methods check their params in :func:`build_config` already.
    """
    if not isinstance(cfg, C.ExperimentConfig):
        return
    from fedsim.engine.runtime import RunSpec, get_learner
    from fedsim.runner import preflight

    spec = RunSpec.from_config(cfg)
    preflight(spec)
    learner = get_learner(spec)
    learner.preflight()
    learner.setup_summary()  # builds the data, as run_experiment does before its MLflow run exists


def run_claim(
    name: str,
    spec: ClaimSpec,
    *,
    tracking_uri: str | None = None,
    on_progress: Callable[[str], None] = lambda msg: None,
    run_one: Callable[..., Any] | None = None,
    resume_parent: str | None = None,
) -> tuple[list[ConfigResult], str | None]:
    """Run the tuning stage (if any), then every (setting, seed); a failing run is reported, the others go on.

    ``resume_parent`` continues an interrupted claim check: children that finished are read back
    from MLflow, a child with a checkpoint is resumed, the others are run.
    """
    from fedsim.tracking import MlflowRecorder, git_commit, resolve_tracking_uri

    grid = settings(spec)
    tune_list = tuning_jobs(spec, grid)
    tune_cfgs = [build_config(spec, j.setting, j.seed, j.extra) for j in tune_list]  # validate all first
    _check_tuning_configs(spec, tune_cfgs)
    base_jobs = final_jobs(spec, grid, {})
    base_cfgs = [build_config(spec, j.setting, j.seed, j.extra) for j in base_jobs]
    if run_one is None:
        run_one = _default_runner(base_cfgs[0])
        preflight_data(base_cfgs[0])  # e.g. a missing data.params.root: one line now, not one failed run per child
    tracking = base_cfgs[0].tracking
    if tracking.enabled:  # one store for the parent and every child, checked before anything starts
        tracking_uri = resolve_tracking_uri(tracking_uri, tracking.uri, check=True)
    parent = None
    params = {"claim": name, "base_experiment": spec.experiment, "seeds": len(spec.seeds),
              "grid": str(dict(spec.grid)), "overrides": " ".join(spec.overrides),
              "metric": spec.metric, "extra_metrics": str(list(spec.extra_metrics))}
    if spec.tune is not None:
        params["tune"] = str(spec.tune)
    if spec.has_protocol:
        params["interval"] = f"{spec.confidence} {spec.interval}"
    done: dict[str, Any] = {}
    if resume_parent:
        if not tracking.enabled:
            raise ConfigError("--resume continues an MLflow parent run, so it needs tracking")
        parent = MlflowRecorder.reopen(tracking_uri, resume_parent)
        done = _finished_children(parent, params, spec.description)
    elif tracking.enabled:
        parent = MlflowRecorder(tracking_uri, tracking.experiment, run_name=f"reproduce-{Path(name).stem}",
                                tags={"experiment": f"reproduce/{name}", "kind": "claim-check",
                                      "git_commit": git_commit(),
                                      # the spec's description as the run's MLflow description, kept
                                      # with the results (docs/claims.md shows it beside them)
                                      "mlflow.note.content": spec.description})
        parent.log_params(params)
    total = len(tune_list) + len(base_jobs)
    reused = {"count": 0}  # final runs that a tuning run stands in for (known once tuning chose)
    counter = itertools.count(1)
    live_seconds: list[float] = []

    def execute(job: Job, cfg: Any, metrics: list[str]) -> Outcome | None:
        i = next(counter)
        where = f"[{i}/{total - reused['count']}] {job.name.rsplit(' | seed ', 1)[0]}, seed {job.seed}"
        previous = done.get(job.name)
        if previous is not None and previous.info.status == "FINISHED":
            on_progress(f"{where}: finished before, read back")
            return Outcome(_logged_curve(parent, previous.info.run_id, spec.metric),
                           {k: float(previous.data.metrics.get(k, math.nan)) for k in metrics},
                           int(sum(_logged_curve(parent, previous.info.run_id, CLIENTS_FAILED))))
        on_progress(where)
        kwargs: dict[str, Any] = {}
        if previous is not None and isinstance(cfg, C.ExperimentConfig) and _has_checkpoint(cfg, previous.info.run_id):
            kwargs["resume_run_id"] = previous.info.run_id
            on_progress(f"    resuming run {previous.info.run_id} from its checkpoint")
        started = time.perf_counter()
        try:
            summary = run_one(cfg, tracking_uri=tracking_uri, parent_run_id=parent.run_id if parent else None,
                              run_name=job.name, **kwargs)
        except FedsimError as exc:
            on_progress(f"    failed: {exc}")
            raise _RunFailed(str(exc)) from None
        live_seconds.append(time.perf_counter() - started)
        run_id = getattr(summary, "run_id", None)
        if parent is not None and run_id:
            parent.client.set_tag(run_id, "claim_stage", job.stage)
            if job.candidate:
                parent.client.set_tag(run_id, "claim_candidate", P.candidate_text(job.candidate))
        return Outcome([v for _, v in _series(summary.history, spec.metric)],
                       {k: _final_value(summary.history, k) for k in metrics},
                       int(sum(v for _, v in _series(summary.history, CLIENTS_FAILED))))

    results = {label_of(s): ConfigResult(label_of(s), s) for s in grid}
    for role in ("floor", "ceiling"):
        ref = getattr(spec.controls, role)
        if ref is not None and ref.overrides:
            results[role] = ConfigResult(_reference_label(spec, role), {}, role=role)
    tuning: list[dict[str, Any]] = []
    status = "FAILED"
    try:
        tuned_outcomes: dict[tuple[Any, ...], Outcome | None] = {}
        chosen = _run_tuning(spec, tune_list, tune_cfgs, execute, tuning, on_progress, tuned_outcomes)
        jobs = final_jobs(spec, grid, chosen)
        reused["count"] = sum(1 for j in jobs if _job_key(j) in tuned_outcomes)
        for job in jobs:
            res = results[job.stage if job.stage in ("floor", "ceiling") else label_of(job.setting)]
            if spec.tune is not None and job.stage == "final":
                res.tuned = chosen.get(P.method_of(job.setting, spec.tune.by), {})
            key = _job_key(job)
            if key in tuned_outcomes:  # the same configuration and seed already ran as a tuning candidate
                out = tuned_outcomes[key]
                if out is None:
                    res.failed.append(f"seed {job.seed}: its tuning run (the same configuration) failed")
                    continue
                on_progress(f"{job.name}: the tuning run of these values and seed, reused")
            else:
                cfg = build_config(spec, job.setting, job.seed, job.extra)
                try:
                    out = execute(job, cfg, spec.tracked_metrics())
                except _RunFailed as exc:
                    res.failed.append(f"seed {job.seed}: {exc}")
                    continue
            res.add(out.curve, spec.moving_average, job.seed)
            res.add_extras(out.finals)
            res.client_failures += out.client_failures
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if parent is not None:
            if status == "FINISHED":
                if live_seconds:
                    parent.log_metrics({SECONDS_PER_RUN: float(np.mean(live_seconds))}, step=0)
                _log_results(parent, name, spec, list(results.values()), tuning)
            parent.finish(status)
    return list(results.values()), parent.run_id if parent else None


#: Parent metric: mean wall seconds of the children this claim check ran (``--plan`` reads it back).
SECONDS_PER_RUN = "seconds_per_run"


class _RunFailed(Exception):
    """A child run failed (a FedsimError): reported, and the claim check goes on."""


def _job_key(job: Job) -> tuple[Any, ...]:
    """What makes two jobs the same run: the configuration, the seed and the overrides after it."""
    return (label_of(job.setting), job.seed, tuple(job.extra))


def _run_tuning(spec: ClaimSpec, jobs: list[Job], cfgs: list[Any], execute: Callable[..., Outcome | None],
                table: list[dict[str, Any]], on_progress: Callable[[str], None],
                outcomes: dict[tuple[Any, ...], Outcome | None] | None = None) -> dict[str, dict[str, Any]]:
    """Run every tuning job; per method, the candidate with the best mean final validation metric.

    ``table`` receives one row per (method, candidate): the mean, the runs it rests on, and whether
    it was chosen. Ties go to the candidate listed first. ``outcomes`` receives every tuning run's
    outcome (None: it failed) by :func:`_job_key`, with the final values the final stage tracks, so
    a final run of the chosen values on a tuning seed is that same run, not a second copy of it.
    """
    if spec.tune is None:
        return {}
    tune = spec.tune
    scores: dict[tuple[str, str], list[float]] = {}
    candidates: dict[str, list[dict[str, Any]]] = {}
    for job, cfg in zip(jobs, cfgs):
        key = (job.method, P.candidate_text(job.candidate))
        scores.setdefault(key, [])
        if job.candidate not in candidates.setdefault(job.method, []):
            candidates[job.method].append(job.candidate)
        try:
            out = execute(job, cfg, list(dict.fromkeys([tune.metric, *spec.tracked_metrics()])))
        except _RunFailed:
            if outcomes is not None:
                outcomes[_job_key(job)] = None
            continue
        if outcomes is not None:
            outcomes[_job_key(job)] = out
        scores[key].append(out.finals[tune.metric])
    chosen: dict[str, dict[str, Any]] = {}
    for method, cands in candidates.items():
        ran = [v for c in cands for v in scores[(method, P.candidate_text(c))]]
        if ran and all(math.isnan(v) for v in ran):
            raise ConfigError(f"tuning: no run of {method} logged {tune.metric}; does the learner log it "
                              "(evaluation.validation_fraction > 0 for the supervised learner)?")
        means = {}
        for c in cands:
            values = [v for v in scores[(method, P.candidate_text(c))] if not math.isnan(v)]
            means[P.candidate_text(c)] = float(np.mean(values)) if values else math.nan
        scored = [c for c in cands if not math.isnan(means[P.candidate_text(c)])]
        if scored:
            sign = 1.0 if tune.higher_is_better else -1.0
            chosen[method] = max(scored, key=lambda c: sign * means[P.candidate_text(c)])
            on_progress(f"tuning {method}: {P.candidate_text(chosen[method])} "
                        f"({tune.metric} {means[P.candidate_text(chosen[method])]:.4f})")
        else:
            on_progress(f"tuning {method}: every run failed; the final runs use the base values")
        for c in cands:
            text = P.candidate_text(c)
            table.append({"method": method, "values": text, "mean": means[text],
                          "runs": len([v for v in scores[(method, text)] if not math.isnan(v)]),
                          "chosen": chosen.get(method) == c})
    return chosen


#: Parent tag: how its seeds were raised after a first result (``--resume`` with more seeds), e.g. "5 -> 12".
SEEDS_RAISED_TAG = "fedsim.seeds_raised"


def _finished_children(parent: Any, params: dict[str, Any], description: str = "") -> dict[str, Any]:
    """The parent's children by run name (the latest per name), after checking the spec matches.

    More seeds than the parent ran is a raise of a finished check (its runs are read back, the new
    seeds run): allowed, and recorded on the parent (:data:`SEEDS_RAISED_TAG`, shown in results.md)
    so the post-hoc raise is disclosed; the parent's description becomes the spec's current one.  A
    later resume with fewer seeds than the last raise (one cut short) is recorded too.
    """
    run = parent.client.get_run(parent.run_id)
    logged = run.data.params
    for key in ("claim", "grid", "overrides", "seeds", "tune"):
        if key in logged and logged[key] != str(params.get(key, ""))[:500]:
            if key == "seeds" and int(params["seeds"]) > int(logged["seeds"]):
                continue
            raise ConfigError(f"--resume {parent.run_id}: that claim check ran with {key}={logged[key]!r}, "
                              f"not {str(params[key])!r}; resume it with the same claim and overrides "
                              "(more seeds are allowed: a recorded raise)")
    raised = run.data.tags.get(SEEDS_RAISED_TAG)  # "5 -> 12", or None
    ran = int(raised.rsplit("-> ", 1)[-1]) if raised else int(logged.get("seeds", params["seeds"]))
    if int(params["seeds"]) > ran:
        parent.set_tag(SEEDS_RAISED_TAG, f"{raised or ran} -> {params['seeds']}")
        if description:
            parent.set_tag("mlflow.note.content", description)
    elif raised and int(params["seeds"]) < ran:  # a raise cut short (e.g. for time): "5 -> 14 -> 10"
        parent.set_tag(SEEDS_RAISED_TAG, f"{raised} -> {params['seeds']}")
    return children_by_name(parent)


def seeds_raised_note(parent: Any) -> str:
    """The results.md line that discloses a post-hoc seed raise ("" when there was none)."""
    raised = parent.client.get_run(parent.run_id).data.tags.get(SEEDS_RAISED_TAG)
    return (f"Seeds raised after a first result (post hoc, `--resume` with more seeds): {raised}. "
            "The earlier seeds' runs are read back, not rerun.") if raised else ""


def children_by_name(parent: Any) -> dict[str, Any]:
    """A parent run's children by run name: the finished one where a name ran twice, else the latest."""
    runs = parent.client.search_runs([parent.experiment_id],
                                     filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'",
                                     order_by=["attributes.start_time ASC"], max_results=10000)
    children: dict[str, Any] = {}
    for run in runs:
        name = run.info.run_name
        if name not in children or children[name].info.status != "FINISHED":
            children[name] = run
    return children


def add_logged_run(res: ConfigResult, parent: Any, run: Any, spec: ClaimSpec) -> None:
    """Add one finished child run, read back from MLflow, to its configuration's results."""
    res.add(_logged_curve(parent, run.info.run_id, spec.metric), spec.moving_average)
    res.add_extras({k: float(run.data.metrics.get(k, math.nan)) for k in spec.extra_metrics})
    res.client_failures += int(sum(_logged_curve(parent, run.info.run_id, CLIENTS_FAILED)))


def _logged_curve(parent: Any, run_id: str, metric: str) -> list[float]:
    return [m.value for m in sorted(parent.client.get_metric_history(run_id, metric), key=lambda m: m.step)]


def _has_checkpoint(cfg: C.ExperimentConfig, run_id: str) -> bool:
    from fedsim.engine import checkpoint as ckpt

    return ckpt.exists(Path(cfg.engine.checkpoint_dir).expanduser().resolve() / run_id)


def _metric_name(label: str) -> str:
    """A configuration label as an MLflow metric name (alphanumerics and ``_-. :/`` only), readable:
    ``ε=3, partition=dirichlet(alpha=0.3)`` becomes ``eps:3 partition:dirichlet alpha:0.3``."""
    import re

    text = label.replace("ε", "eps").replace("∞", "inf").replace("=", ":")
    text = re.sub(r"[(),]+", " ", text)
    text = re.sub(r"[^A-Za-z0-9_\-. :/]", "_", text)
    return " ".join(text.split())


def _series(history: History, metric: str) -> list[tuple[int, float]]:
    return history.series(metric)


def _final_value(history: History, metric: str) -> float:
    """The metric's value in the last round that logged it (NaN if none did)."""
    series = history.series(metric)
    return float(series[-1][1]) if series else float("nan")


def results_table_rows(spec: ClaimSpec, results: list[ConfigResult]) -> list[dict[str, str]]:
    rows = []
    for r in results:
        m, s = r.mean_std(r.finals)
        row = {"configuration": r.label, f"final {spec.metric}": "–" if math.isnan(m) else f"{m:.4f} ± {s:.4f}",
               "runs": str(len(r.finals))}
        if spec.moving_average:
            bm, bs = r.mean_std(r.best_moving)
            row[f"best {spec.moving_average}-round mean"] = f"{bm:.4f} ± {bs:.4f}"
        for key in spec.extra_metrics:
            em, es = r.mean_std([v for v in r.extras.get(key, []) if not math.isnan(v)])  # NaN: not logged
            row[key] = "–" if math.isnan(em) else f"{em:.4f} ± {es:.4f}"
        if getattr(spec, "tune", None) is not None and not r.role:
            row["tuned"] = P.candidate_text(r.tuned) or "–"
        if r.failed:
            row["failed"] = str(len(r.failed))
        if r.client_failures:  # a run that lost clients (e.g. to a timeout) is not a clean data point
            row["client failures"] = str(r.client_failures)
        rows.append(row)
    return rows


def verdicts_or_error(spec: ClaimSpec, results: list[ConfigResult]) -> tuple[list[P.VerdictRow], str | None]:
    """The verdict rows, or why they cannot be computed (e.g. a failed seed left a claim unpaired)."""
    if not spec.has_protocol:
        return [], None
    try:
        return P.verdict_rows(spec, results), None
    except ConfigError as exc:
        return [], str(exc)


def _md_table(rows: list[dict[str, Any]]) -> list[str]:
    cols = list(dict.fromkeys(k for row in rows for k in row))
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(str(row.get(c, "")).replace("|", "\\|") for c in cols) + " |" for row in rows)]


def protocol_markdown(spec: ClaimSpec, results: list[ConfigResult], tuning: list[dict[str, Any]]) -> list[str]:
    """The sections results.md gains with a protocol: verdicts, references, tuning."""
    md: list[str] = []
    rows, error = verdicts_or_error(spec, results)
    if spec.has_protocol:
        how = "paired t" if spec.interval == "t" else "percentile bootstrap (10,000 resamples, seed 0)"
        md += ["", f"## Verdicts ({spec.confidence:.0%} {how} interval on the mean paired difference)", ""]
        md += [f"verdicts not computed: {error}"] if error else _md_table([r.as_row() for r in rows])
    refs = P.reference_values(spec, results)
    if refs:
        md += ["", "## References", ""]
        md += _md_table([{"reference": k, f"final {spec.metric}": f"{v:.4f}", "source": src}
                         for k, (v, src) in refs.items()])
    if tuning:
        seeds = spec.tune.seeds if spec.tune.seeds is not None else spec.seeds[:1]
        md += ["", f"## Tuning (selected on {spec.tune.metric}, mean over seeds {list(seeds)}; "
                   "the chosen values then run on every seed)", ""]
        md += _md_table([{"method": t["method"], "values": t["values"], spec.tune.metric: f"{t['mean']:.4f}",
                          "runs": t["runs"], "chosen": "yes" if t["chosen"] else ""} for t in tuning])
    return md


def _log_results(parent: Any, name: str, spec: ClaimSpec, results: list[ConfigResult],
                 tuning: list[dict[str, Any]] | None = None) -> None:
    import csv

    out = parent.artifact_dir
    rows = results_table_rows(spec, results)
    cols = sorted({k for row in rows for k in row}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["configuration", "seed_index", "final", "best_moving_average", *spec.extra_metrics])
        for r in results:
            for i, (fin, bm) in enumerate(zip(r.finals, r.best_moving)):
                extras = [r.extras.get(k, [])[i] if i < len(r.extras.get(k, [])) else "" for k in spec.extra_metrics]
                writer.writerow([r.label, i, fin, bm, *extras])
    raised = seeds_raised_note(parent)
    md = [raised, ""] if raised else []
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(row.get(c, "") for c in cols) + " |" for row in rows]
    has_protocol = getattr(spec, "has_protocol", False) or getattr(spec, "tune", None) is not None
    if has_protocol:
        md += protocol_markdown(spec, results, tuning or [])
    (out / "results.md").write_text("\n".join(md) + "\n")
    parent.log_artifact(out / "results.csv")
    parent.log_artifact(out / "results.md")
    verdicts, _ = verdicts_or_error(spec, results) if has_protocol else ([], None)
    if verdicts:
        with (out / "verdicts.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(verdicts[0].as_csv()))
            writer.writeheader()
            writer.writerows(v.as_csv() for v in verdicts)
        parent.log_artifact(out / "verdicts.csv")
    if tuning:
        with (out / "tuning.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(tuning[0]))
            writer.writeheader()
            writer.writerows(tuning)
        parent.log_artifact(out / "tuning.csv")
    for r in results:
        m, _ = r.mean_std(r.finals)
        if not math.isnan(m):
            parent.log_metrics({f"final/{_metric_name(r.label)}": m}, step=0)
    from fedsim.plots import plot_claim

    refs = {k: v for k, (v, _) in P.reference_values(spec, results).items()} if has_protocol else None
    for path in plot_claim(spec, results, out, title=f"{name}: {spec.metric}", references=refs):
        parent.log_artifact(path, "plots")


# -- --plan -------------------------------------------------------------------------------------
def measured_seconds_per_run(name: str, tracking_uri: str | None) -> float | None:
    """The ``seconds_per_run`` of the latest finished parent of this claim check, if a store has one.

    Reads only: an sqlite store that does not exist yet is not created.
    """
    from fedsim.tracking import check_tracking_uri, mlflow_client, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return None
    try:
        check_tracking_uri(uri)  # an unreachable server: no estimate, in seconds rather than minutes
        client = mlflow_client(uri)  # an old store is migrated under the store lock, not racing runs
        exps = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(exps, filter_string=f"tags.experiment = 'reproduce/{name}' and "
                                                       "attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=20) if exps else []
    except Exception:  # noqa: BLE001 - an unreadable store just means no measured rate
        return None
    for run in runs:
        if SECONDS_PER_RUN in run.data.metrics:
            return float(run.data.metrics[SECONDS_PER_RUN])
    return None


def plan_claim(name: str, spec: ClaimSpec, tracking_uri: str | None = None) -> list[str]:
    """The runs a claim check would make (tuning, then final) and an estimated time; runs nothing."""
    grid = settings(spec)
    tune = tuning_jobs(spec, grid)
    final = final_jobs(spec, grid, {})
    cfgs = [build_config(spec, j.setting, j.seed, j.extra) for j in [*tune, *final]]  # the same checks as a run
    _check_tuning_configs(spec, cfgs[:len(tune)])
    # a final run of the chosen values on a tuning seed is that tuning run (run_claim reuses it)
    reuse = len({(label_of(j.setting), j.seed) for j in tune if j.seed in spec.seeds})
    lines = [f"plan for {name}: {len(tune) + len(final) - reuse} runs"]
    if tune:
        per_method: dict[str, set[str]] = {}
        for j in tune:
            per_method.setdefault(j.method, set()).add(P.candidate_text(j.candidate))
        lines.append(f"  tuning on {spec.tune.metric}: {len(tune)} runs "
                     f"({', '.join(f'{m}: {len(c)} candidates' for m, c in per_method.items())})")
        lines += [f"    {j.name}" for j in tune]
    lines.append(f"  final: {len(final)} runs ({len(grid)} configurations × {len(spec.seeds)} seeds"
                 + (", plus the reference configurations" if len(final) > len(grid) * len(spec.seeds) else "")
                 + (", each method with its tuned values" if tune else "")
                 + (f"; {reuse} of them are the tuning runs of the chosen values, reused" if reuse else "") + ")")
    lines += [f"    {j.name}" for j in final]
    if spec.has_protocol:
        unread = [label_of(grid[i]) for i in range(len(grid)) if i not in P.read_configurations(spec, grid)]
        if unread:
            lines.append(f"  {len(unread)} configuration{'s' * (len(unread) > 1)} no claim, control or reference reads "
                         f"(leave them out with exclude:): {'; '.join(unread)}")
    measured = measured_seconds_per_run(name, tracking_uri)
    if measured is not None:
        per_run, source = measured, "measured by the last finished run of this claim check"
    elif spec.minutes_per_run is not None:
        per_run, source = spec.minutes_per_run * 60, "the spec's minutes_per_run"
    else:
        lines.append("  estimated time: unknown (set minutes_per_run in the spec, or run it once)")
        return lines
    total_min = per_run * (len(tune) + len(final) - reuse) / 60
    lines.append(f"  estimated time: {total_min:.1f} min ({per_run / 60:.2f} min per run, {source})")
    return lines
