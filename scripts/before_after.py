"""Before/after: run each experiment's quick setting at two revisions and compare the metrics.

A refactor must leave results alone (issue #25: "every experiment's results, checked with a
before/after run of each experiment's quick setting").  This runs ``fedsim run NAME <quick>`` once
from a git worktree of ``--before`` and once from ``--after`` (default: this working tree), each
with its own MLflow store, and compares every metric's last value, key by key (timings, e.g. ``run/wall_seconds``, are left out).

    .venv/bin/python scripts/before_after.py --before acff2c8 [--only fedavg,imgda] [--timeout 600]

Both sides share one ``$FEDSIM_CACHE`` (pretrained tiny models are trained once).  The report
(``--out``, markdown) has one row per experiment: seconds on each side, metrics compared, how many
are bit-identical, the largest relative difference and the keys found on one side only.  A
difference is not necessarily a regression: commits between the revisions may change a result on
purpose; the report says what differs so that each difference can be matched to its commit.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the quick setting of each experiment: federated ones for 2 rounds, every other its default run
#: (each experiment's default is its quick run); the *_paper presets are paper scale, left out.
FEDERATED = ["fedavg", "fedavg_digits", "fedprox", "fedmut", "fedphoenix", "fedsvd", "centralised"]
QUICK: dict[str, list[str]] = {name: ["--rounds", "2"] for name in FEDERATED}
SKIPPED = {"fedsvd_paper", "fedphoenix_paper"}


@dataclass
class Side:
    """One experiment's run at one revision."""

    seconds: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


def experiments() -> list[str]:
    names = sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))
    return [n for n in names if n not in SKIPPED]


def worktree(rev: str) -> Path:
    """A detached worktree of ``rev`` under the temp dir (reused when it exists)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"fedsim-before-{sha}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def run(tree: Path, name: str, store: Path, timeout: float) -> Side:
    """``fedsim run`` of ``name`` from the code in ``tree``; its run's metrics from ``store``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "MLFLOW_DISABLE_TELEMETRY": "true", "FLWR_TELEMETRY_ENABLED": "0",
           "RAY_USAGE_STATS_ENABLED": "0"}
    uri = f"sqlite:///{store}"
    cmd = [sys.executable, "-m", "fedsim", "run", name, *QUICK.get(name, []), "--tracking-uri", uri, "--quiet"]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Side(seconds=timeout, error=f"timeout after {timeout:.0f} s")
    side = Side(seconds=time.perf_counter() - started)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        side.error = f"exit {done.returncode}: {tail[:160]}"
        return side
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)  # the store holds this run only (older --quiet printed no id)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        side.error = "no run recorded"
        return side
    side.metrics = dict(runs[0].data.metrics)
    return side


#: metrics that measure time, not results: listed, never compared
TIMING = re.compile(r"^timing/|seconds|wall|(^|[/_])time($|[/_])|latency|throughput|per_s(ec(ond)?)?($|[/_])|speed_?up|_ms($|/)")


def results_only(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not TIMING.search(k)}


def relative(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def row(name: str, before: Side, after: Side) -> str:
    if before.error or after.error:
        return (f"| {name} | {before.seconds:.0f} | {after.seconds:.0f} | – | – | – | "
                f"before: {before.error or 'ok'}; after: {after.error or 'ok'} |")
    before, after = Side(before.seconds, results_only(before.metrics)), Side(after.seconds, results_only(after.metrics))
    common = sorted(before.metrics.keys() & after.metrics.keys())
    diffs = {k: relative(before.metrics[k], after.metrics[k]) for k in common}
    same = sum(d == 0.0 for d in diffs.values())
    worst = sorted(diffs, key=diffs.get, reverse=True)[:3]
    worst_text = ", ".join(f"{k}: {before.metrics[k]:.4g}→{after.metrics[k]:.4g}" for k in worst if diffs[k] > 0)
    only = [f"before only: {len(before.metrics.keys() - after.metrics.keys())}",
            f"after only: {len(after.metrics.keys() - before.metrics.keys())}"]
    largest = max(diffs.values(), default=0.0)
    return (f"| {name} | {before.seconds:.0f} | {after.seconds:.0f} | {len(common)} | {same} | {largest:.2g} | "
            f"{worst_text or 'all identical'}; {', '.join(only)} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' side")
    parser.add_argument("--after", default="", help="git revision of the 'after' side (default: this working tree)")
    parser.add_argument("--only", default="", help="comma-separated experiment names (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    parser.add_argument("--out", default="before_after.md", help="markdown report (default before_after.md)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or experiments()
    unknown = sorted(set(names) - set(experiments()))
    if unknown:
        print(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(experiments())}", file=sys.stderr)
        return 2
    before_tree, after_tree = worktree(args.before), (worktree(args.after) if args.after else ROOT)
    work = Path(tempfile.mkdtemp(prefix="fedsim-before-after-"))
    lines = [f"Before: `{before_tree.name.removeprefix('fedsim-before-')}`; after: "
             f"`{after_tree.name.removeprefix('fedsim-before-') if args.after else 'working tree'}`.", "",
             "| experiment | s before | s after | metrics | identical | max rel. diff | largest differences |",
             "|---|---|---|---|---|---|---|"]
    out = Path(args.out)
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        before = run(before_tree, name, work / f"{name}-before.db", args.timeout)
        after = run(after_tree, name, work / f"{name}-after.db", args.timeout)
        lines.append(row(name, before, after))
        print("  " + lines[-1], flush=True)
        out.write_text("\n".join(lines) + "\n")  # written as it goes: an interrupted run keeps its rows
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
