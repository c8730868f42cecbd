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
    seeds: [0, 1, 2]
    metric: eval/accuracy
    moving_average: 10                      # also report the best k-round moving average
    extra_metrics: [eval/loss]              # more columns: each run's final value of these metrics

The result is a table of mean ± std over seeds of the final metric (and the best moving average)
per configuration, printed and logged to the parent run as ``results.csv`` / ``results.md``, with
plots: the metric per round (mean over seeds) per configuration and, when ``eps`` is in the grid,
final metric vs ε.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim import config as C
from fedsim.engine.history import History
from fedsim.errors import ConfigError, FedsimError

REPRODUCE_DIR = C.EXPERIMENTS_DIR / "reproduce"
EPS_KEY = "eps"


@dataclass
class ClaimSpec:
    experiment: str
    description: str = ""
    overrides: list[str] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    metric: str = "eval/accuracy"
    moving_average: int = 0
    extra_metrics: list[str] = field(default_factory=list)  # more table columns (final values)


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

    def add_extras(self, finals: dict[str, float]) -> None:
        """One seed's final values of the spec's extra metrics (NaN where a run did not log one)."""
        for key, value in finals.items():
            self.extras.setdefault(key, []).append(value)

    def add(self, curve: list[float], moving_average: int) -> None:
        """One seed's metric curve (round 0 first)."""
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


def load_claim(name: str, seeds: int | None = None, extra_overrides: list[str] | None = None) -> ClaimSpec:
    path = Path(name) if name.endswith((".yaml", ".yml")) else REPRODUCE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no claim check named {name!r}; known: {', '.join(list_claims()) or 'none'}")
    try:
        spec: ClaimSpec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClaimSpec), C.read_yaml(path)))  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {seeds}")
        spec.seeds = list(range(seeds))
    spec.overrides = [*spec.overrides, *(extra_overrides or [])]
    if not spec.grid:
        raise ConfigError(f"{path}: grid is empty; list at least one key with values")
    return spec


def settings(spec: ClaimSpec) -> list[dict[str, Any]]:
    keys = list(spec.grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(spec.grid[k] for k in keys))]


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


def build_config(spec: ClaimSpec, setting: dict[str, Any], seed: int) -> Any:
    """The config of one (setting, seed): an ExperimentConfig, or a CentralConfig for the centralised track."""
    overrides = list(spec.overrides)
    eps = setting.get(EPS_KEY, "absent")
    for key, value in setting.items():
        if isinstance(value, dict):
            overrides += [f"{key}.{k}={v}" for k, v in C.flatten(value).items()]
        elif key != EPS_KEY:
            overrides.append(f"{key}={_dotlist_value(value)}")
    if C.is_central(spec.experiment):
        if eps != "absent":
            raise ConfigError(f"claim grid key 'eps' applies to federated experiments, not {spec.experiment!r}")
        cfg_central = C.load_central_config(spec.experiment, overrides, seed)
        from central.base import method_params

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
        from central.base import run_central

        return run_central
    from fedsim.runner import run_experiment

    return run_experiment


def best_moving_average(values: list[float], k: int) -> float:
    if k <= 1 or len(values) < k:
        return max(values) if values else float("nan")
    kernel = np.ones(k) / k
    return float(np.convolve(np.asarray(values), kernel, mode="valid").max())


