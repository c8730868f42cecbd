"""The benchmark tables of ``docs/measurements.md``, generated from the benchmarks' ``--csv`` output.

* ``engine``: ``benchmarks/bench_engine.py --csv`` files ``docs/perf/engine*.csv``;
* ``ray`` (where the document has its markers): ``benchmarks/bench_ray_scaleout.py --csv`` files
  ``docs/perf/ray-scaleout*.csv``, one row per workload and cluster shape;
* ``vectorise`` (where the document has its markers): ``benchmarks/bench_vectorise.py --csv`` files
  ``docs/perf/vectorise*.csv``, one row per (DP or not, device, model, clients) summarising its grid points.

The benchmark's CSV files are kept in ``docs/perf/`` (one per run; a later file's rows replace an
earlier one's for the same workload and system).  The table between the ``<!-- perf:engine -->``
markers is rendered from them, never edited by hand:

    python benchmarks/bench_engine.py --workloads mlp-100,mlp-1000 --repeat 3 --csv docs/perf/engine-YYYY-MM-DD.csv
    python benchmarks/bench_ray_scaleout.py --csv docs/perf/ray-scaleout-YYYY-MM-DD.csv
    python scripts/perf_table.py            # rewrite the tables in docs/measurements.md
    python scripts/perf_table.py --check    # exit 1 if the table is not what the CSV files give
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- perf:engine start -->", "<!-- perf:engine end -->"
COLUMNS = ("workload", "system", "total s", "s/round 2..R", "fedsim/raw", "stock Flower/fedsim", "note", "source")


def read_rows(files: list[Path]) -> list[dict[str, str]]:
    """Rows of every CSV, in file-name order; a later file's row replaces an earlier (workload, system)."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for path in sorted(files):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                missing = {"workload", "system", "system_name", "total_s"} - set(row)
                if missing:
                    raise ValueError(f"{path}: not a bench_engine.py --csv file (no {', '.join(sorted(missing))} column)")
                rows[(row["workload"], row["system"])] = {**row, "source": path.name}
    return sorted(rows.values(), key=lambda r: _workload_key(r["workload"]))  # stable: systems keep their order


def _workload_key(name: str) -> tuple[str, int]:
    """Workloads by model name, then by client count (``mlp-100`` before ``mlp-1000``)."""
    model, _, clients = name.partition("-")
    return model, int(clients) if clients.isdigit() else 0


def _num(text: str, fmt: str, suffix: str = "") -> str:
    return "" if text in ("", None) else f"{float(text):{fmt}}{suffix}"


def _ratio(r: dict[str, str]) -> str:
    """fedsim/raw, with its confidence interval where the CSV has one (``--repeat`` > 1, paired runs)."""
    ratio = _num(r.get("fedsim_over_raw", ""), ".2f")
    low, high, cov = (r.get(k, "") for k in ("ratio_ci_low", "ratio_ci_high", "ratio_ci_coverage"))
    if not ratio or not low or not high:
        return ratio
    return f"{ratio} [{float(low):.2f}–{float(high):.2f}]" + (f" ({float(cov):.0%}, {r.get('runs')} runs)" if cov else "")


