"""Sweeps on Ray Tune: a grid of configurations × seeds as parallel trials under one MLflow parent run.

``fedsim sweep fedsvd --grid eps=1,3,6 strategy=fedsvd,ffa_lora --seeds 3`` or a sweep file
``experiments/sweeps/<name>.yaml`` (the claim-spec keys of :mod:`fedsim.reproduce` plus
``cpus_per_trial``, ``gpus_per_trial`` and ``max_concurrent``).  Every (configuration, seed) is one
Ray Tune trial; a trial runs the experiment with fedsim's in-process ``local`` engine (never Flower's
Ray backend or fedsim's Ray actor pool inside a Ray trial: nested Ray runtimes are a known cause of
out-of-memory failures) and logs one MLflow child run under the sweep's parent run.

* **Where it runs:** a local Ray runtime by default; an existing cluster with ``--address auto`` or
  ``RAY_ADDRESS``, unchanged (the cluster's workers need fedsim installed and the tracking store
  reachable, e.g. an MLflow server URI instead of a local sqlite file).
* **Resources:** each trial reserves ``cpus_per_trial`` CPUs (Ray schedules as many at once as fit,
  capped by ``max_concurrent``) and runs its clients with that many torch threads; with
  ``gpus_per_trial`` > 0 it also reserves that many GPUs (0.5: two trials share a GPU) and runs on
  ``engine.device=cuda``, the GPU(s) Ray gives it (Ray sets ``CUDA_VISIBLE_DEVICES`` per trial).
* **Failures:** a failed trial is reported (its child run ends FAILED) and the others go on.
* **Resume:** ``--resume PARENT_RUN_ID`` reads back the children that finished and runs the rest
  (the MLflow parent is the ledger, as for claim checks); a child left RUNNING by a killed sweep is
  marked KILLED and rerun.
* **Results:** the same table and plots as a claim check (:mod:`fedsim.reproduce`), logged to the
  parent; ``fedsim compare PARENT_RUN_ID`` prints and plots them again at any time.
* **Random search:** ``--samples N --search client.lr=loguniform(0.01,1)`` draws N configurations
  with Ray Tune's own search-space functions (``tune.loguniform`` ...) and their ``sample``, seeded by
  ``--search-seed`` (the same seed, the same samples); each sample × each seed is one trial (all seeds
  of a sample share its values); with a grid, every grid point gets the N samples.
* **ASHA:** ``--asha eval/accuracy`` reports that metric to Tune every round (an observer of the
  round loop) and lets Tune's ASHA scheduler stop the poor trials early; a stopped trial's child run
  ends KILLED with the tags ``fedsim.stopped_by=asha`` and ``fedsim.stopped_at_round``; it is not a
  failure, and the parent's ``results.md`` lists the stopped trials.

Ray Tune's own MLflow callback is not used: fedsim's runs already log params, per-round metrics,
plots and the model, and a second logger would duplicate every run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim import config as C
from fedsim.errors import ConfigError
from fedsim.engine.ray_address import check_cluster, cluster_address, joining
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
MAX_GPUS_PER_TRIAL = 8


@dataclass
class AshaSpec:
    """Tune's ASHA scheduler on a per-round metric (``time_attr`` is the round)."""

    metric: str = "eval/accuracy"
    mode: str = "max"  # max | min
    grace_period: int = 1  # rounds every trial runs before it can be stopped
    reduction_factor: float = 4.0  # Tune's default: keep the top 1/4 at each rung


@dataclass
class SweepSpec(ClaimSpec):
    """A claim spec plus the trials' resources, an optional random search and ASHA."""

    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0  # 0: CPU trials; 0.5: two trials share a GPU (engine.device=cuda)
    max_concurrent: int = 0  # 0: as many trials at once as the CPUs (and GPUs) allow
    search: dict[str, str] = field(default_factory=dict)  # key -> "loguniform(0.01, 1)" ...
    samples: int = 0  # random-search samples (each × every seed); 0: no random search
    search_seed: int = 0  # seeds Tune's sampling: the same seed, the same samples
    asha: Optional[AshaSpec] = None


#: ASHA's tag on a child run it stopped, and the round it stopped at.
STOPPED_BY_TAG = "fedsim.stopped_by"
STOPPED_AT_TAG = "fedsim.stopped_at_round"


