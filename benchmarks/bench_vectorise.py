"""Where is the vectorised cohort faster than sequential training?  The evidence behind ``engine.vectorise=auto``.

For a grid of small supervised workloads (model shape, clients per round, examples per client, batch
size, optimiser) this times the steady per-round cost of fedsim's ``local`` engine with
``engine.vectorise=false`` (clients one by one) and ``engine.vectorise=true`` (the round's cohort
trained together with ``torch.func``), in one process, and prints ``sequential / vectorised``.  It also
prints what ``auto`` picks at each point.  ``auto`` must only vectorise where that is faster: a point
where it vectorises and the cohort is more than 5% slower is a ``WRONG`` row and a non-zero exit; a
point where it stays sequential although vectorising would be more than 5% faster is ``missed``
(allowed: the rule is conservative).

    python benchmarks/bench_vectorise.py            # the full grid (a few minutes on 2 cores)
    python benchmarks/bench_vectorise.py --quick    # a handful of points
    python benchmarks/bench_vectorise.py --device cuda --quick   # both paths on a GPU (engine.device)
    python benchmarks/bench_vectorise.py --dp       # under sample-level DP-SGD (Opacus one by one vs the
                                                    # vectorised cohort, privacy/cohort.py), σ = 1, RDP

Timing: ``--rounds`` rounds (default 3) per engine; the mean time of rounds 2..R (round 1 holds the
learner's set-up), the median over ``--repeat`` runs.  A point that comes out ``WRONG`` is timed again
(median of 3) before its verdict, so one scheduling spike on a busy machine does not decide it.  One torch thread, as in ``bench_engine.py``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsim import config as C  # noqa: E402
from fedsim.logs import quiet_third_party  # noqa: E402


@dataclass(frozen=True)
class Point:
    model: str  # "mlp:32" (hidden widths joined by 'x', "@784": 784 input features, default 20), "linear" or "cnn"
    clients: int
    per_client: int  # training examples per client
    batch_size: int
    optimizer: str

    @property
    def label(self) -> str:
        return f"{self.model:<10} {self.clients:>5} cl × {self.per_client:>4} ex, bs {self.batch_size:>3}, {self.optimizer}"


#: ``--dp``: sample-level DP-SGD with a fixed σ (no calibration in the timing), RDP accounting.
DP = ["privacy.enabled=true", "privacy.noise_multiplier=1.0", "privacy.accountant=rdp", "privacy.delta=1e-5"]


def point_config(p: Point, rounds: int, vectorise: str, dp: bool = False, device: str = "cpu") -> C.ExperimentConfig:
    if p.model == "cnn":
        data = ["data.name=mnist", "model.name=cnn", "client.lr=0.05"]  # 4,000 training images split evenly
    else:
        shape, _, features = p.model.partition("@")
        hidden = [] if shape == "linear" else [int(h) for h in shape.split(":")[1].split("x")]
        data = ["data.name=synthetic", f"data.params.n_samples={p.per_client * p.clients * 5 // 4}",
                f"data.params.n_features={features or 20}", "data.params.n_classes=4", "data.params.class_sep=2.0",
                "model.name=mlp", f"model.params.hidden={hidden}", "client.lr=0.1"]
    overrides = [
        *data, "data.partition.name=iid", "data.test_fraction=0.2", "data.client_test_fraction=0.0",
        "client.learner=supervised", f"client.optimizer={p.optimizer}", "client.momentum=0.9",
        f"client.batch_size={p.batch_size}", "client.local_epochs=1",
        "strategy.name=fedavg", "strategy.fraction_train=1.0", "strategy.fraction_evaluate=0.0",
        "evaluation.server=false", "engine.threads_per_client=1", f"engine.vectorise={vectorise}",
        "engine.checkpoint=false", "tracking.enabled=false", f"engine.device={device}", *(DP if dp else []),
    ]
    cfg = C.load_config("fedavg", overrides, {"rounds": rounds, "clients": p.clients, "seed": 0, "engine": "local"})
    cfg.name = "bench-vectorise"
    return cfg


def steady_round_s(cfg: C.ExperimentConfig, repeat: int) -> float:
    from fedsim.runner import run_experiment

    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_round(self, record: Any) -> None:
            self.times.append(time.perf_counter())

    runs = []
    for _ in range(repeat):
        clock = Clock()
        run_experiment(cfg, observers=[clock])
        t = clock.times
        runs.append((t[-1] - t[1]) / (len(t) - 2))  # t[0]: the initial evaluation, t[1]: round 1
    return statistics.median(runs)


def auto_choice(cfg: C.ExperimentConfig) -> bool:
    """What ``engine.vectorise=auto`` decides for this configuration's first round."""
    from fedsim.contracts.learner import NodeContext
    from clients.vectorised import auto_vectorise
    from fedsim.engine.runtime import RunSpec, get_learner

    learner = get_learner(RunSpec.from_config(cfg))
    ctxs = [NodeContext(pid, cfg.num_clients, 1, cfg.seed) for pid in range(cfg.num_clients)]
    return auto_vectorise(learner, ctxs) is None


