"""Engine benchmark: fedsim's engines against a raw PyTorch loop and a stock Flower simulation, in one run.

Workload (FedAvg, the issue's setting): a tiny MLP and a small CNN, 100 and 1000 clients, 1 local
epoch, 3 rounds, **every client sampled every round** (``fraction_train=1.0``), no client-side
evaluation, and the server-side evaluation of the global model on the held-out test split after
every round (and of the initial model), which fedsim does by default: every system below does the
same evaluation work, and its final accuracy is printed to check that they all did the same work.

=============  =============================================================================
workload       data, model, local work
=============  =============================================================================
mlp-100/1000   ``synthetic`` (make_classification, 20 features, 4 classes, class_sep 2) sized to
               50 examples per client (``n_samples = 50 * clients``); 20% held out for the
               server, IID partition, so each client trains on 40 examples; MLP 20-32-4
               (804 parameters); SGD lr 0.2
cnn-100/1000   ``mnist`` (5,000 real images), 20% held out, IID partition: 40 images per client
               at 100 clients, 4 at 1000 (the set is that small); the default small CNN
               (conv 16, conv 32, fc 64; 106k parameters); SGD lr 0.05
=============  =============================================================================

Both: SGD momentum 0.9, batch 16, 1 local epoch (3 steps at 40 examples), seed 0,
``data.client_test_fraction=0``.

Systems, each timed end to end (one call, what a user waits for):

* ``raw``: the limit.  A plain PyTorch loop over the same partitions (prepared by fedsim's data
  code before timing), one resident model, the same initial weights, batches, SGD settings and
  thread count (1), sample-size-weighted averaging in partition order with Flower's arithmetic
  (``x_i * (n_i / n)`` summed in float32), and the same per-round evaluation.  Its per-client seeds
  are derived a round at a time (``fedsim.seeding.prime_seeds``), as fedsim's local engine derives
  them: one ``SeedSequence`` per seed cost ~0.1 ms per client here, which would otherwise count as
  fedsim's gain.
* ``flower``: a stock Flower simulation written the way Flower's quickstart does it: a ClientApp
  whose train function builds the model per call and loads the weights from the message's
  ArrayRecord (data loaded once per Ray worker and cached, like the quickstart's
  FederatedDataset), ``flwr.simulation.run_simulation`` with the Ray backend
  (``client_resources num_cpus=1``, Ray may use every core), Flower's own ``FedAvg.start`` in
  the ServerApp with the same ``evaluate_fn``.  Its local training is the raw loop's function, so
  only the framework differs.  Ray start and shutdown are included.
* ``local``, ``sequential``, ``vectorise``, ``ray``, ``fedsim-flower``: ``fedsim.runner.run_experiment``
  with ``engine.name=local`` as it ships (``engine.vectorise=auto``: the cohort is vectorised where that
  is exact and measured faster, see ``benchmarks/bench_vectorise.py``), ``local`` with
  ``engine.vectorise=false`` (clients one by one), ``local`` + ``engine.vectorise=true``,
  ``engine.name=ray``, ``engine.name=flower``; MLflow tracking off, ``engine.checkpoint=false`` (``--checkpoint``
  turns it on), ``engine.threads_per_client=1``.  Included: preflight, learner set-up, Ray
  start/stop for Ray engines and their workers' data building.  An engine that fails, or that
  silently falls back to another one (the vectorised path trains clients one by one; the ray
  engine runs without Ray), is reported ``n/a (reason)`` and the benchmark goes on.

Timing protocol.  ``--repeat N`` runs every system N times.  The in-process systems (``raw``,
``local``, ``sequential``, ``vectorise``) are **interleaved**: repeat ``i`` runs each of them once, in
an order rotated by ``i``, so a slow minute of the machine falls on all of them alike; each fedsim
system's ratio to raw is then the **median of its N paired ratios** (its run over raw's run of the same
repeat), with a distribution-free confidence interval for that median from the order statistics
(:func:`median_ci`: about 95%; with fewer than 6 runs the min-max range, whose coverage is printed).
A target is ``met`` when the whole interval is within it, ``NOT met`` when the whole interval is
outside, and ``inside the noise`` when the interval straddles the bound (measure with more repeats).
The Ray systems run their N repeats back to back (their start-up dominates) and use the median total.

Before any timing the in-process data is built once (shared by raw and the in-process engines)
and one untimed 1-round raw + local run warms up torch and imports.  Columns: ``total s`` (the
whole call; ratios use it), ``rounds s`` (from the end of the initial-model evaluation to the end
of the last round, so set-up, Ray start and shutdown are mostly left out; Flower starts its actor
pool while the ServerApp already runs, so for Ray systems round 1 may still hold worker start-up),
``s/round 2..R`` (the steady per-round cost), the final accuracy and the largest difference of the
final global weights from raw's.  Without ``--quick`` a bare ``ray.init`` + ``ray.shutdown`` is
timed too, as the floor of the Ray systems' fixed cost.

    python benchmarks/bench_engine.py                 # all workloads and systems, 3 rounds
    python benchmarks/bench_engine.py --quick         # mlp-100, 1 round (meant for under a minute)
    python benchmarks/bench_engine.py --workloads mlp-1000 --systems raw,local,sequential,vectorise
    python benchmarks/bench_engine.py --csv engine.csv
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsim import config as C  # noqa: E402
from fedsim.device import check_device_name, resolve_device  # noqa: E402
from fedsim.errors import ConfigError  # noqa: E402
from fedsim.logs import quiet_third_party  # noqa: E402
from fedsim.seeding import derive_seed, prime_seeds, seed_torch  # noqa: E402

# ----------------------------------------------------------------------------------- workloads

PER_CLIENT = 50  # synthetic examples per client before the 20% server hold-out (40 train each)
TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    num_clients: int
    description: str


WORKLOADS: dict[str, Workload] = {
    "mlp-100": Workload("mlp-100", "mlp", 100, "tiny MLP, synthetic, 100 clients x 40 examples"),
    "mlp-1000": Workload("mlp-1000", "mlp", 1000, "tiny MLP, synthetic, 1000 clients x 40 examples"),
    "cnn-100": Workload("cnn-100", "cnn", 100, "small CNN, MNIST, 100 clients x 40 images"),
    "cnn-1000": Workload("cnn-1000", "cnn", 1000, "small CNN, MNIST, 1000 clients x 4 images"),
}

#: System keys (``--systems``) and their display names, in run order.
SYSTEMS: dict[str, str] = {
    "raw": "raw PyTorch",
    "local": "fedsim local",
    "sequential": "fedsim local, sequential",
    "vectorise": "fedsim local+vectorise",
    "ray": "fedsim ray",
    "fedsim-flower": "fedsim flower",
    "flower": "stock Flower",
}
FEDSIM_SYSTEMS = ("local", "sequential", "vectorise", "ray", "fedsim-flower")
IN_PROCESS_SYSTEMS = ("raw", "local", "sequential", "vectorise")
RAY_SYSTEMS = ("ray", "fedsim-flower", "flower")


def get_workload(name: str) -> Workload:
    """One of :data:`WORKLOADS`, or any ``mlp-N`` / ``cnn-N`` (N clients, same settings)."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    model, _, clients = name.partition("-")
    if model not in ("mlp", "cnn") or not clients.isdigit() or int(clients) < 2:
        raise ValueError(f"unknown workload {name!r}: use {', '.join(WORKLOADS)} or mlp-N / cnn-N (N >= 2 clients)")
    n = int(clients)
    what = f"tiny MLP, synthetic, {n} clients x 40 examples" if model == "mlp" else f"small CNN, MNIST, {n} clients"
    return Workload(name, model, n, what)