def render(rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        total = "n/a" if r["total_s"] == "" else _num(r["total_s"], ".2f")
        lines.append("| " + " | ".join([
            r["workload"], r["system_name"], total, _num(r.get("later_round_s", ""), ".3f"),
            _ratio(r), _num(r.get("flower_over_fedsim", ""), ".1f", "x"),
            r.get("note", ""), f"`{r['source']}`"]) + " |")
    return "\n".join(lines)


def updated(doc: str, table: str, start: str = START, end: str = END) -> str:
    if start not in doc or end not in doc:
        raise ValueError(f"the document has no {start} ... {end} block")
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


RAY_START, RAY_END = "<!-- perf:ray start -->", "<!-- perf:ray end -->"
RAY_COLUMNS = ("workload", "local work per client", "local s/round", "ray s/round, 1 call/task", "local/ray",
               "ray s/round, batched", "local/ray batched", "efficiency batched", "ray start-up s", "cluster", "source")


def read_ray_rows(files: list[Path]) -> list[dict[str, str]]:
    """Rows of every ray-scaleout CSV; a later file's row replaces an earlier one of the same workload and cluster."""
    rows: dict[tuple[str, ...], dict[str, str]] = {}
    for path in sorted(files):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if {"workload", "local_s", "ray_s", "ray_batched_s"} - set(row):
                    raise ValueError(f"{path}: not a bench_ray_scaleout.py --csv file")
                key = (row["workload"], row["nodes"], row["cpus_per_node"], row["clients"])
                rows[key] = {**row, "source": path.name}
    return list(rows.values())


def render_ray(rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(RAY_COLUMNS) + " |", "|" + "---|" * len(RAY_COLUMNS)]
    for r in rows:
        local, plain, batched = float(r["local_s"]), float(r["ray_s"]), float(r["ray_batched_s"])
        lines.append("| " + " | ".join([
            r["workload"], f"{float(r['ms_per_client']):.1f} ms", f"{local:.3f}", f"{plain:.3f}", f"{local / plain:.2f}",
            f"{batched:.3f} ({r['calls_per_task']} calls/task)", f"{local / batched:.2f}",
            f"{local / batched / int(r['actors']):.2f}", f"{float(r['ray_startup_s']):.1f}",
            f"{r['nodes']} × {r['cpus_per_node']} CPU, {r['clients']} clients", f"`{r['source']}`"]) + " |")
    return "\n".join(lines)


VEC_START, VEC_END = "<!-- perf:vectorise start -->", "<!-- perf:vectorise end -->"
VEC_COLUMNS = ("DP-SGD", "device", "model", "clients", "points", "sequential / vectorised: min", "median", "max",
               "auto vectorises", "auto wrong", "source")


def read_vectorise_rows(files: list[Path]) -> list[dict[str, str]]:
    """Grid points of every vectorise CSV; a later file's point replaces an earlier one's."""
    points: dict[tuple[str, ...], dict[str, str]] = {}
    for path in sorted(files):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if {"model", "clients", "sequential_s", "vectorised_s", "auto_vectorises", "verdict"} - set(row):
                    raise ValueError(f"{path}: not a bench_vectorise.py --csv file")
                key = tuple(row.get(k, "") for k in ("dp", "device", "model", "clients", "per_client", "batch_size",
                                                     "optimizer"))
                points[key] = {**row, "source": path.name}
    return list(points.values())


def render_vectorise(points: list[dict[str, str]]) -> str:
    import statistics

    groups: dict[tuple[str, str, str, int], list[dict[str, str]]] = {}
    for pt in points:
        groups.setdefault((pt.get("dp", "0"), pt.get("device", "cpu"), pt["model"], int(pt["clients"])), []).append(pt)
    lines = ["| " + " | ".join(VEC_COLUMNS) + " |", "|" + "---|" * len(VEC_COLUMNS)]
    for (dp, device, model, clients), group in sorted(groups.items()):
        ratios = [float(g["sequential_s"]) / float(g["vectorised_s"]) for g in group]
        sources = sorted({g["source"] for g in group})
        lines.append("| " + " | ".join([
            "yes" if dp == "1" else "no", device, model, str(clients), str(len(group)), f"{min(ratios):.2f}",
            f"{statistics.median(ratios):.2f}", f"{max(ratios):.2f}",
            str(sum(g["auto_vectorises"] == "1" for g in group)), str(sum(g["verdict"] == "WRONG" for g in group)),
            ", ".join(f"`{s}`" for s in sources)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv-dir", type=Path, default=ROOT / "docs" / "perf", help="where the CSV files are")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "measurements.md", help="the document to update")
    ap.add_argument("--check", action="store_true", help="exit 1 if the table differs from what the CSVs give")
    args = ap.parse_args(argv)
    try:
        files = list(args.csv_dir.glob("engine*.csv"))
        if not files:
            raise ValueError(f"no engine*.csv files in {args.csv_dir}; run benchmarks/bench_engine.py --csv first")
        doc = args.doc.read_text()
        new = updated(doc, render(read_rows(files)))
        if RAY_START in new:
            ray_files = list(args.csv_dir.glob("ray-scaleout*.csv"))
            if not ray_files:
                raise ValueError(f"no ray-scaleout*.csv files in {args.csv_dir}; run benchmarks/bench_ray_scaleout.py --csv")
            new = updated(new, render_ray(read_ray_rows(ray_files)), RAY_START, RAY_END)
        if VEC_START in new:
            vec_files = list(args.csv_dir.glob("vectorise*.csv"))
            if not vec_files:
                raise ValueError(f"no vectorise*.csv files in {args.csv_dir}; run benchmarks/bench_vectorise.py --csv")
            new = updated(new, render_vectorise(read_vectorise_rows(vec_files)), VEC_START, VEC_END)
    except (OSError, ValueError) as exc:
        print(f"perf_table: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if new != doc:
            print(f"perf_table: {args.doc} is out of date; run python scripts/perf_table.py", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