def run_claim(
    name: str,
    spec: ClaimSpec,
    *,
    tracking_uri: str | None = None,
    on_progress: Callable[[str], None] = lambda msg: None,
    run_one: Callable[..., Any] | None = None,
    resume_parent: str | None = None,
) -> tuple[list[ConfigResult], str | None]:
    """Run every (setting, seed); a failing run is reported and does not stop the others.

    ``resume_parent`` continues an interrupted claim check: children that finished are read back
    from MLflow, a child with a checkpoint is resumed, the others are run.
    """
    from fedsim.tracking import MlflowRecorder, git_commit

    grid = settings(spec)
    configs = [(s, seed, build_config(spec, s, seed)) for s in grid for seed in spec.seeds]  # validate all first
    run_one = run_one or _default_runner(configs[0][2])
    tracking = configs[0][2].tracking
    parent = None
    params = {"claim": name, "base_experiment": spec.experiment, "seeds": len(spec.seeds),
              "grid": str(dict(spec.grid)), "overrides": " ".join(spec.overrides),
              "metric": spec.metric, "extra_metrics": str(list(spec.extra_metrics))}
    done: dict[str, Any] = {}
    if resume_parent:
        if not tracking.enabled:
            raise ConfigError("--resume continues an MLflow parent run, so it needs tracking")
        parent = MlflowRecorder.reopen(tracking_uri or tracking.uri, resume_parent)
        done = _finished_children(parent, params)
    elif tracking.enabled:
        parent = MlflowRecorder(tracking_uri or tracking.uri, tracking.experiment, run_name=f"reproduce-{name}",
                                tags={"experiment": f"reproduce/{name}", "kind": "claim-check",
                                      "git_commit": git_commit()})
        parent.log_params(params)
    results = {label_of(s): ConfigResult(label_of(s), s) for s in grid}
    status = "FAILED"
    try:
        for i, (setting, seed, cfg) in enumerate(configs, 1):
            res = results[label_of(setting)]
            child_name = f"{res.label} | seed {seed}"
            previous = done.get(child_name)
            if previous is not None and previous.info.status == "FINISHED":
                on_progress(f"[{i}/{len(configs)}] {res.label}, seed {seed}: finished before, read back")
                add_logged_run(res, parent, previous, spec)
                continue
            on_progress(f"[{i}/{len(configs)}] {res.label}, seed {seed}")
            kwargs: dict[str, Any] = {}
            if previous is not None and isinstance(cfg, C.ExperimentConfig) and _has_checkpoint(cfg, previous.info.run_id):
                kwargs["resume_run_id"] = previous.info.run_id
                on_progress(f"    resuming run {previous.info.run_id} from its checkpoint")
            try:
                summary = run_one(cfg, tracking_uri=tracking_uri, parent_run_id=parent.run_id if parent else None,
                                  run_name=child_name, **kwargs)
            except FedsimError as exc:
                res.failed.append(f"seed {seed}: {exc}")
                on_progress(f"    failed: {exc}")
                continue
            res.add([v for _, v in _series(summary.history, spec.metric)], spec.moving_average)
            res.add_extras({k: _final_value(summary.history, k) for k in spec.extra_metrics})
            res.client_failures += int(sum(v for _, v in _series(summary.history, CLIENTS_FAILED)))
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if parent is not None:
            if status == "FINISHED":
                _log_results(parent, name, spec, list(results.values()))
            parent.finish(status)
    return list(results.values()), parent.run_id if parent else None


def _finished_children(parent: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The parent's children by run name (the latest per name), after checking the spec matches."""
    logged = parent.client.get_run(parent.run_id).data.params
    for key in ("claim", "grid", "overrides", "seeds"):
        if key in logged and logged[key] != str(params[key])[:500]:
            raise ConfigError(f"--resume {parent.run_id}: that claim check ran with {key}={logged[key]!r}, "
                              f"not {str(params[key])!r}; resume it with the same claim and overrides")
    return children_by_name(parent)


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
    """MLflow metric names allow only alphanumerics and ``_-. :/``."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", label.replace("=", ":").replace("ε", "eps").replace("∞", "inf"))


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
        if r.failed:
            row["failed"] = str(len(r.failed))
        if r.client_failures:  # a run that lost clients (e.g. to a timeout) is not a clean data point
            row["client failures"] = str(r.client_failures)
        rows.append(row)
    return rows


def _log_results(parent: Any, name: str, spec: ClaimSpec, results: list[ConfigResult]) -> None:
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
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(row.get(c, "") for c in cols) + " |" for row in rows]
    (out / "results.md").write_text("\n".join(md) + "\n")
    parent.log_artifact(out / "results.csv")
    parent.log_artifact(out / "results.md")
    for r in results:
        m, _ = r.mean_std(r.finals)
        if not math.isnan(m):
            parent.log_metrics({f"final/{_metric_name(r.label)}": m}, step=0)
    from fedsim.plots import plot_claim

    for path in plot_claim(spec, results, out, title=f"{name}: {spec.metric}"):
        parent.log_artifact(path, "plots")