QUICK_WORKLOADS = ("mlp-100",)


def workload_config(w: Workload, rounds: int, engine: str = "local", vectorise: bool | str = "auto",
                    checkpoint: bool = False, seed: int = 0, device: str = "cpu") -> C.ExperimentConfig:
    """The fedsim experiment of workload ``w`` (also the single source of the raw/stock settings)."""
    if w.model == "mlp":
        data = ["data.name=synthetic", f"data.params.n_samples={PER_CLIENT * w.num_clients}",
                "data.params.n_features=20", "data.params.n_classes=4", "data.params.class_sep=2.0",
                "model.name=mlp", "model.params.hidden=[32]", "client.lr=0.2"]
    else:
        data = ["data.name=mnist", "model.name=cnn", "client.lr=0.05"]
    overrides = [
        *data,
        "data.partition.name=iid", f"data.test_fraction={TEST_FRACTION}", "data.client_test_fraction=0.0",
        "client.learner=supervised", "client.optimizer=sgd", "client.momentum=0.9",
        "client.weight_decay=0.0", "client.batch_size=16", "client.local_epochs=1",
        "strategy.name=fedavg", "strategy.fraction_train=1.0", "strategy.fraction_evaluate=0.0",
        "evaluation.server=true", "engine.threads_per_client=1", f"engine.device={device}",
        f"engine.vectorise={str(vectorise).lower()}", f"engine.checkpoint={str(checkpoint).lower()}",
        "tracking.enabled=false",
    ]
    cfg = C.load_config("fedavg", overrides, {"rounds": rounds, "clients": w.num_clients, "seed": seed,
                                              "engine": engine})
    cfg.name, cfg.description = f"bench-{w.name}", f"engine benchmark: {w.description}"
    return cfg


def federated_data(cfg: C.ExperimentConfig) -> Any:
    from envs.federated import load_federated_data_cached

    return load_federated_data_cached(cfg.data, cfg.num_clients, cfg.seed)