@dataclass
class SweepProgress:
    """Trial counts for the progress line."""

    total: int
    done: int = 0
    running: int = 0
    failed: int = 0
    read_back: int = 0
    stopped: int = 0  # stopped early by ASHA (not failures)
    failures: list[str] = field(default_factory=list)
    stops: dict[str, int] = field(default_factory=dict)  # child name -> the round ASHA stopped it at
    stop_metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # child name -> that round's metrics
    round_reports: int = 0  # per-round results the trials reported to ASHA

    def line(self) -> str:
        pending = self.total - self.done - self.running - self.failed - self.stopped
        return (f"trials: {self.done} done, {self.running} running, {self.failed} failed, {pending} pending"
                + (f", {self.stopped} stopped by ASHA" if self.stopped else "")
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


# -- random search --------------------------------------------------------------------------------
#: The distributions ``--search KEY=DIST(...)`` accepts: Ray Tune's search-space functions.
SEARCH_FORMS = ("uniform(LO,HI), quniform(LO,HI,Q), loguniform(LO,HI), qloguniform(LO,HI,Q), "
                "randint(LO,HI) (HI excluded, as in Tune), qrandint(LO,HI,Q), lograndint(LO,HI), "
                "choice(V1,V2,...)")
_ARITY = {"uniform": 2, "quniform": 3, "loguniform": 2, "qloguniform": 3, "randint": 2, "qrandint": 3,
          "lograndint": 2}
_INTEGER = {"randint", "qrandint", "lograndint"}


@dataclass(frozen=True)
class Dist:
    """One parsed ``--search`` distribution: a Ray Tune search-space function and its arguments."""

    kind: str
    args: tuple[Any, ...]

    def domain(self) -> Any:
        """The Tune domain (``tune.loguniform(0.01, 1)`` ...); imports Ray Tune."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        return getattr(tune, self.kind)(*self.args)

    def text(self) -> str:
        return f"{self.kind}({', '.join(str(a) for a in self.args)})"


def parse_distribution(key: str, text: Any) -> Dist:
    """``"loguniform(0.01, 1)"`` → ``Dist("loguniform", (0.01, 1.0))``; anything else is a one-line
    ConfigError naming ``key`` and the accepted forms (checked without importing Ray)."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"--search {key}={text}: {why}; write one of {SEARCH_FORMS}")

    m = re.fullmatch(r"\s*([A-Za-z_]+)\s*\((.*)\)\s*", str(text), re.S)
    if not isinstance(text, str) or m is None:
        raise bad("not a distribution")
    kind, inner = m.group(1).lower(), m.group(2)
    parts = [p.strip() for p in inner.split(",")] if inner.strip() else []
    if kind == "choice":
        if not parts or any(not p for p in parts):
            raise bad("choice needs one or more comma-separated values")
        try:
            values = tuple(_scalar(p) for p in parts)
        except ConfigError:
            raise bad("choice values must be plain values") from None
        return Dist("choice", values)
    if kind not in _ARITY:
        raise bad(f"unknown distribution {kind!r}")
    if len(parts) != _ARITY[kind]:
        raise bad(f"{kind} takes {_ARITY[kind]} numbers, got {len(parts)}")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise bad(f"{kind} takes numbers") from None
    if not all(math.isfinite(v) for v in nums):
        raise bad("the bounds must be finite")
    if kind in _INTEGER:
        if not all(v.is_integer() for v in nums):
            raise bad(f"{kind} takes integers")
        nums = [int(v) for v in nums]  # type: ignore[misc]
    lo, hi = nums[0], nums[1]
    if not lo < hi:
        raise bad(f"the lower bound must be below the upper one, got {parts[0]} and {parts[1]}")
    if kind.startswith(("log", "qlog")) and lo <= 0:
        raise bad(f"{kind} needs a lower bound > 0")
    if len(nums) == 3 and not nums[2] > 0:
        raise bad("the step Q must be > 0")
    return Dist(kind, tuple(nums))


def parse_search(items: list[str] | dict[str, Any], experiment: str) -> dict[str, Dist]:
    """``["client.lr=loguniform(0.01,1)", "strategy=choice(fedavg,fedprox)"]`` (or a sweep file's
    ``search:`` mapping) → ``{"client.lr": Dist(...), "strategy.name": Dist(...)}``."""
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, dict):
        pairs = [(str(k), v) for k, v in items.items()]
    else:
        for item in items:
            key, sep, dist = item.partition("=")
            if not sep or not key.strip() or not dist.strip():
                raise ConfigError(f"--search {item!r}: write KEY=DIST, DIST one of {SEARCH_FORMS} "
                                  f"(e.g. client.lr=loguniform(0.01,1))")
            pairs.append((key.strip(), dist.strip()))
    return {_expand_key(k, experiment): parse_distribution(k, v) for k, v in pairs}


def sample_settings(search: dict[str, Dist], samples: int, seed: int) -> list[dict[str, Any]]:
    """``samples`` draws of the search space with Tune's own sampling (``Domain.sample``), seeded:
    the same ``seed`` gives the same samples. No Ray runtime is started."""
    import numpy as np

    rng = np.random.default_rng(seed)
    domains = {k: d.domain() for k, d in search.items()}
    return [{k: _plain(dom.sample(random_state=rng)) for k, dom in domains.items()} for _ in range(samples)]


