"""The claim protocol of a claim spec: claims, controls, references and tuning (schema and checks).

The optional sections of ``experiments/reproduce/<name>.yaml`` (see :mod:`fedsim.reproduce`)::

    claim:                                  # one mapping or a list of them
      - better: {strategy.name: fedsvd}     # grid keys -> values; with ``at`` they pick ONE configuration
        worse: {strategy.name: ffa_lora}
        at: {eps: 3}
        metric: eval/accuracy               # default: the spec's metric
        margin: 0.01                        # superiority: mean(better - worse) > margin
      - {kind: equivalence, better: {...}, worse: {...}, margin: 0.02}   # |a - b| < margin
      - {better: {...}, worse: {...}, needs: ["Tent degrades"]}   # gated by these controls only (names)
      - at: {params.num_tasks: 3}           # two metrics of one configuration (a centralised run that
        better_metric: adapt/acc/lora_ml    # evaluates every method itself): better/worse may then be
        worse_metric: adapt/acc/retrain     # empty, and both sides may pick the same configuration
      - at: {params.num_tasks: 3}           # one configuration against a constant (a theory's value):
        metric: recovery/sym_err            # the interval is then a one-sample interval on the mean
        worse_value: 1.0e-3                 # of (value_i - constant); ``worse`` stays empty
        higher_is_better: false
    controls:
      positive:                             # comparisons whose outcome is known; one failing -> invalid
                                            # (every claim, or only the claims whose ``needs`` name it)
        - {better: {strategy.name: ffa_lora}, worse: {strategy.name: fedavg_lora}, at: {eps: 1}}
      floor: {value: 0.1, source: "chance, 10 classes"}        # or {setting: {...}} / {overrides: [...]}
      ceiling: {value: 0.68, source: "centralised non-private probe, issue #24"}
    tune:                                   # per-method grid, selected on a validation metric
      by: strategy.name
      grid: {client.lr: [0.1, 0.5, 1.0]}
      methods: {fedsvd: {client.lr: [0.5, 1.0, 2.0]}}          # a method's own grid replaces ``grid``
      metric: val/accuracy
      seeds: [0]                            # default: the spec's first seed
      at: {eps: 3}                          # tune only there (default: every configuration of the method)
    confidence: 0.95
    interval: t                             # t | bootstrap
    minutes_per_run: 2.5                    # optional, for ``--plan``

A reference is a constant (with its ``source``), a grid configuration (``setting``) or an extra
configuration run on every seed (``overrides`` on top of the spec's). This module is pure: it
validates, matches claim sides to configurations and computes the verdict rows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from fedsim import claims as V
from fedsim.errors import ConfigError


@dataclass
class Comparison:
    """One claim or positive control: ``better`` beats ``worse`` (or equals it) at ``at``."""

    better: dict[str, Any] = field(default_factory=dict)
    worse: dict[str, Any] = field(default_factory=dict)
    at: dict[str, Any] = field(default_factory=dict)
    metric: Optional[str] = None  # default: the spec's metric
    better_metric: Optional[str] = None  # the better side's metric (default: ``metric``)
    worse_metric: Optional[str] = None  # the worse side's metric (default: ``metric``)
    worse_value: Optional[float] = None  # the worse side is this constant (a theory's value), not a run
    margin: float = 0.0
    kind: str = V.SUPERIORITY  # superiority | equivalence
    higher_is_better: bool = True
    name: str = ""  # shown instead of the built text
    #: A claim's premises: the names of the positive controls it depends on (default: every control).
    #: A claim that a failed control does not concern keeps its verdict.
    needs: list[str] = field(default_factory=list)

    def metrics(self, spec_metric: str) -> tuple[str, ...]:
        """The metrics the comparison reads: (better side's, worse side's), or (better side's,)
        against a constant."""
        default = self.metric or spec_metric
        better = self.better_metric or default
        return (better,) if self.against_constant else (better, self.worse_metric or default)

    @property
    def against_constant(self) -> bool:
        return self.worse_value is not None

    @property
    def two_metrics(self) -> bool:
        """Two metrics of runs (of one configuration or two), not one metric or a constant."""
        return bool(self.better_metric or self.worse_metric) and not self.against_constant


@dataclass
class Reference:
    """A floor or ceiling: a constant with its source, a grid configuration, or an extra configuration."""

    value: Optional[float] = None
    source: str = ""
    setting: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)


@dataclass
class Controls:
    positive: list[Comparison] = field(default_factory=list)
    floor: Optional[Reference] = None
    ceiling: Optional[Reference] = None


@dataclass
class TuneSpec:
    """Per-method hyper-parameter search on a validation metric."""

    by: str = "strategy.name"
    grid: dict[str, list[Any]] = field(default_factory=dict)
    methods: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    metric: str = "val/accuracy"
    higher_is_better: bool = True
    seeds: Optional[list[int]] = None
    at: dict[str, Any] = field(default_factory=dict)


def normalise_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """Accept a single mapping where a list is meant (``claim:``, ``controls.positive:``)."""
    raw = dict(raw)
    if isinstance(raw.get("claim"), dict):
        raw["claim"] = [raw["claim"]]
    controls = raw.get("controls")
    if isinstance(controls, dict) and isinstance(controls.get("positive"), dict):
        raw["controls"] = {**controls, "positive": [controls["positive"]]}
    return raw


# -- matching -----------------------------------------------------------------------------------
def _same(want: Any, have: Any) -> bool:
    """Does a claim's value pick a grid value? A name picks a mapping with that ``name``."""
    if isinstance(have, dict) and not isinstance(want, dict):
        return have.get("name") == want
    if isinstance(want, (int, float)) and isinstance(have, (int, float)) and not isinstance(want, bool):
        return float(want) == float(have)
    if want is None or have is None:  # eps: null and .inf both mean no DP
        other = have if want is None else want
        return other is None or (isinstance(other, float) and math.isinf(other))
    return want == have


def matches(setting: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(k in setting and _same(v, setting[k]) for k, v in want.items())


def pick(grid: list[dict[str, Any]], want: dict[str, Any], what: str) -> int:
    """The index of the one grid configuration matching ``want``; anything else is an error."""
    unknown = [k for k in want if not grid or k not in grid[0]]
    if unknown:
        raise ConfigError(f"{what}: {unknown[0]!r} is not a grid key; claims pick configurations by grid keys")
    hits = [i for i, s in enumerate(grid) if matches(s, want)]
    if len(hits) != 1:
        raise ConfigError(f"{what}: {dict(want)} matches {len(hits)} configurations, not one; "
                          "add the missing grid keys to it or to `at`")
    return hits[0]


def read_configurations(spec: Any, grid: list[dict[str, Any]]) -> set[int]:
    """Indices of the grid configurations some claim, control or reference reads (the rest only cost time)."""
    read: set[int] = set()
    for i, comp in enumerate([*spec.claim, *spec.controls.positive]):
        what = f"comparison {i + 1}"
        read.add(pick(grid, {**comp.at, **comp.better}, what))
        if not comp.against_constant:
            read.add(pick(grid, {**comp.at, **comp.worse}, what))
    for role in ("floor", "ceiling"):
        ref = getattr(spec.controls, role)
        if ref is not None and ref.setting:
            read.add(pick(grid, ref.setting, f"controls.{role}"))
    return read


def method_of(setting: dict[str, Any], key: str) -> str:
    value = setting[key]
    return str(value.get("name", value)) if isinstance(value, dict) else str(value)


def tune_candidates(tune: TuneSpec, method: str) -> list[dict[str, Any]]:
    """Every combination of the method's grid (its own under ``methods``, else ``grid``)."""
    grid = tune.methods.get(method, tune.grid)
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def candidate_text(candidate: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in candidate.items())


# -- validation ---------------------------------------------------------------------------------
def validate_protocol(spec: Any, grid: list[dict[str, Any]], path: str) -> None:
    """One-line errors for a claim spec's protocol sections (called after the spec loads)."""
    if not 0.0 < spec.confidence < 1.0:
        raise ConfigError(f"{path}: confidence must be in (0, 1), got {spec.confidence}")
    if spec.interval not in V.INTERVALS:
        raise ConfigError(f"{path}: interval must be one of {', '.join(V.INTERVALS)}, got {spec.interval!r}")
    if spec.minutes_per_run is not None and spec.minutes_per_run <= 0:
        raise ConfigError(f"{path}: minutes_per_run must be > 0, got {spec.minutes_per_run}")
    for i, comp in enumerate(spec.claim):
        _check_comparison(comp, grid, f"{path}: claim {i + 1}")
    for i, comp in enumerate(spec.controls.positive):
        _check_comparison(comp, grid, f"{path}: controls.positive {i + 1}")
        if comp.needs:
            raise ConfigError(f"{path}: controls.positive {i + 1}: `needs` belongs to claims (the controls they "
                              "depend on), not to a control")
    names = [c.name for c in spec.controls.positive]
    for i, comp in enumerate(spec.claim):
        unknown = [n for n in comp.needs if n not in names]
        if unknown:
            known = ", ".join(repr(n) for n in names if n) or "none (give the controls a `name`)"
            raise ConfigError(f"{path}: claim {i + 1} needs {unknown[0]!r}, which names no positive control; "
                              f"named controls: {known}")
    for role in ("floor", "ceiling"):
        ref = getattr(spec.controls, role)
        if ref is not None:
            _check_reference(ref, grid, f"{path}: controls.{role}")
    if spec.tune is not None:
        _check_tune(spec.tune, spec, grid, f"{path}: tune")


def _check_comparison(comp: Comparison, grid: list[dict[str, Any]], what: str) -> None:
    if comp.kind not in (V.SUPERIORITY, V.EQUIVALENCE):
        raise ConfigError(f"{what}: kind must be {V.SUPERIORITY} or {V.EQUIVALENCE}, got {comp.kind!r}")
    if comp.against_constant:
        if comp.worse or comp.worse_metric:
            raise ConfigError(f"{what}: with worse_value the worse side is that constant; drop `worse` / worse_metric")
        if not math.isfinite(comp.worse_value):
            raise ConfigError(f"{what}: worse_value must be a finite number, got {comp.worse_value}")
        pick(grid, {**comp.at, **comp.better}, f"{what} `better`")
        return
    if not comp.two_metrics and (not comp.better or not comp.worse):
        raise ConfigError(f"{what}: needs both `better` and `worse` (grid keys -> values)")
    if comp.kind == V.EQUIVALENCE and comp.margin <= 0:
        raise ConfigError(f"{what}: an equivalence claim needs a margin > 0, got {comp.margin}")
    b = pick(grid, {**comp.at, **comp.better}, f"{what} `better`")
    w = pick(grid, {**comp.at, **comp.worse}, f"{what} `worse`")
    if b == w and (not comp.two_metrics or comp.better_metric == comp.worse_metric):
        raise ConfigError(f"{what}: `better` and `worse` pick the same configuration"
                          + (" and the same metric" if comp.two_metrics else ""))


def _check_reference(ref: Reference, grid: list[dict[str, Any]], what: str) -> None:
    given = [ref.value is not None, bool(ref.setting), bool(ref.overrides)]
    if sum(given) != 1:
        raise ConfigError(f"{what}: give exactly one of value (with source), setting or overrides")
    if ref.value is not None and not ref.source.strip():
        raise ConfigError(f"{what}: a constant reference needs its source (where the value was measured)")
    if ref.setting:
        pick(grid, ref.setting, what)


def _check_tune(tune: TuneSpec, spec: Any, grid: list[dict[str, Any]], what: str) -> None:
    if not tune.metric.startswith("val/"):
        raise ConfigError(f"{what}.metric must be a validation metric (val/...), got {tune.metric!r}: "
                          "tuning on the test metric would bias the verdict")
    if tune.by not in spec.grid:
        raise ConfigError(f"{what}.by: {tune.by!r} is not a grid key (the key that names a method)")
    methods = {method_of(s, tune.by) for s in grid}
    unknown = sorted(set(tune.methods) - methods)
    if unknown:
        raise ConfigError(f"{what}.methods: {unknown[0]!r} is not a value of {tune.by} in the grid")
    for method in methods:
        g = tune.methods.get(method, tune.grid)
        if not g:
            raise ConfigError(f"{what}: no grid for method {method!r}; set tune.grid or tune.methods.{method}")
        for key, values in g.items():
            if key in spec.grid:
                raise ConfigError(f"{what}: {key!r} is a claim grid key; tune keys must not be")
            if not isinstance(values, list) or not values:
                raise ConfigError(f"{what}: {key} needs a non-empty list of values")
    if tune.seeds is not None and not tune.seeds:
        raise ConfigError(f"{what}.seeds is empty")
    if tune.at and not any(matches(s, tune.at) for s in grid):
        raise ConfigError(f"{what}.at: {dict(tune.at)} matches no configuration")
    for method in sorted(methods):
        if not any(matches(s, tune.at) and method_of(s, tune.by) == method for s in grid):
            raise ConfigError(f"{what}.at: no configuration of {tune.by}={method} matches {dict(tune.at)}, so "
                              f"{method} would run untuned; widen `at` or keep that combination in the grid")


# -- verdicts -----------------------------------------------------------------------------------
def comparison_text(comp: Comparison, spec_metric: str) -> str:
    """``a > b by m on metric at k=v`` (or ``|a − b| < m ...``), unless the spec names it.

    Two metrics put each side's metric beside its side; a constant is the worse side, the better
    side's configuration joins ``at`` and a zero margin is left out.
    """
    if comp.name:
        return comp.name
    from fedsim.reproduce import label_of

    metrics = comp.metrics(spec_metric)
    a, b, on, where_parts = label_of(comp.better), label_of(comp.worse), f" on {metrics[0]}", [label_of(comp.at)]
    by = f" by {comp.margin:g}"
    if comp.against_constant:
        a, b, on, where_parts = metrics[0], f"{comp.worse_value:g}", "", [label_of(comp.better), *where_parts]
        by = by if comp.margin else ""
    elif comp.two_metrics:
        a, b, on = (" ".join(x for x in (a, metrics[0]) if x), " ".join(x for x in (b, metrics[1]) if x), "")
    where = ", ".join(x for x in where_parts if x)
    where = f" at {where}" if where else ""
    if comp.kind == V.EQUIVALENCE:
        return f"|{a} − {b}| < {comp.margin:g}{on}{where}"
    return f"{a} {'>' if comp.higher_is_better else '<'} {b}{by}{on}{where}"


def per_seed(result: Any, metric: str, spec_metric: str) -> dict[int, float]:
    """One configuration's final value of ``metric`` per seed."""
    values = result.finals if metric == spec_metric else result.extras.get(metric, [])
    return dict(zip(result.seeds, values))


@dataclass
class VerdictRow:
    role: str  # "claim" or "control"
    text: str
    metric: str
    verdict: V.Verdict
    control: str  # passed | failed | "" (a control row)

    def as_row(self) -> dict[str, str]:
        iv = self.verdict.interval
        return {"kind": self.role, "claim": self.text,
                "difference": self.verdict.reason or iv.text(),
                "interval": f"{iv.confidence:.0%} {'paired t' if iv.method == 't' else 'percentile bootstrap'}, "
                            f"{iv.n} paired seeds",
                "verdict": self.verdict.verdict, "control": self.control or "–",
                "to decide": self.verdict.decide_text() or "–"}

    def as_csv(self) -> dict[str, Any]:
        iv = self.verdict.interval
        return {"kind": self.role, "claim": self.text, "metric": self.metric, "mean_difference": iv.mean,
                "ci_low": iv.lo, "ci_high": iv.hi, "interval": iv.method, "confidence": iv.confidence,
                "seeds": iv.n, "margin": self.verdict.margin, "claim_kind": self.verdict.kind,
                "verdict": self.verdict.verdict, "control": self.control,
                "seeds_to_decide": self.verdict.decide_text(), "no_data": self.verdict.reason}


def _evaluate(spec: Any, comp: Comparison, grid_results: list[Any], what: str, controls_passed: bool,
              role: str, control: str) -> VerdictRow:
    grid = [r.setting for r in grid_results]
    metrics = comp.metrics(spec.metric)
    metric = " − ".join(metrics) if comp.two_metrics else metrics[0]
    better = grid_results[pick(grid, {**comp.at, **comp.better}, what)]
    better_values = per_seed(better, metrics[0], spec.metric)
    if comp.against_constant:
        worse_values = {seed: float(comp.worse_value) for seed in better_values}
    else:
        worse = grid_results[pick(grid, {**comp.at, **comp.worse}, what)]
        worse_values = per_seed(worse, metrics[1], spec.metric)
    try:
        _, d = V.paired_differences(better_values, worse_values, higher_is_better=comp.higher_is_better,
                                    what=what)
    except ConfigError as exc:  # a failed run or a never-reached metric: this row only, not the table
        verdict = V.no_data(str(exc), comp.margin, kind=comp.kind, confidence=spec.confidence,
                            method=spec.interval)
        return VerdictRow(role, comparison_text(comp, spec.metric), metric, verdict, control)
    verdict = V.decide(d, comp.margin, kind=comp.kind, confidence=spec.confidence, method=spec.interval,
                       seed=0, controls_passed=controls_passed)
    return VerdictRow(role, comparison_text(comp, spec.metric), metric, verdict, control)


def verdict_rows(spec: Any, results: list[Any]) -> list[VerdictRow]:
    """The controls first (a control passes when it holds), then every claim (``invalid`` if a control it
    needs failed: those its ``needs`` names, else every control).

    A comparison a seed has no value for gets its own ``no data`` row (a control without data has not
    passed); the other rows are still decided.
    """
    grid_results = [r for r in results if not r.role]
    controls = [_evaluate(spec, c, grid_results, f"controls.positive {i + 1}", True, "control", "")
                for i, c in enumerate(spec.controls.positive)]
    held = {i: row.verdict.verdict == V.HOLDS for i, row in enumerate(controls)}
    claims = []
    for i, c in enumerate(spec.claim):
        needed = [j for j, ctl in enumerate(spec.controls.positive) if not c.needs or ctl.name in c.needs]
        passed = all(held[j] for j in needed)
        control = ("passed" if passed else "failed") if needed else "none"
        claims.append(_evaluate(spec, c, grid_results, f"claim {i + 1}", passed, "claim", control))
    return controls + claims


def reference_values(spec: Any, results: list[Any]) -> dict[str, tuple[float, str]]:
    """``{"floor"|"ceiling": (value, where it comes from)}`` for the declared references."""
    out: dict[str, tuple[float, str]] = {}
    grid_results = [r for r in results if not r.role]
    for role in ("floor", "ceiling"):
        ref = getattr(spec.controls, role)
        if ref is None:
            continue
        if ref.value is not None:
            out[role] = (float(ref.value), f"constant: {ref.source}")
            continue
        if ref.setting:
            res = grid_results[pick([r.setting for r in grid_results], ref.setting, f"controls.{role}")]
            source = f"configuration {res.label}"
        else:
            res = next(r for r in results if r.role == role)
            source = f"run with {' '.join(ref.overrides)}"
        finals = [v for v in res.finals if not math.isnan(v)]
        out[role] = (float(np.mean(finals)) if finals else float("nan"), f"{source} (mean of {len(finals)} seeds)")
    return out