# ------------------------------------------------------------------- plain PyTorch (raw, stock)


def build_initial_model(cfg: C.ExperimentConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model fedsim's learner starts from (same seed stream, so the same initial weights)."""
    from fedsim.models import build_model

    seed_torch(derive_seed(cfg.seed, "model-init"))
    return build_model(cfg.model.name, cfg.model.params, input_shape, num_classes)


def train_client(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: C.ExperimentConfig, server_round: int,
                 partition_id: int) -> float:
    """One client's local training, exactly as fedsim's supervised learner does it (no DP, no prox).

    A fresh SGD optimiser, ``local_epochs`` passes of shuffled batches drawn from a generator seeded
    by (seed, round, partition); returns the mean loss.
    """
    c = cfg.client
    model.train()
    seed_torch(derive_seed(cfg.seed, "torch", server_round, partition_id))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=c.lr, momentum=c.momentum,
                          weight_decay=c.weight_decay)
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "batches", server_round, partition_id))
    n, bs = len(y), c.batch_size
    steps = c.local_epochs * -(-n // bs)
    perm, start, loss_sum = torch.randperm(n, generator=gen), 0, 0.0
    for _ in range(steps):
        if start >= n:
            perm, start = torch.randperm(n, generator=gen), 0
        idx = perm[start : start + bs]
        start += bs
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach())
    return loss_sum / steps


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """Accuracy of ``model`` on (x, y), in batches (what fedsim's server evaluation does)."""
    model.eval()
    correct = 0
    loss_sum = 0.0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        loss_sum += float(nn.functional.cross_entropy(logits, y[start : start + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[start : start + batch_size]).sum())
    return correct / len(y)


@dataclass
class Outcome:
    total_s: float
    round_ends: list[float]  # perf_counter when each evaluation ended: the initial model's, then every round's
    accuracy: float
    arrays: dict[str, torch.Tensor] | None = None
    note: str = ""

    @property
    def rounds_s(self) -> float:
        return self.round_ends[-1] - self.round_ends[0]

    @property
    def later_round_s(self) -> float | None:
        """Mean time of rounds 2..R: the steady per-round cost (round 1 may include worker start-up)."""
        n = len(self.round_ends) - 2
        return (self.round_ends[-1] - self.round_ends[1]) / n if n >= 1 else None


def run_raw(cfg: C.ExperimentConfig) -> Outcome:
    """FedAvg as a plain PyTorch loop: the lower bound on what any engine can take."""
    data = federated_data(cfg)  # built before timing (see warm_up)
    device = resolve_device(cfg.engine.device)  # on a GPU: model, state and data live there, as in fedsim
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.engine.threads_per_client)
    try:
        t0 = time.perf_counter()
        model = build_initial_model(cfg, data.input_shape, data.num_classes).to(device)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        clients = [tuple(t.to(device) for t in data.train[pid].to_tensors()) for pid in range(cfg.num_clients)]
        xt, yt = (t.to(device) for t in data.server_test.to_tensors())
        total = float(sum(len(y) for _, y in clients))
        factors = [len(y) / total for _, y in clients]
        eval_bs = cfg.evaluation.batch_size
        accuracy = evaluate(model, xt, yt, eval_bs)
        ends = [time.perf_counter()]
        for rnd in range(1, cfg.rounds + 1):
            agg: dict[str, torch.Tensor] = {}
            for stream in ("torch", "batches"):  # a round's seeds in one pass, as fedsim's engine derives them
                prime_seeds(cfg.seed, stream, rnd, last=list(range(cfg.num_clients)))
            for pid, (x, y) in enumerate(clients):
                model.load_state_dict(state)
                train_client(model, x, y, cfg, rnd, pid)
                for k, v in model.state_dict().items():  # Flower's arithmetic: sum_i x_i * (n_i / n), float32
                    if k in agg:
                        agg[k] += v * factors[pid]
                    else:
                        agg[k] = v * factors[pid]
            state = agg
            model.load_state_dict(state)
            accuracy = evaluate(model, xt, yt, eval_bs)
            ends.append(time.perf_counter())
        end = time.perf_counter()
    finally:
        torch.set_num_threads(before)
    return Outcome(end - t0, ends, accuracy, {k: v.cpu() for k, v in state.items()})


# --------------------------------------------------------------------------------- stock Flower


def _ray_init_args(num_cpus: int) -> dict[str, Any]:
    """The quiet ray.init arguments fedsim's flower engine uses (fedsim/engine/flower.py)."""
    return {"log_to_driver": False, "logging_level": logging.ERROR, "include_dashboard": False, "num_cpus": num_cpus}


