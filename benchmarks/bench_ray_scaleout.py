"""Ray scale-out, measured: the ``ray`` engine on a local multi-node Ray cluster against the ``local`` engine.

The benchmark starts its own cluster with ``ray.cluster_utils.Cluster`` (Ray's multi-node test
harness: a head and ``--nodes - 1`` worker nodes, each a separate raylet with ``--cpus-per-node``
CPUs, all on this machine), runs fedsim's ``ray`` engine on it (``engine.ray.address``, one actor of
one CPU per node's CPU) and the ``local`` engine (clients one by one, ``engine.vectorise=false``), on
the same workloads, and prints per workload:

* the steady round time of each (mean of rounds 2..R; round 1 holds actor and learner start-up),
* ``local / ray`` (the speed-up; above 1 the cluster wins) and the parallel efficiency
  ``speed-up / actors``,
* the ray engine's start-up (from the call to the end of round 1, minus a steady round),
* the same with ``engine.ray.calls_per_task=--batch`` (a round's calls to one actor in batches), and
* the crossover (unbatched): the per-client work (local engine milliseconds per client call) from which ray's
  steady round beats local's.

The workloads (``--workloads``, ``model:local_epochs``) run 100 clients by default: ``mlp`` is a
tiny MLP (20-32-4) on synthetic data, 40 examples per client (per-call overhead dominates), ``cnn``
the small CNN on MNIST's 4,000 training images split evenly; more local epochs is more work per
client per message at the same per-call overhead.  Both engines give bit-identical results (the
cross-engine tests), which the benchmark checks on the final accuracy.

    python benchmarks/bench_ray_scaleout.py                          # 2 nodes x 1 CPU
    python benchmarks/bench_ray_scaleout.py --workloads mlp:1,cnn:4 --rounds 3 --nodes 3

On a machine with fewer free cores than the cluster's CPUs the actors and the driver share cores,
so the efficiency measured is a floor for a real cluster.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsim import config as C  # noqa: E402
from fedsim.logs import quiet_third_party  # noqa: E402


@dataclass
class Timing:
    steady_s: float  # mean round time of rounds 2..R
    startup_s: float  # call to end of round 1, minus one steady round
    accuracy: float


def workload_config(model: str, epochs: int, clients: int, rounds: int, engine: str,
                    address: str | None, calls_per_task: int = 1) -> C.ExperimentConfig:
    if model == "cnn":
        data = ["data.name=mnist", "model.name=cnn", "client.lr=0.05"]
    elif model == "mlp":
        data = ["data.name=synthetic", f"data.params.n_samples={clients * 50}", "data.params.n_features=20",
                "data.params.n_classes=4", "data.params.class_sep=2.0", "model.name=mlp", "model.params.hidden=[32]",
                "client.lr=0.1"]
    else:
        raise SystemExit(f"unknown workload model {model!r}: use mlp or cnn")
    overrides = [
        *data, "data.partition.name=iid", "data.test_fraction=0.2",
        "data.client_test_fraction=0.0", "client.learner=supervised", "client.momentum=0.9", "client.batch_size=16",
        f"client.local_epochs={epochs}", "strategy.name=fedavg", "strategy.fraction_train=1.0",
        "strategy.fraction_evaluate=0.0", "evaluation.server=true", "evaluation.every=1000",
        "engine.threads_per_client=1", "engine.vectorise=false", "engine.checkpoint=false", "tracking.enabled=false",
    ]
    if address is not None:
        overrides += [f"engine.ray.address={address}", f"engine.ray.calls_per_task={calls_per_task}"]
    cfg = C.load_config("fedavg", overrides, {"rounds": rounds, "clients": clients, "seed": 0, "engine": engine})
    cfg.name = "bench-ray-scaleout"
    return cfg


def timed_run(cfg: C.ExperimentConfig) -> Timing:
    from fedsim.runner import run_experiment

    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_round(self, record: Any) -> None:
            self.times.append(time.perf_counter())

    clock = Clock()
    start = time.perf_counter()
    result = run_experiment(cfg, observers=[clock])
    t = clock.times  # t[0]: the initial evaluation, t[r]: end of round r
    steady = (t[-1] - t[1]) / (len(t) - 2)
    return Timing(steady, (t[1] - start) - steady, float(result.history.final().get("eval/accuracy", float("nan"))))


CSV_COLUMNS = ("workload", "nodes", "cpus_per_node", "actors", "clients", "rounds", "ms_per_client", "local_s",
               "ray_s", "calls_per_task", "ray_batched_s", "ray_startup_s", "identical")


def write_csv(path: Path, rows: list[tuple[str, Timing, Timing, float, Timing]], args: argparse.Namespace,
              actors: int) -> None:
    """One row per workload: steady seconds per round of local, ray and batched ray (their ratios follow)."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for name, local, on_ray, _, batched in rows:
            writer.writerow({"workload": name, "nodes": args.nodes, "cpus_per_node": args.cpus_per_node,
                             "actors": actors, "clients": args.clients, "rounds": args.rounds,
                             "ms_per_client": f"{1e3 * local.steady_s / args.clients:.2f}",
                             "local_s": f"{local.steady_s:.4f}", "ray_s": f"{on_ray.steady_s:.4f}",
                             "calls_per_task": args.batch, "ray_batched_s": f"{batched.steady_s:.4f}",
                             "ray_startup_s": f"{on_ray.startup_s:.2f}",
                             "identical": int(local.accuracy == on_ray.accuracy == batched.accuracy)})


