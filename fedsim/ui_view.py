"""The default columns of `fedsim ui`'s runs table: a saved view of MLflow's UI, kept in the store.

MLflow 3's experiment page keeps the user's column choice in the browser (localStorage), but it also
has *saved views*, which live in the store as experiment tags ``mlflow.sharedViewState.<key>`` (the
"Views" menu of the runs page lists them; the page opens one when its address carries
``viewStateShareKey=<key>``). A tag's value is the envelope ``{"name", "createdAt", "updatedAt",
"state"}``, where ``state`` is the JSON of the page's UI state; the runs table shows the columns of
its ``selectedColumns``, each ``metrics.`KEY```, ``params.`KEY``` or ``attributes.`NAME```
(read from MLflow 3.17's JS bundle, ``mlflow/server/js/build``, and checked in a real browser by
tests/fedsim/test_ui_browser.py).

`fedsim ui` writes one such view, :data:`VIEW_KEY`, before the server starts: the headline metrics
that the experiment's runs logged and the params whose values differ between its runs, recomputed
from the store at each start. Only an MlflowClient is used here; nothing of fedsim's is imported.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

#: The saved view's key; its tag is ``TAG_PREFIX + VIEW_KEY`` on the experiment.
VIEW_KEY = "fedsim-default"
VIEW_NAME = "fedsim: headline metrics, params that differ"
TAG_PREFIX = "mlflow.sharedViewState."
#: Metrics shown when some run of the experiment logged them, in this order.
HEADLINE_METRICS = ("eval/accuracy", "privacy/epsilon_max", "eval/loss", "tta/acc_last_cycle")
#: Params that differ are shown in this order first, then the others by how many runs have them.
FIRST_PARAMS = ("strategy.name", "privacy.target_epsilon", "data.partition.alpha", "data.partition.name",
                "client.lr", "num_clients", "rounds", "seed")
MAX_PARAMS = 10
#: Params that are measured, not chosen (the data sizes that follow from the partition and the seed): never columns.
DERIVED_PREFIXES = ("data.size.",)
MAX_RUNS = 1000  # the most recent runs the columns are computed from


def differing_params(runs: list[Any], limit: int = MAX_PARAMS) -> list[str]:
    """The params that take more than one value among the runs that log them (a run without the
    param, such as a claim check's parent, does not count), ordered by :data:`FIRST_PARAMS`, then by
    how many runs log them, then by name; at most ``limit``. The data sizes (:data:`DERIVED_PREFIXES`)
    are left out: they differ with every seed but are not settings. (The runs table itself orders
    the columns by name within the Metrics and Parameters groups.)"""
    values: dict[str, set[str]] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for run in runs:
        for key, value in run.data.params.items():
            if key.startswith(DERIVED_PREFIXES):
                continue
            values[key].add(value)
            count[key] += 1
    differ = [k for k, v in values.items() if len(v) > 1]
    rank = {k: i for i, k in enumerate(FIRST_PARAMS)}
    return sorted(differ, key=lambda k: (rank.get(k, len(rank)), -count[k], k))[:limit]


def headline_metrics(runs: list[Any]) -> list[str]:
    """The :data:`HEADLINE_METRICS` that at least one of the runs logged."""
    logged = {key for run in runs for key in run.data.metrics}
    return [m for m in HEADLINE_METRICS if m in logged]


def default_columns(runs: list[Any]) -> list[str]:
    """The runs table's columns, in MLflow's canonical form (``metrics.`eval/accuracy```, ...)."""
    return ([f"metrics.`{m}`" for m in headline_metrics(runs)]
            + [f"params.`{p}`" for p in differing_params(runs)])


def write_default_view(client: Any, experiment_id: str) -> list[str]:
    """Write (or refresh) the saved view :data:`VIEW_KEY` on the experiment; return its columns."""
    runs = client.search_runs([experiment_id], max_results=MAX_RUNS)
    columns = default_columns(runs)
    tag = TAG_PREFIX + VIEW_KEY
    now = int(time.time() * 1000)
    created = now
    old = client.get_experiment(experiment_id).tags.get(tag)
    if old:
        try:
            created = int(json.loads(old)["createdAt"])
        except (ValueError, KeyError, TypeError):
            pass
    state = {"selectedColumns": columns}
    envelope = {"name": VIEW_NAME, "createdAt": created, "updatedAt": now, "state": json.dumps(state)}
    client.set_experiment_tag(experiment_id, tag, json.dumps(envelope))
    return columns


__all__ = ["VIEW_KEY", "VIEW_NAME", "TAG_PREFIX", "HEADLINE_METRICS", "differing_params", "headline_metrics",
           "default_columns", "write_default_view"]