def _shutdown_ray() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def run_stock_flower(cfg: C.ExperimentConfig) -> Outcome:
    """Flower's quickstart pattern: ClientApp + ServerApp + FedAvg.start, ``run_simulation`` on Ray."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    if __name__ != "__main__":  # imported (tests): ship this module's functions to Ray workers by value
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    n = cfg.num_clients
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        data = federated_data(cfg)  # memoised per worker process, as the quickstart's FederatedDataset
        pid = int(context.node_config["partition-id"])
        model = build_initial_model(cfg, data.input_shape, data.num_classes)  # a new model per call
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = data.train[pid].to_tensors()
        loss = train_client(model, x, y, cfg, int(msg.content["config"]["server-round"]), pid)
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)})})
        return Message(content=content, reply_to=msg)

    out: dict[str, Any] = {"evals": []}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        data = federated_data(cfg)
        model = build_initial_model(cfg, data.input_shape, data.num_classes)
        xt, yt = data.server_test.to_tensors()

        def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            acc = evaluate(model, xt, yt, cfg.evaluation.batch_size)
            out["evals"].append((time.perf_counter(), acc))
            return MetricRecord({"accuracy": acc})

        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_evaluate_nodes=0,
                          min_available_nodes=n)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=cfg.rounds,
                                evaluate_fn=central_evaluate)
        out["arrays"] = result.arrays.to_torch_state_dict()

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": _ray_init_args(os.cpu_count() or 1)}
    t0 = time.perf_counter()
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n, backend_config=backend,
                       verbose_logging=False)
    finally:
        _shutdown_ray()
    end = time.perf_counter()
    evals = out["evals"]
    if "arrays" not in out or len(evals) != cfg.rounds + 1:
        raise RuntimeError(f"the simulation ended after {max(len(evals) - 1, 0)} of {cfg.rounds} rounds")
    return Outcome(end - t0, [t for t, _ in evals], evals[-1][1], out["arrays"])


# ------------------------------------------------------------------------------ fedsim engines


class _Clock:
    """Round observer: when each round closed, and whether Ray was up while it ran."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.ray_up = False

    def on_round(self, record: Any) -> None:
        self.times.append(time.perf_counter())
        if "ray" in sys.modules:
            import ray

            self.ray_up = self.ray_up or ray.is_initialized()


class _CountTrainCalls:
    """Count per-client ``SupervisedLearner.train`` calls in this process (the sequential path)."""

    def __enter__(self) -> "_CountTrainCalls":
        from clients.supervised import SupervisedLearner

        self.cls, self.original, self.calls = SupervisedLearner, SupervisedLearner.train, 0
        original = self.original

        def counted(learner: Any, arrays: Any, ctx: Any) -> Any:
            self.calls += 1
            return original(learner, arrays, ctx)

        SupervisedLearner.train = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.train = self.original  # type: ignore[method-assign]


class NotAvailable(Exception):
    """The system cannot be measured (not built yet, or it fell back to another engine)."""


def fedsim_config(w: Workload, system: str, rounds: int, checkpoint: bool, device: str = "cpu") -> C.ExperimentConfig:
    engine = {"local": "local", "sequential": "local", "vectorise": "local", "ray": "ray", "fedsim-flower": "flower"}[system]
    vectorise = {"sequential": False, "vectorise": True}.get(system, "auto")
    return workload_config(w, rounds, engine=engine, vectorise=vectorise, checkpoint=checkpoint, device=device)


def run_fedsim(cfg: C.ExperimentConfig, system: str) -> Outcome:
    from fedsim.runner import run_experiment

    clock = _Clock()
    try:
        with _CountTrainCalls() as counter:
            t0 = time.perf_counter()
            summary = run_experiment(cfg, observers=[clock])
            end = time.perf_counter()
    finally:
        if system in RAY_SYSTEMS:
            _shutdown_ray()
    sequential = cfg.rounds * cfg.num_clients
    if system == "vectorise" and counter.calls >= sequential:
        raise NotAvailable("engine.vectorise=true trained every client one by one (not built yet, or not for this "
                           "model)")
    if system == "ray" and not clock.ray_up:
        raise NotAvailable("not built yet: engine.name=ray ran without Ray")
    note = ""
    if system == "vectorise" and counter.calls:
        note = f"{counter.calls}/{sequential} client calls sequential"
    elif system == "local" and cfg.engine.name == "local":  # what engine.vectorise=auto chose
        note = "auto: sequential" if counter.calls >= sequential else (
            "auto: vectorised" if not counter.calls else f"auto: {counter.calls}/{sequential} calls sequential")
    final = summary.history.final()
    return Outcome(end - t0, clock.times, float(final.get("eval/accuracy", math.nan)), summary.final_arrays, note)


# ------------------------------------------------------------------------------------- the run


