"""Compare runs: final metrics (mean ± std over seeds) per configuration, and comparison plots.

``fedsim compare PARENT_RUN_ID`` reads a sweep's or claim check's children from MLflow, groups them
by configuration (the child run name without its ``| seed N``), prints a table of each metric's
final value and logs plots to the parent run under ``compare/``: the metric per round (mean over
seeds, ±1 std band) per configuration and, where ε is in the grid, the final metric against ε.

``fedsim compare --experiment NAME`` does the same for the top-level runs of ``fedsim run NAME``
(tag ``experiment``): runs are grouped by the params that differ between them (the seed excepted)
and the plots are written to ``--out`` (there is no parent run to log them to).

The same table and plots can be browsed side by side in the MLflow UI (``fedsim ui``): select the
children of a parent run and press *Compare*.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsim.errors import ConfigError
from fedsim.tracking import DERIVED_PARAMS_TAG
from fedsim.reproduce import EPS_KEY, ClaimSpec, ConfigResult, children_by_name

#: Metrics compared when none are named and the parent does not say which it was run for.
DEFAULT_METRICS = ("eval/accuracy",)
_SEED_SUFFIX = re.compile(r" \| seed (\d+)$")
#: Params that identify a run but are not part of its configuration.
_IGNORED_PARAMS = {"seed", "name", "description", "tracking.uri", "tracking.experiment", "engine.checkpoint_dir"}


@dataclass
class Comparison:
    """Runs grouped by configuration, ready to tabulate and plot."""

    title: str
    metrics: list[str]
    groups: dict[str, list[Any]]  # configuration label -> MLflow runs (one per seed)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> grid setting (for ε plots)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    parent_id: str | None = None


def _client(tracking_uri: str | None) -> Any:
    from fedsim.tracking import check_tracking_uri, mlflow_client, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    _check_store_exists(uri)
    check_tracking_uri(uri)
    return mlflow_client(uri)


def _check_store_exists(uri: str) -> None:
    """Comparing only reads: a sqlite store that does not exist is an error, not a new empty store."""
    from fedsim.store import sqlite_path

    path = sqlite_path(uri)
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"no MLflow store at {path} (nothing was recorded there); run from the directory "
                          f"of your runs or pass --tracking-uri")


def from_parent(parent_id: str, metrics: list[str] | None = None, tracking_uri: str | None = None) -> Comparison:
    """The children of a sweep / claim-check parent run, grouped by configuration."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        parent = client.get_run(parent_id)
    except MlflowException:
        raise ConfigError(f"no MLflow run {parent_id!r} in this store; find the parent's id with "
                          f"`fedsim ui` or pass --tracking-uri") from None
    holder = _Holder(client, parent.info.experiment_id, parent_id)
    children = [r for r in children_by_name(holder).values() if r.info.status == "FINISHED"]
    if not children:
        raise ConfigError(f"run {parent_id} has no finished child runs to compare (is it a sweep or "
                          f"claim-check parent?)")
    params = parent.data.params
    grid = _literal(params.get("grid")) or {}
    chosen = metrics or _parent_metrics(params) or list(DEFAULT_METRICS)
    groups: dict[str, list[Any]] = {}
    for run in sorted(children, key=lambda r: r.info.run_name):
        label = _SEED_SUFFIX.sub("", run.info.run_name)
        groups.setdefault(label, []).append(run)
    from fedsim.reproduce import label_of, settings

    known = {}
    if grid:
        try:
            known = {label_of(s): s for s in settings(ClaimSpec(experiment="", grid=grid))}
        except Exception:  # noqa: BLE001 - a truncated grid param: compare without ε plots
            known = {}
    title = params.get("claim") or parent.info.run_name
    return Comparison(title, chosen, groups, {k: v for k, v in known.items() if k in groups}, grid, parent_id)


def from_experiment(name: str, metrics: list[str] | None = None, tracking_uri: str | None = None) -> Comparison:
    """The finished top-level runs of ``fedsim run NAME``, grouped by the params that differ."""
    client = _client(tracking_uri)
    runs = []
    for exp in client.search_experiments():  # no filter on the name: one with quotes cannot inject a clause
        runs += client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                                   max_results=10000)
    runs = [r for r in runs if r.data.tags.get("experiment") == name and "mlflow.parentRunId" not in r.data.tags]
    if not runs:
        shown = name if len(name) <= 80 else name[:80] + "..."
        raise ConfigError(f"no finished runs of experiment {shown!r} in this store; run `fedsim run NAME` "
                          f"first, or give a parent run id")
    keys = set().union(*(r.data.params for r in runs)) - _IGNORED_PARAMS
    derived = set().union(*(_derived_params(r) for r in runs))
    varying = sorted(k for k in keys - derived if len({r.data.params.get(k) for r in runs}) > 1)
    short = _short_keys(varying)
    groups: dict[str, list[Any]] = {}
    for run in runs:
        label = ", ".join(f"{short[k]}={_short_value(run.data.params.get(k, '–'))}" for k in varying) or name
        groups.setdefault(label, []).append(run)
    return Comparison(name, metrics or list(DEFAULT_METRICS), groups)