def _plain(value: Any) -> Any:
    """A sampled numpy scalar as a Python one (it goes into an override and an MLflow name)."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def _short(value: Any) -> Any:
    return f"{value:.3g}" if isinstance(value, float) else value


@dataclass
class Trial:
    """One configuration of a sweep: its setting (the overrides) and its label (the child's name)."""

    label: str
    setting: dict[str, Any]


def sweep_settings(spec: SweepSpec) -> list[Trial]:
    """The sweep's configurations: the grid, or the grid × the random-search samples (labelled
    ``s0: lr=0.0235, alpha=3.1``, the sample index first so rounded values never collide)."""
    grid = settings(spec) if spec.grid else [{}]
    if not spec.samples:
        return [Trial(label_of(s), s) for s in grid]
    search = parse_search(spec.search, spec.experiment)
    drawn = sample_settings(search, spec.samples, spec.search_seed)
    out = []
    for g in grid:
        for i, s in enumerate(drawn):
            label = ", ".join(t for t in (label_of(g), label_of({k: _short(v) for k, v in s.items()})) if t)
            out.append(Trial(f"s{i}: {label}", {**g, **s}))
    return out


def load_sweep(name: str, *, grid: list[str] | None = None, seeds: int | None = None,
               overrides: list[str] | None = None, cpus_per_trial: float | None = None,
               gpus_per_trial: float | None = None, max_concurrent: int | None = None,
               search: list[str] | None = None, samples: int | None = None, search_seed: int | None = None,
               asha: str | None = None, asha_mode: str | None = None, grace_period: int | None = None,
               reduction_factor: float | None = None) -> tuple[str, SweepSpec]:
    """A sweep file (``experiments/sweeps/NAME.yaml`` or a path) or an experiment plus ``--grid``
    and/or ``--samples N --search KEY=DIST``; ``asha`` (a metric) adds Tune's ASHA scheduler."""
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
    else:  # an experiment and a --grid and/or a --search
        if not grid and not search:
            known = ", ".join(list_sweeps()) or "none"
            raise ConfigError(f"no sweep file named {name!r} (known: {known}); to sweep the experiment "
                              f"{name!r} give a grid: fedsim sweep {name} --grid KEY=V1,V2 (or a random "
                              f"search: --samples N --search KEY=DIST)")
        C.experiment_path(name)  # a clear error for an unknown experiment
        spec = SweepSpec(experiment=name, grid=parse_grid(grid, name) if grid else {})
        label = Path(name).stem
    if search:
        spec.search = {**spec.search, **{k: d.text() for k, d in parse_search(search, spec.experiment).items()}}
    if samples is not None:
        spec.samples = samples
    if search_seed is not None:
        spec.search_seed = search_seed
    if asha is not None:
        spec.asha = AshaSpec(metric=asha)
    if spec.asha is None and any(v is not None for v in (asha_mode, grace_period, reduction_factor)):
        raise ConfigError("--asha-mode, --grace-period and --reduction-factor tune ASHA: give --asha METRIC too")
    if spec.asha is not None:
        spec.asha.mode = asha_mode or spec.asha.mode
        spec.asha.grace_period = grace_period if grace_period is not None else spec.asha.grace_period
        spec.asha.reduction_factor = reduction_factor if reduction_factor is not None else spec.asha.reduction_factor
        _check_asha(spec.asha)
    _check_search(spec, label)
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {seeds}")
        spec.seeds = list(range(seeds))
    spec.overrides = [*spec.overrides, *(overrides or [])]
    if cpus_per_trial is not None:
        spec.cpus_per_trial = cpus_per_trial
    if gpus_per_trial is not None:
        spec.gpus_per_trial = gpus_per_trial
    if max_concurrent is not None:
        spec.max_concurrent = max_concurrent
    if not spec.grid and not spec.samples:
        raise ConfigError(f"sweep {label!r}: the grid is empty; give --grid KEY=V1,V2 "
                          f"(or --samples N --search KEY=DIST)")
    if not (math.isfinite(spec.cpus_per_trial) and 0 < spec.cpus_per_trial <= MAX_CPUS_PER_TRIAL):
        raise ConfigError(f"cpus_per_trial must be > 0 (a finite number, at most {MAX_CPUS_PER_TRIAL}), "
                          f"got {spec.cpus_per_trial}")
    check_gpus_per_trial(spec.gpus_per_trial)
    if not 0 <= spec.max_concurrent <= 100_000:
        raise ConfigError(f"max_concurrent must be in [0, 100000], got {spec.max_concurrent}")
    if not 1 <= len(spec.seeds) <= 10_000:
        raise ConfigError(f"a sweep needs 1 to 10000 seeds, got {len(spec.seeds)}")
    if C.is_central(spec.experiment):
        raise ConfigError(f"{spec.experiment!r} is a centralised-track method; sweep it with "
                          f"`fedsim reproduce` (a claim spec) for now")
    return label, spec


def check_gpus_per_trial(gpus: float) -> None:
    """``gpus_per_trial`` is 0, a fraction of one GPU (Ray's precision: 0.0001) or a whole number of them."""
    ok = math.isfinite(gpus) and (gpus == 0 or 0.0001 <= gpus <= 1
                                  or (1 < gpus <= MAX_GPUS_PER_TRIAL and float(gpus).is_integer()))
    if not ok:
        raise ConfigError(f"gpus_per_trial must be 0 (no GPU), a fraction of one GPU (0.0001 to 1, e.g. 0.5 "
                          f"puts two trials on a GPU) or a whole number up to {MAX_GPUS_PER_TRIAL}, got {gpus}")


def _check_search(spec: SweepSpec, label: str) -> None:
    """A random search needs both ``samples`` and ``search``; its keys must not also be grid axes."""
    if not 0 <= spec.samples <= 100_000:
        raise ConfigError(f"--samples must be in [1, 100000], got {spec.samples}")
    if spec.search and not spec.samples:
        raise ConfigError(f"sweep {label!r}: --search draws --samples N configurations; give --samples N")
    if spec.samples and not spec.search:
        raise ConfigError(f"sweep {label!r}: --samples {spec.samples} needs ranges: --search KEY=DIST "
                          f"(DIST one of {SEARCH_FORMS})")
    parsed = parse_search(spec.search, spec.experiment)  # a sweep file's ranges are checked here
    both = sorted(set(parsed) & set(spec.grid))
    if both:
        raise ConfigError(f"{', '.join(both)}: both a grid axis and a --search range; give each key one of them")


def _check_asha(asha: AshaSpec) -> None:
    if asha.mode not in ("max", "min"):
        raise ConfigError(f"--asha-mode must be max or min, got {asha.mode!r}")
    if not asha.metric or not isinstance(asha.metric, str):
        raise ConfigError("--asha takes a per-round metric, e.g. --asha eval/accuracy")
    if not 1 <= asha.grace_period <= 1_000_000:
        raise ConfigError(f"--grace-period must be >= 1 round, got {asha.grace_period}")
    if not (math.isfinite(asha.reduction_factor) and asha.reduction_factor > 1):
        raise ConfigError(f"--reduction-factor must be > 1, got {asha.reduction_factor}")


def trial_config(spec: SweepSpec, setting: dict[str, Any], seed: int, *,
                 gpus_here: bool = True) -> C.ExperimentConfig:
    """One trial's config: the in-process engine, ``cpus_per_trial`` torch threads, ``engine.device=cuda``
    when it reserves GPUs, absolute paths.  ``gpus_here=False``: the trials run on a Ray cluster's nodes
    (``--address``), so a CUDA device is looked for there (by the trial), not on this machine."""
    from fedsim.engine.runtime import RunSpec
    from fedsim.runner import preflight

    cfg = build_config(spec, setting, seed)
    cfg.engine.name = "local"
    cfg.engine.threads_per_client = max(1, int(spec.cpus_per_trial))
    cfg.engine.device = trial_device(cfg.engine.device, spec.gpus_per_trial)
    if spec.gpus_per_trial > 0:
        _check_gpu_learner(cfg)
    cfg.engine.checkpoint_dir = str(Path(cfg.engine.checkpoint_dir).expanduser().resolve())
    if cfg.engine.checkpoint and cfg.tracking.enabled:
        check_writable_dir(cfg.engine.checkpoint_dir, "engine.checkpoint_dir")
    device = cfg.engine.device
    if not gpus_here:  # the device is resolved where the trial runs; every other check is made here
        cfg.engine.device = "cpu"
    try:
        preflight(RunSpec.from_config(cfg))  # unknown components and bad params fail here, before Ray starts
    finally:
        cfg.engine.device = device
    return cfg


def trial_device(device: str, gpus_per_trial: float) -> str:
    """A trial's ``engine.device``: ``cuda`` (the GPU Ray gives the trial) when it reserves GPUs, unless the
    config already names a CUDA device; a CUDA device without reserved GPUs is a ConfigError."""
    if gpus_per_trial <= 0:
        if device.startswith("cuda"):
            raise ConfigError(f"engine.device={device} in a sweep needs GPUs reserved per trial (else Ray counts "
                              f"none and piles the trials on one GPU); add --gpus-per-trial 1 (or 0.5 to share one)")
        return device
    if not device.startswith("cuda"):
        return "cuda"
    visible = max(1, int(gpus_per_trial))  # Ray sets CUDA_VISIBLE_DEVICES to the trial's GPU(s)
    if int(device.partition(":")[2] or 0) >= visible:
        raise ConfigError(f"engine.device={device} but each trial sees {visible} GPU(s) (cuda:0..cuda:{visible - 1}, "
                          f"the ones Ray gives it); use engine.device=cuda")
    return device


def _check_gpu_learner(cfg: C.ExperimentConfig) -> None:
    """A trial that reserves GPUs needs a learner that runs on one (``supports_device``)."""
    from fedsim.registry import LEARNERS

    C.check_names(cfg)  # the config's plugins are imported: its learner is known
    if not getattr(LEARNERS.get(cfg.client.learner), "supports_device", False):
        raise ConfigError(f"learner {cfg.client.learner!r} runs on the CPU only, so its trials cannot use a GPU; "
                          f"drop --gpus-per-trial")


def trial_resources(spec: SweepSpec) -> dict[str, float]:
    """What each trial reserves from Ray (``tune.with_resources``): its CPUs, and its GPUs if any."""
    if spec.gpus_per_trial > 0:
        return {"cpu": spec.cpus_per_trial, "gpu": spec.gpus_per_trial}
    return {"cpu": spec.cpus_per_trial}


def trials_at_once(spec: SweepSpec, cluster: Mapping[str, float]) -> int:
    """How many trials run at once on Ray's resources ``cluster`` (``ray.cluster_resources()``): as many
    as its CPUs (and GPUs) fit, capped by ``max_concurrent``; ConfigError if not even one fits."""
    cpus = float(cluster.get("CPU", 1.0))
    if spec.cpus_per_trial > cpus:
        raise ConfigError(f"cpus_per_trial={spec.cpus_per_trial} exceeds the {cpus:g} CPUs Ray sees; "
                          f"lower it (--cpus-per-trial)")
    limit = max(1, int(cpus // spec.cpus_per_trial))
    if spec.gpus_per_trial > 0:
        gpus = float(cluster.get("GPU", 0.0))
        if spec.gpus_per_trial > gpus:
            raise ConfigError(f"gpus_per_trial={spec.gpus_per_trial:g} exceeds the {gpus:g} GPUs Ray sees; "
                              f"lower it (--gpus-per-trial) or join a cluster with GPUs (--address)")
        limit = min(limit, max(1, int(gpus / spec.gpus_per_trial + 1e-9)))  # 1 / 0.1 is 10 trials, not 9
    return min(limit, spec.max_concurrent) if spec.max_concurrent else limit


def check_cuda(spec: SweepSpec) -> None:
    """Before the trials' configs are checked (here, on CUDA when they reserve GPUs): torch sees a GPU."""
    if spec.gpus_per_trial <= 0:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"gpus_per_trial={spec.gpus_per_trial:g} but torch sees no CUDA GPU here; run "
                          f"`make install-gpu` on a machine with an NVIDIA GPU, or drop --gpus-per-trial")


def _on_cluster(address: str | None) -> bool:
    """The sweep joins an existing Ray runtime (whose resources are known once connected)."""
    import sys

    return bool(cluster_address(address) or ("ray" in sys.modules and sys.modules["ray"].is_initialized()))


def preflight_resources(spec: SweepSpec, address: str | None) -> None:
    """Before Ray or MLflow start: a local Ray cannot give a trial more CPUs (or GPUs) than this machine has."""
    if _on_cluster(address):
        check_cluster(address, "--address")  # it answers; its CPUs and GPUs are known once connected (_run_trials)
        return
    cpus = os.cpu_count() or 1
    if spec.cpus_per_trial > cpus:
        raise ConfigError(f"cpus_per_trial={spec.cpus_per_trial:g} exceeds the {cpus} CPUs of this machine; "
                          f"lower it (--cpus-per-trial) or join a cluster with --address")
    if spec.gpus_per_trial > 0:
        import torch

        gpus = torch.cuda.device_count()
        if spec.gpus_per_trial > gpus:
            raise ConfigError(f"gpus_per_trial={spec.gpus_per_trial:g} exceeds the {gpus} GPU(s) of this machine; "
                              f"lower it (--gpus-per-trial) or join a cluster with --address")


def child_name(setting: dict[str, Any] | str, seed: int) -> str:
    """A trial's MLflow child name: its configuration's label (or the label itself) and the seed."""
    return f"{setting if isinstance(setting, str) else label_of(setting)} | seed {seed}"


#: The key the last report of a trial that ran all its rounds carries (ASHA sweeps).
FINISHED_KEY = "fedsim_finished"


def run_sweep(
    name: str,
    spec: SweepSpec,
    *,
    tracking_uri: str | None = None,
    address: str | None = None,
    resume_parent: str | None = None,
    on_progress: Callable[[SweepProgress], None] = lambda p: None,
    on_message: Callable[[str], None] = lambda msg: None,
    on_checked: Callable[[], None] = lambda: None,
) -> tuple[list[ConfigResult], str, SweepProgress]:
    """Run the grid (× random-search samples) × seeds on Ray Tune; returns the per-configuration
    results, the parent run id and the trial counts.  ``on_checked`` is called once every trial's
    config, the resources and the tracking store have been checked, before anything is recorded."""
    from fedsim.tracking import MlflowRecorder, git_commit, resolve_tracking_uri

    configs = sweep_settings(spec)
    here = not _on_cluster(address)  # on a cluster, its GPUs are counted once connected (trials_at_once)
    if here:
        check_cuda(spec)  # before the trials' configs resolve engine.device=cuda
    trials = [(t, seed, trial_config(spec, t.setting, seed, gpus_here=here))
              for t in configs for seed in spec.seeds]  # validate all first
    tracking = trials[0][2].tracking
    if not tracking.enabled:
        raise ConfigError("a sweep records its trials as MLflow child runs; remove tracking.enabled=false")
    max_t = max(cfg.rounds for _, _, cfg in trials)
    if spec.asha is not None and spec.asha.grace_period > max_t:
        raise ConfigError(f"--grace-period {spec.asha.grace_period} is more than the {max_t} rounds of the "
                          f"trials; ASHA could never stop one")
    preflight_resources(spec, address)
    uri = resolve_tracking_uri(tracking_uri, tracking.uri, check=True)  # flag > env > file, checked before Ray
    params = {"claim": name, "base_experiment": spec.experiment, "seeds": len(spec.seeds),
              "grid": str(dict(spec.grid)), "overrides": " ".join(spec.overrides),
              "metric": spec.metric, "extra_metrics": str(list(spec.extra_metrics))}
    if spec.samples:
        params.update(search=str(dict(spec.search)), samples=spec.samples, search_seed=spec.search_seed)
    if spec.asha is not None:
        params["asha"] = str(vars(spec.asha))
    if resume_parent:
        parent = MlflowRecorder.reopen(uri, resume_parent)
        logged = parent.client.get_run(parent.run_id).data.params
        for key in ("search", "samples", "search_seed"):
            if logged.get(key, "") != str(params.get(key, "")):
                raise ConfigError(f"--resume {parent.run_id}: that sweep ran with {key}={logged.get(key, '')!r}, "
                                  f"not {str(params.get(key, ''))!r}; resume it with the same search")
        done = _finished_children(parent, params)
        on_checked()
    else:
        on_checked()
        parent = MlflowRecorder(uri, tracking.experiment, run_name=f"sweep-{name}",
                                tags={"experiment": f"sweep/{name}", "kind": "sweep", "git_commit": git_commit()})
        parent.log_params({**params, "cpus_per_trial": spec.cpus_per_trial,
                           "gpus_per_trial": spec.gpus_per_trial, "max_concurrent": spec.max_concurrent})
        done = {}
    progress = SweepProgress(total=len(trials))
    pending = []
    for trial, seed, cfg in trials:
        child = child_name(trial.label, seed)
        previous = done.get(child)
        if previous is not None and (previous.info.status == "FINISHED" or STOPPED_BY_TAG in previous.data.tags):
            if previous.info.status == "FINISHED":
                progress.done += 1
            else:  # stopped by ASHA: a result, not a trial to run again
                progress.stopped += 1
                progress.stops[child] = int(previous.data.tags.get(STOPPED_AT_TAG, -1))
            progress.read_back += 1
            continue
        if previous is not None and previous.info.status == "RUNNING":  # left behind by a killed sweep
            parent.client.set_terminated(previous.info.run_id, status="KILLED")
        pending.append((child, cfg))
    on_progress(progress)
    status = "FAILED"
    try:
        if pending:
            _run_trials(pending, uri, parent.run_id, spec, address, progress, on_progress, on_message, max_t)
        results, stopped = _read_back(parent, spec, configs)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if status == "FINISHED":
            _log_results(parent, name, spec, results)
            if stopped:
                _log_stopped(parent, spec, stopped)
        parent.finish(status)
    return results, parent.run_id, progress


def _run_trials(pending: list[tuple[str, C.ExperimentConfig]], uri: str, parent_id: str,
                spec: SweepSpec, address: str | None, progress: SweepProgress,
                on_progress: Callable[[SweepProgress], None], on_message: Callable[[str], None],
                max_t: int = 0) -> None:
    import ray
    from ray import tune

    started_here = False
    if not ray.is_initialized():
        joined = cluster_address(address)
        os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")  # trials keep the driver's working directory
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # no CSV/JSON/TensorBoard loggers
        with joining(address, "--address"):
            ray.init(address=joined, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     runtime_env={"env_vars": {"RAY_CHDIR_TO_TRIAL_DIR": "0"}} if joined else None)
        started_here = True
    try:
        concurrent = trials_at_once(spec, ray.cluster_resources())
        by_id = {f"t{i:04d}": (child, cfg) for i, (child, cfg) in enumerate(pending)}
        trainable = tune.with_resources(_make_trainable(uri, parent_id, spec, by_id), trial_resources(spec))
        scheduler = None
        if spec.asha is not None:
            from ray.tune.schedulers import ASHAScheduler

            # a round without the metric (evaluation every k rounds) is not reported: no strict check
            os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
            scheduler = ASHAScheduler(time_attr="round", metric=spec.asha.metric, mode=spec.asha.mode,
                                      max_t=max(max_t, spec.asha.grace_period), grace_period=spec.asha.grace_period,
                                      reduction_factor=spec.asha.reduction_factor)
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search(list(by_id))},
            tune_config=tune.TuneConfig(max_concurrent_trials=concurrent, reuse_actors=False, scheduler=scheduler),
            run_config=tune.RunConfig(
                name=f"fedsim-sweep-{parent_id}", storage_path=str(Path.cwd() / "fedsim-sweeps"), verbose=0,
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                callbacks=[_progress_callback(progress, by_id, on_progress, on_message, spec.asha is not None)]),
        )
        with _quiet_tune():
            tuner.fit()
        if spec.asha is not None and not progress.round_reports and progress.done:
            on_message(f"ASHA saw no per-round {spec.asha.metric}: no trial logged it before its last round, "
                       f"so none could be stopped (check the metric's name)")
        if progress.stops:
            _mark_stopped(uri, parent_id, progress)
    finally:
        if started_here:
            ray.shutdown()