@dataclass
class Row:
    workload: str
    system: str  # key of SYSTEMS
    total_s: float | None = None  # None: n/a
    rounds_s: float | None = None
    later_round_s: float | None = None  # mean of rounds 2..R
    accuracy: float | None = None
    max_weight_diff: float | None = None  # vs raw's final global model
    fedsim_over_raw: float | None = None  # fedsim engines only
    flower_over_fedsim: float | None = None  # fedsim engines only (stock Flower's total / this one's)
    note: str = ""
    runs: list[float] = field(default_factory=list)  # every run's total s, in repeat order
    ratio_ci: tuple[float, float, float] | None = None  # (low, high, coverage) of fedsim_over_raw's median

    @property
    def available(self) -> bool:
        return self.total_s is not None


@dataclass
class Report:
    rows: list[Row]
    rounds: int
    cpu_count: int | None
    targets: list[tuple[str, str, str]] = field(default_factory=list)  # (target, measured, verdict)
    ray_start_s: float | None = None  # a bare ray.init + ray.shutdown with the same arguments


def ray_start_seconds() -> float:
    """Seconds of a bare ``ray.init`` (the Ray systems' arguments) plus ``ray.shutdown``: their fixed cost floor."""
    import ray

    _shutdown_ray()
    t0 = time.perf_counter()
    ray.init(**_ray_init_args(os.cpu_count() or 1))
    ray.shutdown()
    return time.perf_counter() - t0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, NotAvailable) else f"{type(exc).__name__}: {text}"[:160]


def measure(run: Callable[[], Outcome], repeat: int) -> Outcome:
    """Run ``repeat`` times; the outcome with the median total time."""
    return median_outcome([run() for _ in range(repeat)])