_LEGACY_DERIVED_PREFIXES = ("data.size.",)  # runs recorded before the tag existed
_MAX_VALUE_CHARS = 24


def _derived_params(run: Any) -> set[str]:
    tagged = run.data.tags.get(DERIVED_PARAMS_TAG)
    if tagged is not None:
        return {k for k in tagged.split(",") if k}
    return {k for k in run.data.params if k.startswith(_LEGACY_DERIVED_PREFIXES)}


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its shortest unambiguous suffix (``client.lr`` -> ``lr``), for legends."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            cand = ".".join(parts[-n:])
            if sum(1 for other in keys if other == cand or other.endswith("." + cand)) == 1:
                out[key] = cand
                break
        else:
            out[key] = key
    return out


def _short_value(value: str) -> str:
    return value if len(value) <= _MAX_VALUE_CHARS else value[:_MAX_VALUE_CHARS - 1] + "…"


class _Holder:
    """The two attributes :func:`fedsim.reproduce.children_by_name` reads from a recorder."""

    def __init__(self, client: Any, experiment_id: str, run_id: str) -> None:
        self.client, self.experiment_id, self.run_id = client, experiment_id, run_id


def _literal(text: str | None) -> Any:
    """A logged ``str(dict)``/``str(list)`` param back as Python (``inf`` read as float infinity)."""
    if not text:
        return None
    try:
        return ast.literal_eval(re.sub(r"(?<![\w'\"])inf(?![\w'\"])", "1e309", text))  # 1e309 parses as inf
    except (ValueError, SyntaxError):
        return None  # e.g. truncated at MLflow's param length


def _parent_metrics(params: dict[str, str]) -> list[str]:
    out = [params["metric"]] if params.get("metric") else []
    extra = _literal(params.get("extra_metrics"))
    return out + [m for m in (extra or []) if isinstance(m, str)]


def results_for(cmp: Comparison, metric: str, client: Any) -> list[ConfigResult]:
    """One :class:`ConfigResult` per configuration: each seed's curve and final value of ``metric``."""
    out = []
    for label, runs in cmp.groups.items():
        res = ConfigResult(label, cmp.settings.get(label, {}))
        for run in runs:
            history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
            if history:
                res.add([m.value for m in history], 0)
            elif metric in run.data.metrics:
                res.add([run.data.metrics[metric]], 0)
        out.append(res)
    return out


def table_rows(cmp: Comparison, results: dict[str, list[ConfigResult]]) -> list[dict[str, str]]:
    rows = []
    for i, label in enumerate(cmp.groups):
        row = {"configuration": label, "runs": str(len(cmp.groups[label]))}
        for metric in cmp.metrics:
            r = results[metric][i]
            m, s = r.mean_std(r.finals)
            row[metric] = "–" if math.isnan(m) else f"{m:.4f} ± {s:.4f}"
        rows.append(row)
    return rows


def compare(cmp: Comparison, tracking_uri: str | None = None, out_dir: Path | None = None
            ) -> tuple[list[dict[str, str]], list[Path]]:
    """Tabulate every metric and draw its plots; log them to the parent run when there is one."""
    import tempfile

    from fedsim.plots import plot_claim
    from fedsim.reproduce import _metric_name

    client = _client(tracking_uri)
    results = {m: results_for(cmp, m, client) for m in cmp.metrics}
    rows = table_rows(cmp, results)
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="fedsim-compare-"))
    paths: list[Path] = []
    grid = cmp.grid if cmp.settings and len(cmp.settings) == len(cmp.groups) else {}
    for metric in cmp.metrics:
        if not any(r.curves for r in results[metric]):
            continue
        sub = out / _metric_name(metric).replace("/", "_")
        sub.mkdir(parents=True, exist_ok=True)
        spec = ClaimSpec(experiment="", grid=grid if EPS_KEY in grid else {}, metric=metric)
        paths += plot_claim(spec, results[metric], sub, title=f"{cmp.title}: {metric}")
    md = out / "comparison.md"
    cols = list(dict.fromkeys(k for row in rows for k in row))
    md.write_text("\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                            + ["| " + " | ".join(row.get(c, "") for c in cols) + " |" for row in rows]) + "\n")
    paths.append(md)
    if cmp.parent_id:
        for path in paths:
            rel = path.parent.relative_to(out)
            client.log_artifact(cmp.parent_id, str(path), "compare" + ("" if str(rel) == "." else f"/{rel}"))
    return rows, paths