class _TuneReporter:
    """A round observer of an ASHA trial: reports the round's metrics to Tune (``tune.report``).

    The trial's last round is reported by the trainable after the run has finished (ASHA stops every
    trial at ``max_t``). When ASHA stops the trial, Tune's session ends the trial's thread from inside
    ``tune.report``: the thread waits there instead, so the child run records nothing more, and the
    driver ends it KILLED with the ``fedsim.stopped_by`` tags (:func:`_mark_stopped`).
    """

    def __init__(self, metric: str, rounds: int) -> None:
        self.metric, self.rounds = metric, rounds

    def on_round(self, record: Any) -> None:
        metrics = record.as_metrics()
        if record.round >= self.rounds or self.metric not in metrics:
            return
        from ray import tune

        try:
            tune.report({**_numeric(metrics), "round": record.round})
        except SystemExit:  # stopped by the scheduler: the actor ends with this thread parked here
            threading.Event().wait()


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _make_trainable(uri: str, parent_id: str, spec: SweepSpec,
                    by_id: dict[str, tuple[str, C.ExperimentConfig]]) -> Callable[[dict[str, Any]], dict[str, float] | None]:
    """The Ray Tune function trainable: run one trial's experiment as an MLflow child of ``parent_id``."""
    metric, extras = spec.metric, list(spec.extra_metrics)
    asha_metric = spec.asha.metric if spec.asha is not None else None

    def trainable(config: dict[str, Any]) -> dict[str, float] | None:
        from fedsim.errors import FedsimError
        from fedsim.runner import run_experiment

        name, cfg = by_id[config["trial"]]
        observers = [_TuneReporter(asha_metric, cfg.rounds)] if asha_metric else None
        try:
            summary = run_experiment(cfg, tracking_uri=uri, parent_run_id=parent_id, run_name=name,
                                     observers=observers)
        except FedsimError as exc:
            raise RuntimeError(f"{name}: {exc}") from None
        final = summary.history.final()
        out = {k: float(final.get(k, math.nan)) for k in [metric, *extras]}
        if asha_metric is None:
            return out
        from ray import tune

        last = summary.history.records[-1].round if summary.history.records else cfg.rounds
        try:  # the run has finished: ASHA stopping it at max_t changes nothing
            tune.report({**_numeric(final), **out, "round": last, FINISHED_KEY: 1.0})
        except SystemExit:
            pass
        return None

    return trainable