def median_outcome(outcomes: list[Outcome]) -> Outcome:
    """The outcome with the median total time (the lower middle one for an even count)."""
    ordered = sorted(outcomes, key=lambda o: o.total_s)
    return ordered[(len(ordered) - 1) // 2]


def measure_interleaved(runs: dict[str, Callable[[], Outcome]], repeat: int,
                        log: Callable[[str], None] = lambda s: None) -> dict[str, list[Outcome] | Exception]:
    """Each run ``repeat`` times, interleaved: repeat ``i`` runs every system once, the order rotated by ``i``.

    A system that raises is dropped from the later repeats; its entry is the exception.
    """
    names = list(runs)
    out: dict[str, list[Outcome] | Exception] = {name: [] for name in names}
    for i in range(repeat):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            done = out[name]
            if isinstance(done, Exception):
                continue
            try:
                done.append(runs[name]())
            except Exception as exc:  # noqa: BLE001 - reported as the row's n/a
                out[name] = exc
        log(f"repeat {i + 1}/{repeat} done")
    return out


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of ``values``: ``(low, high, coverage)``.

    The interval is ``(x_(k), x_(n+1-k))`` of the sorted values with the largest ``k`` whose coverage
    ``1 - 2 P(Binom(n, 1/2) < k)`` is at least ``level``; with too few values for ``level`` (n < 6 at
    95%) it is the min-max range, with its own lower coverage.  None for fewer than 2 values.
    """
    n = len(values)
    if n < 2:
        return None
    xs = sorted(values)

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, j) for j in range(k)) / 2.0 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def warm_up(w: Workload, device: str = "cpu") -> None:
    """Build the in-process data, and run 1 untimed round of raw and fedsim local (imports, kernels, CUDA)."""
    from fedsim.runner import run_experiment

    cfg = workload_config(w, rounds=1, device=device)
    federated_data(cfg)
    run_experiment(workload_config(w, rounds=1, vectorise=False, device=device))
    run_raw(cfg)
    run_experiment(cfg)


def run_benchmark(workloads: list[str], systems: list[str], rounds: int = 3, repeat: int = 1,
                  checkpoint: bool = False, stock_flower_at_1000: bool = True, measure_ray_start: bool = False,
                  log: Callable[[str], None] = lambda s: None, device: str = "cpu") -> Report:
    """Measure every (workload, system); never raises for a failing system (its row is n/a)."""
    quiet_third_party(False)
    warnings.filterwarnings("ignore")
    rows: list[Row] = []
    warmed = False
    for wname in workloads:
        w = get_workload(wname)
        try:
            base = workload_config(w, rounds, device=device)
            federated_data(base)  # in-process data, outside every timing
        except Exception as exc:  # noqa: BLE001 - e.g. more clients than examples
            reason = f"n/a (workload: {_one_line(exc)})"
            log(f"{wname}: {reason}")
            rows.extend(Row(wname, system, note=reason) for system in SYSTEMS if system in systems)
            continue
        if not warmed and any(s in IN_PROCESS_SYSTEMS for s in systems):
            warmed = True
            try:
                warm_up(w, device)
            except Exception as exc:  # noqa: BLE001 - the failing system shows up as n/a below
                log(f"warm-up failed: {_one_line(exc)}")
        results: dict[str, Row] = {}
        arrays: dict[str, dict[str, torch.Tensor] | None] = {}
        interleaved = [s for s in SYSTEMS if s in systems and s in IN_PROCESS_SYSTEMS]
        if interleaved:
            log(f"{wname}: {', '.join(SYSTEMS[s] for s in interleaved)}, interleaved, {repeat} repeat(s) ...")
        measured = measure_interleaved({s: _in_process_run(w, s, base, rounds, checkpoint, device)
                                        for s in interleaved},
                                       repeat, log=lambda s: log(f"{wname}: {s}"))
        for system in SYSTEMS:
            if system not in systems:
                continue
            row = Row(wname, system)
            if system in measured:
                got = measured[system]
                if isinstance(got, Exception):
                    row.note = f"n/a ({_one_line(got)})"
                else:
                    out = median_outcome(got)
                    row.total_s, row.rounds_s, row.later_round_s = out.total_s, out.rounds_s, out.later_round_s
                    row.accuracy, row.note, row.runs = out.accuracy, out.note, [o.total_s for o in got]
                    arrays[system] = out.arrays
                log(f"{wname}: {SYSTEMS[system]}: " + (f"{row.total_s:.2f} s" if row.available else row.note))
                results[system] = row
                rows.append(row)
                continue
            if system == "flower" and w.num_clients >= 1000 and not stock_flower_at_1000:
                row.note = "n/a (skipped: stock Flower at 1000 clients is not run in --quick)"
                results[system] = row
                rows.append(row)
                continue
            log(f"{wname}: {SYSTEMS[system]} ...")
            try:
                if system == "flower":
                    out = measure(lambda: run_stock_flower(base), repeat)
                else:
                    cfg = fedsim_config(w, system, rounds, checkpoint, device)
                    out = measure(lambda: run_fedsim(cfg, system), repeat)
                row.total_s, row.rounds_s, row.later_round_s = out.total_s, out.rounds_s, out.later_round_s
                row.accuracy, row.note = out.accuracy, out.note
                arrays[system] = out.arrays
            except Exception as exc:  # noqa: BLE001 - a system failing must not end the run
                row.note = f"n/a ({_one_line(exc)})"
                _shutdown_ray()
            log(f"{wname}: {SYSTEMS[system]}: " + (f"{row.total_s:.2f} s" if row.available else row.note))
            results[system] = row
            rows.append(row)
        _fill_ratios(results, arrays)
    report = Report(rows, rounds, os.cpu_count(), targets(rows))
    if measure_ray_start and any(s in RAY_SYSTEMS for s in systems):
        try:
            report.ray_start_s = ray_start_seconds()
        except Exception as exc:  # noqa: BLE001
            log(f"ray start: n/a ({_one_line(exc)})")
    return report


def _in_process_run(w: Workload, system: str, base: C.ExperimentConfig, rounds: int,
                    checkpoint: bool, device: str = "cpu") -> Callable[[], Outcome]:
    if system == "raw":
        return lambda: run_raw(base)
    cfg = fedsim_config(w, system, rounds, checkpoint, device)
    return lambda: run_fedsim(cfg, system)


def _max_diff(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> float | None:
    if a is None or b is None or set(a) != set(b):
        return None
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _fill_ratios(results: dict[str, Row], arrays: dict[str, Any]) -> None:
    raw, stock = results.get("raw"), results.get("flower")
    for system, row in results.items():
        if not row.available:
            continue
        if system != "raw":
            row.max_weight_diff = _max_diff(arrays.get(system), arrays.get("raw"))
        if system in FEDSIM_SYSTEMS:
            if raw is not None and raw.available:
                row.fedsim_over_raw = row.total_s / raw.total_s
                if len(row.runs) > 1 and len(row.runs) == len(raw.runs):  # interleaved: paired by repeat
                    paired = [a / b for a, b in zip(row.runs, raw.runs)]
                    row.fedsim_over_raw = statistics.median(paired)
                    row.ratio_ci = median_ci(paired)
            if stock is not None and stock.available:
                row.flower_over_fedsim = stock.total_s / row.total_s


def targets(rows: list[Row]) -> list[tuple[str, str, str]]:
    """The issue's targets.

    fedsim/raw is the ``local`` engine's overhead over the raw loop as fedsim ships it
    (``engine.vectorise=auto``; the sequential engine's ratio and the best engine are named beside
    it), and, at 100 and 1,000 clients, that of ``local, sequential`` (clients one by one) on its own;
    flower/fedsim uses the fastest fedsim engine; the vectorised speed-up is sequential /
    local+vectorise on mlp-1000.
    """
    out: list[tuple[str, str, str]] = []
    by = {(r.workload, r.system): r for r in rows}
    fedsim_rows = [r for r in rows if r.system in FEDSIM_SYSTEMS and r.available]

    def best(workload: str, key: Callable[[Row], float | None], high: bool) -> Row | None:
        cands = [r for r in fedsim_rows if r.workload == workload and key(r) is not None]
        return (max if high else min)(cands, key=key) if cands else None  # type: ignore[arg-type,return-value]

    for wname in dict.fromkeys(r.workload for r in rows):
        clients = get_workload(wname).num_clients
        if clients == 100:
            loc, seq = by.get((wname, "local")), by.get((wname, "sequential"))
            ratio = loc.fedsim_over_raw if loc is not None else None
            r = best(wname, lambda r: r.fedsim_over_raw, high=False)
            notes = [f"{loc.note}"] if loc is not None and loc.note.startswith("auto") else []
            if seq is not None and seq.fedsim_over_raw is not None:
                notes.append(f"sequential {seq.fedsim_over_raw:.2f}")
            if r is not None and r is not loc and r is not seq:
                notes.append(f"best: {SYSTEMS[r.system]} {r.fedsim_over_raw:.2f}")
            out.append((f"{wname}: fedsim local/raw <= 1.10", *_ratio_target(loc, 1.10, tuple(notes))))
        seq = by.get((wname, "sequential"))
        if clients in (100, 1000) and seq is not None and seq.available:  # the path DP, CNN, LoRA and regime runs take
            out.append((f"{wname}: fedsim local, sequential/raw <= 1.10", *_ratio_target(seq, 1.10)))
        if clients == 1000:
            r = best(wname, lambda r: r.flower_over_fedsim, high=True)
            out.append((f"{wname}: flower/fedsim >= 10",
                        f"{r.flower_over_fedsim:.1f} ({SYSTEMS[r.system]})" if r else "n/a",
                        _verdict(r is not None and r.flower_over_fedsim >= 10, r is not None)))
        if wname == "mlp-1000":
            seq, vec = by.get((wname, "sequential")), by.get((wname, "vectorise"))
            ok = seq is not None and vec is not None and seq.available and vec.available
            speed = seq.total_s / vec.total_s if ok else None  # type: ignore[union-attr,operator]
            out.append((f"{wname}: vectorised >= 3x sequential", f"{speed:.2f}x" if speed else "n/a",
                        _verdict(speed is not None and speed >= 3, speed is not None)))
    return out


def _verdict(ok: bool, measured: bool) -> str:
    return ("met" if ok else "NOT met") if measured else "not measured"


def _ratio_target(row: Row | None, bound: float, notes: tuple[str, ...] = ()) -> tuple[str, str]:
    """``(measured, verdict)`` of the target ``fedsim/raw <= bound``.

    With paired runs it is met only when the median's whole confidence interval is within the bound,
    NOT met when the interval is all outside, and inside the noise when it straddles the bound.
    ``notes`` go in the measured text's parentheses after the run count.
    """
    ratio = row.fedsim_over_raw if row is not None else None
    if row is None or ratio is None:
        return "n/a", "not measured"
    ci = row.ratio_ci
    if ci is None:
        detail, verdict = f"{max(len(row.runs), 1)} run(s), no interval", _verdict(ratio <= bound, True)
    else:
        low, high, coverage = ci
        detail = f"{coverage:.0%} CI {low:.2f}-{high:.2f}, {len(row.runs)} paired runs"
        verdict = "met" if high <= bound else ("NOT met" if low > bound else "inside the noise")
    return f"{ratio:.2f} ({'; '.join((detail, *notes))})", verdict


# ----------------------------------------------------------------------------------- printing


def _f(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def print_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title=f"FedAvg, {report.rounds} rounds, all clients every round (fraction_train=1.0), "
                        f"1 local epoch; os.cpu_count()={report.cpu_count}")
    for col, just in [("workload", "left"), ("system", "left"), ("total s", "right"), ("rounds s", "right"),
                      ("s/round 2..R", "right"), ("final acc", "right"), ("max |Δw| vs raw", "right"),
                      ("fedsim/raw", "right"),
                      ("flower/fedsim", "right"), ("note", "left")]:
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    last = None
    for r in report.rows:
        if last is not None and r.workload != last:
            table.add_section()
        last = r.workload
        if r.available:
            diff = r.max_weight_diff
            dtext = "" if r.system == "raw" else ("bit-identical" if diff == 0 else _f(diff, ".1e"))
            table.add_row(r.workload, SYSTEMS[r.system], _f(r.total_s, ".2f"), _f(r.rounds_s, ".2f"),
                          _f(r.later_round_s, ".2f"), _f(r.accuracy, ".4f"), dtext, _f(r.fedsim_over_raw, ".2f"),
                          _f(r.flower_over_fedsim, ".1f"),
                          r.note)
        else:
            table.add_row(r.workload, SYSTEMS[r.system], "n/a", "", "", "", "", "", "", r.note)
    console.print(table)
    ttable = Table(title="Targets")
    for col in ("target", "measured", "verdict"):
        ttable.add_column(col)
    for t in report.targets:
        ttable.add_row(*t)
    if report.targets:
        console.print(ttable)
    raw_acc = {r.workload: r.accuracy for r in report.rows if r.system == "raw" and r.available}
    for r in report.rows:
        if r.available and r.system != "raw" and r.workload in raw_acc and r.accuracy != raw_acc[r.workload]:
            console.print(f"note: {r.workload} {SYSTEMS[r.system]} final accuracy {r.accuracy:.4f} differs from raw "
                          f"{raw_acc[r.workload]:.4f}" + (" (stock Flower aggregates in arrival order)"
                                                          if r.system == "flower" else ""))
    console.print("total s: one call end to end (Ray start/stop included for Ray systems).  rounds s: from the end "
                  "of the initial-model evaluation to the end of the last round (for Ray systems it may include "
                  "worker start-up that overlaps round 1).  s/round 2..R: the steady per-round cost.  Ratios use "
                  "total s: with --repeat > 1 an in-process fedsim system's is the median of its ratios to raw's run "
                  "of the same (interleaved) repeat, the targets' interval that median's confidence interval.  "
                  "max |Δw|: largest difference of the final global weights from raw's.")
    if report.ray_start_s is not None:
        console.print(f"a bare ray.init + ray.shutdown (the Ray systems' arguments) took {report.ray_start_s:.2f} s")


def write_csv(report: Report, path: Path) -> None:
    with open(path, "w", newline="") as fh:
        fields = ["workload", "system", "system_name", "total_s", "rounds_s", "later_round_s", "accuracy",
                  "max_weight_diff",
                  "fedsim_over_raw", "ratio_ci_low", "ratio_ci_high", "ratio_ci_coverage", "runs",
                  "flower_over_fedsim", "note", "rounds", "cpu_count"]
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in report.rows:
            ci = r.ratio_ci or (None, None, None)
            row = {k: v for k, v in asdict(r).items() if k not in ("ratio_ci", "runs")}
            writer.writerow({**row, "system_name": SYSTEMS[r.system], "rounds": report.rounds,
                             "cpu_count": report.cpu_count, "ratio_ci_low": ci[0], "ratio_ci_high": ci[1],
                             "ratio_ci_coverage": ci[2], "runs": len(r.runs) or None})


def _names(text: str, known: dict[str, Any], what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)}; known: {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="mlp-100 only, 1 round, no stock Flower at 1000 clients (meant for under a minute)")
    ap.add_argument("--workloads", default=None,
                    help=f"comma list of {', '.join(WORKLOADS)} (default: these) or mlp-N / cnn-N")
    ap.add_argument("--systems", default=None, help=f"comma list of {', '.join(SYSTEMS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per system (in-process systems interleaved); ratios: median of paired runs with a CI")
    ap.add_argument("--checkpoint", action="store_true", help="keep fedsim's per-round checkpoint on (default off)")
    ap.add_argument("--csv", type=Path, default=None, help="also write the rows to this CSV file")
    ap.add_argument("--device", default="cpu",
                    help="engine.device of the fedsim systems, and where the raw loop keeps model and data "
                         "(cpu, cuda, cuda:N); a GPU measures the in-process systems only")
    args = ap.parse_args(argv)
    workloads = [s.strip() for s in args.workloads.split(",") if s.strip()] if args.workloads else (
        list(QUICK_WORKLOADS) if args.quick else list(WORKLOADS))
    for name in workloads:
        try:
            get_workload(name)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    systems = _names(args.systems, SYSTEMS, "system") if args.systems else list(SYSTEMS)
    try:
        check_device_name(args.device)
        resolve_device(args.device)  # a one-line error where there is no such GPU
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    if args.device != "cpu":
        outside = [s for s in systems if s not in IN_PROCESS_SYSTEMS]
        if args.systems and outside:
            raise SystemExit(f"--device {args.device} measures the in-process systems only; drop "
                             f"{', '.join(outside)} from --systems")
        systems = [s for s in systems if s in IN_PROCESS_SYSTEMS]
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1 or args.repeat < 1:
        raise SystemExit("--rounds and --repeat must be >= 1")
    gpu = f", {torch.cuda.get_device_name(resolve_device(args.device))}" if args.device != "cpu" else ""
    print(f"torch {torch.__version__}, os.cpu_count()={os.cpu_count()}, device {args.device}{gpu}, rounds {rounds}, "
          f"repeat {args.repeat}, workloads {', '.join(workloads)}", flush=True)
    start = time.perf_counter()
    report = run_benchmark(workloads, systems, rounds, args.repeat, args.checkpoint,
                           stock_flower_at_1000=not args.quick, measure_ray_start=not args.quick,
                           log=lambda s: print(s, flush=True), device=args.device)
    print_report(report)
    if args.csv:
        write_csv(report, args.csv)
        print(f"wrote {args.csv}")
    print(f"total benchmark time {time.perf_counter() - start:.1f} s")
    return report


if __name__ == "__main__":
    main()