GRID = {
    "model": ["linear", "mlp:32", "mlp:256", "mlp:64x64", "mlp:1024", "mlp:128@784", "cnn"],
    "clients": [10, 100, 1000],
    "per_client": [4, 40, 400],
    "batch_size": [16, 64],
    "optimizer": ["sgd", "adam"],
}
QUICK = [Point("mlp:32", 100, 40, 16, "sgd"), Point("mlp:1024", 10, 400, 64, "sgd"), Point("mlp:128@784", 100, 40, 16, "sgd"),
         Point("cnn", 100, 40, 16, "sgd"), Point("linear", 1000, 40, 16, "adam")]


def grid_points(quick: bool) -> list[Point]:
    if quick:
        return QUICK
    points = [Point(*values) for values in itertools.product(*GRID.values())]
    # big cohorts of big per-client sets are slow to time and no different in kind
    return [p for p in points if p.clients * p.per_client <= 40_000
            and (p.model != "cnn" or p.clients * p.per_client == 4_000)]  # MNIST: 4,000 training images


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a handful of points (under a minute)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dp", action="store_true", help="under sample-level DP-SGD (σ = 1)")
    ap.add_argument("--csv", type=Path, default=None,
                    help="also write one row per point to this CSV (scripts/perf_table.py renders docs/perf/vectorise*.csv)")
    ap.add_argument("--device", default="cpu", help="engine.device for both paths (cpu, cuda, ...)")
    ap.add_argument("--models", help=f"comma list of models to sweep (default: {','.join(GRID['model'])})")
    args = ap.parse_args(argv)
    quiet_third_party()
    logging.getLogger("fedsim").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sequential / vectorised steady round time{' under DP-SGD' if args.dp else ''}, "
                        f"torch threads 1, {args.rounds} rounds")
    for col in ("workload", "sequential s", "vectorised s", "seq/vec", "auto picks", "verdict"):
        table.add_column(col, justify="left" if col in ("workload", "auto picks", "verdict") else "right")
    wrong = 0
    csv_rows: list[dict[str, Any]] = []
    points = grid_points(args.quick)
    if args.models:
        points = [p for p in points if p.model in args.models.split(",")]
    for p in points:
        seq = steady_round_s(point_config(p, args.rounds, "false", args.dp, args.device), args.repeat)
        vec = steady_round_s(point_config(p, args.rounds, "true", args.dp, args.device), args.repeat)
        picks = auto_choice(point_config(p, args.rounds, "auto", args.dp, args.device))
        ratio = seq / vec
        if picks and ratio < 0.95 and args.repeat < 3:  # a loaded machine's spike, or real? time it again
            seq = steady_round_s(point_config(p, args.rounds, "false", args.dp, args.device), 3)
            vec = steady_round_s(point_config(p, args.rounds, "true", args.dp, args.device), 3)
            ratio = seq / vec
        ok = not (picks and ratio < 0.95)  # within 5% is a tie
        missed = not picks and ratio > 1.05
        wrong += not ok
        print(f"{p.label}: seq {seq:.4f} s, vec {vec:.4f} s, seq/vec {ratio:.2f}, auto "
              f"{'vectorises' if picks else 'sequential'}{'' if ok else '  WRONG'}{'  missed' if missed else ''}",
              flush=True)
        table.add_row(p.label, f"{seq:.4f}", f"{vec:.4f}", f"{ratio:.2f}", "vectorised" if picks else "sequential",
                      "WRONG" if not ok else "missed" if missed else "ok")
        csv_rows.append({"model": p.model, "clients": p.clients, "per_client": p.per_client, "batch_size": p.batch_size,
                         "optimizer": p.optimizer, "dp": int(args.dp), "device": args.device, "sequential_s": f"{seq:.5f}",
                         "vectorised_s": f"{vec:.5f}", "auto_vectorises": int(picks),
                         "verdict": "WRONG" if not ok else "missed" if missed else "ok"})
    Console(width=140).print(table)
    print(f"auto picked the slower path at {wrong} point(s)")
    if args.csv is not None and csv_rows:
        import csv

        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(csv_rows[0]))
            writer.writeheader()
            writer.writerows(csv_rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    from fedsim.errors import FedsimError

    try:
        sys.exit(main())
    except FedsimError as exc:  # e.g. --device cuda without a GPU: one line, not a traceback
        sys.exit(f"bench_vectorise.py: {exc}")