def _mark_stopped(uri: str, parent_id: str, progress: SweepProgress) -> None:
    """End each child ASHA stopped: KILLED, tagged ``fedsim.stopped_by=asha`` and the round, with the
    metrics of that round (ASHA decided on them; the trial never got to log them)."""
    import time

    from mlflow.entities import Metric

    from fedsim.tracking import mlflow_client

    client = mlflow_client(uri)
    experiment_id = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                              order_by=["attributes.start_time ASC"], max_results=10000)
    latest = {r.info.run_name: r for r in runs}
    for name, stop_round in progress.stops.items():
        run = latest.get(name)
        if run is None or run.info.status == "FINISHED" or STOPPED_BY_TAG in run.data.tags:
            continue
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, stop_round) for k, v in progress.stop_metrics.get(name, {}).items()
                 if math.isfinite(v)]
        for start in range(0, len(items), 500):
            client.log_batch(run_id, metrics=items[start:start + 500])
        client.set_tag(run_id, STOPPED_BY_TAG, "asha")
        client.set_tag(run_id, STOPPED_AT_TAG, str(stop_round))
        client.set_terminated(run_id, status="KILLED")


def _progress_callback(*args: Any) -> Any:
    """A Ray Tune callback keeping the trial counts (the class is defined here: ray imports lazily)."""
    from ray.tune import Callback

    class ProgressCallback(Callback):
        def __init__(self, progress: SweepProgress, by_id: dict[str, tuple[str, Any]],
                     on_progress: Callable[[SweepProgress], None], on_message: Callable[[str], None],
                     asha: bool = False) -> None:
            self.progress, self.by_id, self.on_progress, self.on_message = progress, by_id, on_progress, on_message
            self.asha = asha

        def __getstate__(self) -> dict[str, Any]:  # Tune saves its state: the driver-side hooks stay out
            return {"progress": self.progress, "by_id": self.by_id, "asha": self.asha}

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state, on_progress=lambda p: None, on_message=lambda m: None)

        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.progress.running += 1
            self.on_progress(self.progress)

        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            if self.asha and not result.get(FINISHED_KEY):
                self.progress.round_reports += 1

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.progress.running -= 1
            last = trial.last_result or {}
            if self.asha and not last.get(FINISHED_KEY):  # ASHA stopped it after this round
                name = self.by_id[trial.config["trial"]][0]
                self.progress.stopped += 1
                self.progress.stops[name] = int(last.get("round", -1))
                self.progress.stop_metrics[name] = {k: float(v) for k, v in last.items()
                                                    if "/" in k and isinstance(v, (int, float))
                                                    and not isinstance(v, bool)}
                self.on_message(f"stopped by ASHA at round {self.progress.stops[name]}: {name}")
            else:
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


