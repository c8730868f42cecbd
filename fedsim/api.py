"""The Python API for notebooks and scripts: ``fedsim.run("fedavg_digits", rounds=5)``.

It is the command line without the command line: the same experiment files, overrides, privacy
target and MLflow recording, returning the run's :class:`fedsim.runner.RunSummary` (its
``history`` holds every round's metrics).  Tracking is off by default here (a notebook usually
plots the history itself); pass ``tracking=True`` to record the run to MLflow as ``fedsim run`` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["experiment_config", "run", "curve", "final"]


def _overrides(values: dict[str, Any]) -> list[str]:
    """``{"data.partition.alpha": 0.1, "client.params.domains": ["a", "b"]}`` → OmegaConf dotlist."""
    def text(v: Any) -> str:
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(text(x) for x in v) + "]"
        if v is None:
            return "null"
        return str(v)

    out = []
    for key, value in values.items():
        if isinstance(value, dict):  # {"client.params.method_params": {"lr": 0.05}} sets each key under it
            out += _overrides({f"{key}.{k}": v for k, v in value.items()})
        else:
            out.append(f"{key}={text(value)}")
    return out


def experiment_config(experiment: str, overrides: dict[str, Any] | None = None, *, seed: int | None = None,
           eps: float | None = None) -> Any:
    """The typed, validated config of ``experiment`` with dotted-key ``overrides`` (and ``eps``: DP-SGD target)."""
    from fedsim import config as C

    cfg = C.load_config(experiment, _overrides(overrides or {}), {"seed": seed})
    if eps is not None:
        cfg.privacy.enabled, cfg.privacy.epsilon, cfg.privacy.noise_multiplier = True, float(eps), None
        C.validate(cfg)
    return cfg


def run(experiment: str, overrides: dict[str, Any] | None = None, *, seed: int | None = None,
        eps: float | None = None, tracking: bool = False, tracking_uri: str | None = None,
        progress: bool = False, **short: Any) -> Any:
    """Run a federated experiment; returns its RunSummary.

    ``overrides`` take dotted keys (``{"data.partition.alpha": 0.1}``); the common top-level ones
    can also be given by keyword (``rounds=5, num_clients=10``).
    """
    from fedsim.runner import run_experiment

    cfg = experiment_config(experiment, {**short, **(overrides or {})}, seed=seed, eps=eps)
    cfg.tracking.enabled = tracking
    if not progress:
        return run_experiment(cfg, tracking_uri=tracking_uri)
    from rich.console import Console

    from fedsim.progress import RoundProgress

    with RoundProgress(cfg.rounds, cfg.name, Console()) as bar:
        return run_experiment(cfg, observers=[bar], tracking_uri=tracking_uri)


def curve(summary: Any, metric: str = "eval/accuracy") -> tuple[list[int], list[float]]:
    """(rounds, values) of one metric of a run."""
    points = summary.history.series(metric)
    return [r for r, _ in points], [v for _, v in points]


def final(summary: Any, metric: str = "eval/accuracy") -> float:
    """The metric's value in the last round that logged it."""
    points = summary.history.series(metric)
    if not points:
        raise KeyError(f"the run logged no {metric!r}; it logged: {sorted(summary.history.final())}")
    return points[-1][1]