def crossover(points: list[tuple[float, bool]]) -> str:
    """Where ray starts to win, from (ms of local work per client, ray won) sorted by work."""
    wins = [ms for ms, won in points if won]
    if not wins:
        return "ray never beat local in this sweep"
    below = [ms for ms, won in points if not won and ms < wins[0]]
    above = [ms for ms, won in points if not won and ms > wins[0]]
    out = f"ray wins from {wins[0]:.1f} ms of local work per client"
    out += f" (loses at {below[-1]:.1f} ms)" if below else " (it won at every point)"
    return out + (f"; it also lost above that, at {', '.join(f'{ms:.1f}' for ms in above)} ms" if above else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes (a head and nodes-1 workers)")
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--workloads", default="mlp:1,cnn:1,cnn:2,cnn:4,cnn:8",
                    help="comma list of model:local_epochs (model: mlp or cnn)")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 3: rounds 2..R are the steady part)")
    ap.add_argument("--csv", type=Path, default=None,
                    help="also write the rows to this CSV file (scripts/perf_table.py renders docs/perf/ray-scaleout*.csv)")
    ap.add_argument("--batch", type=int, default=16,
                    help="also time ray with engine.ray.calls_per_task=BATCH (1: only unbatched)")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be at least 3")
    quiet_third_party()
    logging.getLogger("fedsim").setLevel(logging.ERROR)

    import ray
    from ray.cluster_utils import Cluster

    workloads = []
    for w in args.workloads.split(","):
        model, _, epochs = w.partition(":")
        if model not in ("mlp", "cnn") or not epochs.isdigit() or int(epochs) < 1:
            ap.error(f"--workloads: {w!r} is not model:local_epochs with model mlp or cnn (e.g. cnn:4)")
        workloads.append((model, int(epochs)))
    if args.nodes < 1 or args.cpus_per_node < 1 or args.clients < 2:
        ap.error("--nodes and --cpus-per-node must be >= 1, --clients >= 2")
    print(f"starting a Ray cluster: {args.nodes} nodes x {args.cpus_per_node} CPU", flush=True)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus_per_node, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=args.cpus_per_node)
    cluster.wait_for_nodes()
    print(f"cluster up in {time.perf_counter() - t0:.1f} s at {cluster.address}", flush=True)
    actors = args.nodes * args.cpus_per_node
    rows = []
    try:
        for model, e in workloads:
            local = timed_run(workload_config(model, e, args.clients, args.rounds, "local", None))
            on_ray = timed_run(workload_config(model, e, args.clients, args.rounds, "ray", cluster.address))
            batched = (timed_run(workload_config(model, e, args.clients, args.rounds, "ray", cluster.address, args.batch))
                       if args.batch > 1 else on_ray)
            if ray.is_initialized():
                ray.shutdown()
            speedup = local.steady_s / on_ray.steady_s
            same = local.accuracy == on_ray.accuracy == batched.accuracy
            rows.append((f"{model}:{e}", local, on_ray, speedup, batched))
            print(f"{model}, {e} local epochs: {1e3 * local.steady_s / args.clients:.1f} ms per client; local {local.steady_s:.3f} s/round, ray {on_ray.steady_s:.3f} s/round, local/ray "
                  f"{speedup:.2f}, efficiency {speedup / actors:.2f}, ray start-up {on_ray.startup_s:.1f} s; "
                  f"batched by {args.batch}: {batched.steady_s:.3f} s/round, local/ray {local.steady_s / batched.steady_s:.2f}; "
                  f"accuracy {'identical' if same else f'DIFFERS {local.accuracy} vs {on_ray.accuracy} vs {batched.accuracy}'}",
                  flush=True)
    finally:
        cluster.shutdown()

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ray engine on {args.nodes} nodes x {args.cpus_per_node} CPU ({actors} actors) vs local "
                        f"sequential, {args.clients} clients, steady rounds 2..{args.rounds}")
    for col in ("model:epochs", "ms per client", "local s/round", "ray s/round", "local/ray", "efficiency",
                "ray start-up s", f"ray, {args.batch} calls/task", "local/ray batched", "efficiency batched"):
        table.add_column(col, justify="right")
    for e, local, on_ray, speedup, batched in rows:
        fast = local.steady_s / batched.steady_s
        table.add_row(e, f"{1e3 * local.steady_s / args.clients:.1f}", f"{local.steady_s:.3f}", f"{on_ray.steady_s:.3f}",
                      f"{speedup:.2f}", f"{speedup / actors:.2f}", f"{on_ray.startup_s:.1f}", f"{batched.steady_s:.3f}",
                      f"{fast:.2f}", f"{fast / actors:.2f}")
    Console(width=140).print(table)
    if args.csv is not None:
        write_csv(args.csv, rows, args, actors)
    for label, column in (("unbatched", 3), (f"{args.batch} calls per task", 4)):
        if column == 4 and args.batch <= 1:
            continue
        points = sorted((1e3 * r[1].steady_s / args.clients,
                         r[1].steady_s / (r[column].steady_s if column == 4 else r[2].steady_s) > 1.0) for r in rows)
        print(f"crossover ({label}): {crossover(points)}")
    return 0 if all(lo.accuracy == r.accuracy == b.accuracy for _, lo, r, _, b in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