def _read_back(parent: Any, spec: SweepSpec,
               configs: list[Trial]) -> tuple[list[ConfigResult], list[tuple[str, int, float]]]:
    """Per-configuration results from the parent's children in MLflow (the sweep's ledger), and the
    trials ASHA stopped (child name, round, the ASHA metric there): neither a result nor a failure."""
    children = children_by_name(parent)
    results, stopped = [], []
    for trial in configs:
        res = ConfigResult(trial.label, trial.setting)
        for seed in spec.seeds:
            name = child_name(trial.label, seed)
            run = children.get(name)
            if run is not None and STOPPED_BY_TAG in run.data.tags and run.info.status != "FINISHED":
                metric = spec.asha.metric if spec.asha is not None else spec.metric
                stopped.append((name, int(run.data.tags.get(STOPPED_AT_TAG, -1)),
                                float(run.data.metrics.get(metric, math.nan))))
                continue
            if run is None or run.info.status != "FINISHED":
                res.failed.append(f"seed {seed}: " + ("not run" if run is None else run.info.status.lower()))
                continue
            add_logged_run(res, parent, run, spec)
        results.append(res)
    return results, stopped


def _log_stopped(parent: Any, spec: SweepSpec, stopped: list[tuple[str, int, float]]) -> None:
    """Add the trials ASHA stopped to the parent's results.md (after the table, which counts only the
    trials that ran all their rounds)."""
    metric = spec.asha.metric if spec.asha is not None else spec.metric
    path = parent.artifact_dir / "results.md"
    md = ["", f"## Stopped early by ASHA ({metric}, {spec.asha.mode if spec.asha else 'max'}; "
              f"not in the table above)", "", f"| trial | stopped at round | {metric} |", "|---|---|---|"]
    md += [f"| {name.replace('|', chr(92) + '|')} | {rnd} | {'–' if math.isnan(v) else f'{v:.4f}'} |"
           for name, rnd, v in stopped]
    with path.open("a") as f:
        f.write("\n".join(md) + "\n")
    parent.log_artifact(path)
    parent.log_metrics({"sweep/stopped_by_asha": float(len(stopped))}, step=0)
