"""What an ``imgda`` run reports: the set-up summary and class-size histogram, the final report
(rounds selected by source-validation macro-F1 and by target-test micro-F1) and its files (the
F1-per-round and per-class figures of :mod:`clients.graph.plots`, a per-round CSV table).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clients.graph.environment import GraphEnvironment

if TYPE_CHECKING:
    from fedsim.contracts.history import History

__all__ = ["eval_rows", "report_files", "select_rounds", "setup_artifacts", "setup_summary", "write_rounds_csv"]

#: (round, metrics) of every evaluated round.
Rows = list[tuple[int, dict[str, float]]]
#: selection name -> its (round, metrics).
Picks = dict[str, tuple[int, dict[str, float]]]


def setup_summary(env: GraphEnvironment) -> dict[str, Any]:
    """Node counts, head/tail classes and each source node's class sizes."""
    t = env.task
    head, tail = env.head_tail()
    out: dict[str, Any] = {"gda.target_nodes": t.target.num_nodes, "gda.source_eval_nodes": t.source_eval.num_nodes,
                           "gda.head_classes": "/".join(map(str, head)), "gda.tail_classes": "/".join(map(str, tail))}
    for i, s in enumerate(t.sources):
        out[f"gda.source{i}.nodes"] = s.num_nodes
        out[f"gda.source{i}.class_sizes"] = "/".join(map(str, s.sizes))
    return out


def setup_artifacts(env: GraphEnvironment, out_dir: Path) -> list[Path]:
    """The histogram of the long-tailed source class sizes per source node."""
    from envs.plots import plot_label_histogram

    hist = np.asarray([s.sizes for s in env.task.sources])
    return [plot_label_histogram(hist, out_dir / "gda_class_sizes.png",
                                 title=f"long-tailed source class sizes per source node (rho={env.params.imbalance:g})")]


def eval_rows(history: History) -> Rows:
    """(round, metrics) of the rounds ``>= 1`` the server evaluated."""
    return [(r.round, r.metrics) for r in history.records if r.round >= 1 and "eval/target_macro_f1" in r.metrics]


def select_rounds(rows: Rows, num_classes: int, selection: str) -> tuple[dict[str, float], Picks]:
    """The report's finite metrics (each selection's round and scores, the last round's, the headline
    of ``selection`` and the selection optimism) and the selected rows."""
    picks = {"source_val": _argmax(rows, "eval/source_val_macro_f1"), "target_test": _argmax(rows, "eval/target_micro_f1")}
    keys = ["target_macro_f1", "target_micro_f1", "target_head_f1", "target_tail_f1", "source_val_macro_f1",
            *(f"target_f1_c{k}" for k in range(num_classes))]
    metrics: dict[str, float] = {}
    for name, (rnd, m) in picks.items():
        metrics[f"gda/{name}/round"] = float(rnd)
        metrics.update({f"gda/{name}/{k}": m[f"eval/{k}"] for k in keys if f"eval/{k}" in m})
    last = rows[-1][1]
    metrics.update({f"gda/last/{k}": last[f"eval/{k}"] for k in keys[:4] if f"eval/{k}" in last})
    metrics.update({f"gda/{k}": metrics[f"gda/{selection}/{k}"] for k in keys[:4] if f"gda/{selection}/{k}" in metrics})
    metrics["gda/selection_optimism"] = metrics["gda/target_test/target_macro_f1"] - metrics["gda/source_val/target_macro_f1"]
    return {k: float(v) for k, v in metrics.items() if math.isfinite(v)}, picks


def report_files(env: GraphEnvironment, rows: Rows, picks: Picks, out_dir: Path) -> list[Path]:
    """The F1-per-round and per-class figures and the per-round table, written to ``out_dir``."""
    from clients.graph.plots import plot_class_f1, plot_f1_rounds
    from fedsim.metrics.plots import save

    t, p = env.task, env.params
    _, tail = env.head_tail()
    title = (f"{p.method}: rho={p.imbalance:g}, {env.cfg.num_clients} node(s), "
             f"{p.epochs_per_round} epochs/round, seed {env.cfg.seed}")
    rounds = [r for r, _ in rows]
    names = {"target macro-F1": "eval/target_macro_f1", "target tail F1": "eval/target_tail_f1",
             "target head F1": "eval/target_head_f1", "source val macro-F1": "eval/source_val_macro_f1"}
    series = {label: [m.get(k, math.nan) for _, m in rows] for label, k in names.items()}
    files = [save(plot_f1_rounds(rounds, series, {k: v[0] for k, v in picks.items()}, title),
                  out_dir / "gda_f1_rounds.png")]
    per_class = {f"selected by {name} (round {r})": [m.get(f"eval/target_f1_c{k}", math.nan) for k in range(t.num_classes)]
                 for name, (r, m) in picks.items()}
    files.append(save(plot_class_f1(per_class, t.pooled_sizes(), tail, title), out_dir / "gda_class_f1.png"))
    files.append(write_rounds_csv(rows, out_dir / "gda_rounds.csv"))
    return files


def write_rounds_csv(rows: Rows, path: Path) -> Path:
    """One line per round, one column per ``eval/`` metric (sorted); a missing value is empty."""
    keys = sorted({k for _, m in rows for k in m if k.startswith("eval/")})
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", *keys])
        for r, m in rows:
            w.writerow([r, *(m.get(k, "") for k in keys)])
    return path


def _argmax(rows: Rows, key: str) -> tuple[int, dict[str, float]]:
    """The first round with the largest ``key`` (NaN counts as lowest)."""
    best = max(range(len(rows)), key=lambda i: (_finite(rows[i][1].get(key, math.nan)), -i))
    return rows[best]


def _finite(v: float) -> float:
    return v if math.isfinite(v) else -math.inf
