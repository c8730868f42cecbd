"""Per-process runtime: the learner cache and the ClientApp that wraps a learner.

The ClientApp is shipped to Ray actors by the Flower engine, so it closes over a small picklable
:class:`RunSpec` only; each process builds its learner (model, data) once per run and reuses it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim import config as C
from fedsim.engine.arrays import host_arrays, resident_record
from fedsim.engine.ray_address import cluster_address
from fedsim.engine.records import ReplyRecordDict, ResultReply, metric_record
from fedsim.errors import ConfigError
from fedsim.threads import torch_threads  # noqa: F401  (re-exported: engines import it from here)
from fedsim.registry import LEARNERS, import_plugins
from fedsim.seeding import derive_seed

from fedsim.contracts.wire import NUM_EXAMPLES, PARTITION_ID, UNIT_WEIGHT  # noqa: F401  (engines import them from here)


class SimulatedClientFailure(RuntimeError):
    """Raised inside a ClientApp by fault injection (``engine.faults``)."""


class ClientTimeout(RuntimeError):
    """A client call overran its deadline (it was abandoned; the reply is an error)."""


T = TypeVar("T")


def bounded_wait(seconds: float | None) -> float | None:
    """``seconds`` as a wait that never overflows a lock or ``Event.wait`` (None: wait forever).

    Infinite or huge values (``hang_s=inf``, a 1e12 s timeout) become None or
    ``threading.TIMEOUT_MAX``; negative ones 0.
    """
    if seconds is None or math.isnan(seconds) or (math.isinf(seconds) and seconds > 0):
        return None
    return min(max(seconds, 0.0), threading.TIMEOUT_MAX)


def client_call_limit(cfg: C.ExperimentConfig) -> float:
    """The deadline of one client call, counted from its own start: min(client, round timeout).

    Clients of a simulated round conceptually run in parallel, so every engine gives each call this
    budget of its own (a sequential engine does not share one round budget across its calls) and a
    hanging client costs its own slot only.  ``engine.client_timeout_s=None`` means the round timeout.
    """
    e = cfg.engine
    return min(e.client_timeout_s or e.round_timeout_s, e.round_timeout_s)


class _Batch:
    """Calls a worker runs back to back, with what each gave and when each started.

    The worker starts call ``i + 1`` the moment call ``i`` ends and wakes the caller only when the
    batch ends; the caller sleeps until then or until the running call's deadline.  Per-call
    hand-offs (a wake-up of the caller per call, which then contends for the GIL with the worker)
    cost ~0.8 ms per call on these 2-core virtual machines, a third of a tiny client's round.
    """

    def __init__(self, fns: list[Callable[[], Any]], threads: int = 0) -> None:
        self.fns = fns
        self.threads = threads  # torch intra-op threads for the whole batch (0: leave them)
        self.outcomes: list[tuple[bool, Any]] = []  # (ok, value or exception), in call order
        self.started: list[float] = []  # time.monotonic() at each call's start
        self.cancelled = False  # set by the caller: run no further call
        self.cond = threading.Condition(threading.Lock())

    def run(self) -> None:
        with torch_threads(self.threads):  # once per batch, not per call (see fedsim.threads)
            self._run()

    def _run(self) -> None:
        with self.cond:
            self.started.append(time.monotonic())
            self.cond.notify_all()  # the caller's clock for call 0 starts now
        for i, fn in enumerate(self.fns):
            try:
                outcome: tuple[bool, Any] = (True, fn())
            except BaseException as exc:  # handed to the caller
                outcome = (False, exc)
            with self.cond:
                self.outcomes.append(outcome)
                if self.cancelled:
                    return
                if i + 1 < len(self.fns):
                    self.started.append(time.monotonic())
                else:
                    self.cond.notify_all()

    def wait(self, limit: float) -> int | None:
        """Wait until every call ended (None) or one overran ``limit`` from its start (its index)."""
        with self.cond:
            while len(self.outcomes) < len(self.fns):
                i = len(self.outcomes)  # the call now running
                left = None if len(self.started) <= i else self.started[i] + limit - time.monotonic()
                if left is not None and left <= 0:
                    self.cancelled = True  # in the same critical section: the worker starts no further call
                    return i
                self.cond.wait(bounded_wait(left))
            return None


class _CallWorker:
    """A long-lived daemon thread that runs one caller's client calls, one batch at a time.

    Reused across calls: a fresh thread per call allocates from cold malloc arenas every time
    (page faults), which made the MiniLM demo's rounds ~25% slower than inline calls.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False  # set by the caller on an overrun: the thread ends after its current call
        self.thread = threading.Thread(target=self._loop, name="fedsim-client-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            batch: _Batch = self.jobs.get()
            batch.run()
            if self.abandoned:
                return

    def submit(self, fns: list[Callable[[], Any]], threads: int = 0) -> _Batch:
        batch = _Batch(fns, threads)
        self.jobs.put(batch)
        return batch


_workers = threading.local()  # each calling thread has its own worker (engines may call from several)


def _call_worker() -> _CallWorker:
    worker = getattr(_workers, "worker", None)
    if worker is None:
        worker = _workers.worker = _CallWorker()
    return worker


def _abandon(worker: _CallWorker, batch: _Batch) -> None:
    with batch.cond:
        batch.cancelled = True
    worker.abandoned, _workers.worker = True, None


def call_all_with_deadline(fns: list[Callable[[], T]], limit: float | None, threads: int = 0) -> list[tuple[bool, Any]]:
    """Run ``fns`` one after another, each under :func:`call_with_deadline`'s rules; ``(ok, value)`` each.

    ``value`` is the call's result, or the exception it raised (a :class:`ClientTimeout` for one
    that overran ``limit``, counted from its own start, or that had no budget).  The calls run back
    to back on this thread's worker; after an overrun the remaining calls go to a fresh worker, so a
    hanging call costs its own slot only.  Interrupting the wait (Ctrl+C, SIGTERM) abandons the worker
    and re-raises.  ``threads``: torch's intra-op threads for the calls (0: leave them).
    """
    if limit is None:
        out: list[tuple[bool, Any]] = []
        with torch_threads(threads):
            for fn in fns:
                try:
                    out.append((True, fn()))
                except Exception as exc:
                    out.append((False, exc))
        return out
    if limit <= 0:
        return [(False, ClientTimeout("timeout: the deadline passed before this client ran"))] * len(fns)
    results: list[tuple[bool, Any]] = []
    while len(results) < len(fns):
        worker = _call_worker()
        batch = worker.submit(list(fns[len(results):]), threads)
        try:
            overran = batch.wait(limit)
        except BaseException:  # interrupted while a call runs: it is abandoned with its worker
            _abandon(worker, batch)
            raise
        if overran is None:
            results.extend(batch.outcomes)
            continue
        _abandon(worker, batch)
        with _cache_lock:
            in_learner = worker.thread.ident in _in_learner
        if in_learner:
            drop_learners()
        results.extend(batch.outcomes[:overran])
        results.append((False, ClientTimeout(f"timeout: no reply within {limit:.1f}s")))
    return results


def call_with_deadline(fn: Callable[[], T], limit: float | None) -> T:
    """``fn()`` on this thread's long-lived call worker, waited for at most ``limit`` seconds (None: inline).

    On overrun the worker is abandoned (the next call gets a new one) and :class:`ClientTimeout` is
    raised; if the worker was inside the learner (it may still be using it), this process's learners
    are dropped and the next call builds fresh ones (an injected hang strikes before the learner, so
    it keeps it).  The wait is interruptible: Ctrl+C or SIGTERM reach the caller at once.
    """
    if limit is None:
        return fn()
    [(ok, value)] = call_all_with_deadline([fn], limit)
    if not ok:
        raise value
    return value


@dataclass(frozen=True)
class RunSpec:
    """Everything a process needs to rebuild a run's components: the config, as YAML text."""

    config_yaml: str

    @staticmethod
    def from_config(cfg: C.ExperimentConfig) -> "RunSpec":
        return RunSpec(C.to_yaml(cfg))

    @property
    def cfg(self) -> C.ExperimentConfig:
        return _parse_config(self.config_yaml)


_cache_lock = threading.Lock()
_configs: dict[str, C.ExperimentConfig] = {}
_learners: dict[str, Any] = {}
_in_learner: set[int] = set()  # idents of the threads now inside a learner call (see call_with_deadline)


def _parse_config(text: str) -> C.ExperimentConfig:
    with _cache_lock:
        if text not in _configs:
            import yaml

            _configs[text] = C.from_container(yaml.safe_load(text))
        cfg = _configs[text]
    import_plugins(cfg.plugins)  # an engine's process (Ray actor, Flower client) registers the user's names too
    return cfg


def get_learner(spec: RunSpec) -> Any:
    """The learner of this run in this process (built on first use, then resident)."""
    with _cache_lock:
        learner = _learners.get(spec.config_yaml)
    if learner is None:
        cfg = spec.cfg
        cls = LEARNERS.get(cfg.client.learner)
        params = LEARNERS.params(cfg.client.learner, cfg.client.params, "client.params")
        learner = cls(cfg, params)
        with _cache_lock:
            _learners.clear()  # one run per process at a time: drop previous runs' models and data
            _learners[spec.config_yaml] = learner
    return learner


def warm_learner(spec: RunSpec) -> Any:
    """This process's learner with its data loaded (``setup_summary`` loads them; once per learner)."""
    learner = get_learner(spec)
    if not getattr(learner, "_fedsim_warm", False):
        with torch_threads(spec.cfg.engine.threads_per_client):
            learner.setup_summary()
        learner._fedsim_warm = True
    return learner


def drop_learners() -> None:
    """Forget this process's learners (the next call builds a fresh one)."""
    with _cache_lock:
        _learners.clear()


def check_learner(cfg: C.ExperimentConfig) -> None:
    """Fail fast (before any run starts) on an unknown learner, bad params or unsupported DP."""
    LEARNERS.params(cfg.client.learner, cfg.client.params, "client.params")
    learner = LEARNERS.get(cfg.client.learner)
    if cfg.privacy.enabled and not getattr(learner, "supports_dp", False):
        why = getattr(learner, "privacy_unit", "")
        raise ConfigError(f"experiment {cfg.name!r} uses learner {cfg.client.learner!r}, which has no differential "
                          f"privacy{f' ({why})' if why else ''}, so --eps / privacy.enabled does not apply; drop it")
    check_device(cfg, learner)


def check_device(cfg: C.ExperimentConfig, learner: type) -> None:
    """``engine.device`` other than cpu: the learner keeps its model there, and the GPU is there
    (local engine) or the engine gives its clients one (ray, flower)."""
    device, e = cfg.engine.device, cfg.engine
    if device == "cpu":
        return
    if not getattr(learner, "supports_device", False):
        if device == "auto":
            return  # auto: the best this learner can use, the CPU
        raise ConfigError(f"learner {cfg.client.learner!r} runs on the CPU only; drop engine.device={device} "
                          f"(or set engine.device=cpu)")
    if device == "auto":
        return
    if e.name == "ray" and e.ray.actor_num_gpus <= 0:
        raise ConfigError(f"engine.device={device} on the ray engine needs GPUs for its actors; set "
                          f"engine.ray.actor_num_gpus (e.g. 0.5 packs two actors on a GPU)")
    if e.name == "flower" and e.flower.client_num_gpus <= 0:
        raise ConfigError(f"engine.device={device} on the flower engine needs GPUs for its clients; set "
                          f"engine.flower.client_num_gpus (e.g. 0.5)")
    joins = {"ray": e.ray.address, "flower": e.flower.address}
    if not (e.name in joins and cluster_address(joins[e.name])):  # this machine runs the clients: the GPU must be here
        from fedsim.device import resolve_device

        resolve_device(device)


def node_context(msg: Message, context: Context, cfg: C.ExperimentConfig,
                 configs: dict[int, tuple[Any, dict[str, Any]]] | None = None):  # -> clients.NodeContext
    """The learner's view of ``msg``'s node and round.

    ``configs``: a cache, by record identity, of round configs already read in this loop over a round's
    messages (a strategy sends every client the same ConfigRecord object); each context still gets a
    dict of its own.
    """
    from fedsim.contracts.learner import NodeContext  # the contract module, not a concrete learner

    config = _round_config(msg, configs)
    return NodeContext(
        partition_id=int(context.node_config["partition-id"]),
        num_partitions=int(context.node_config["num-partitions"]),
        server_round=int(config.get("server-round", 0)),
        root_seed=cfg.seed,
        state=context.state,
        config=config,
    )


def _round_config(msg: Message, configs: dict[int, tuple[Any, dict[str, Any]]] | None) -> dict[str, Any]:
    content = msg.content
    if "config" not in content:
        return {}
    record = content["config"]
    if configs is None:
        return dict(record)
    held = configs.get(id(record))
    if held is None or held[0] is not record:
        held = configs[id(record)] = (record, dict(record))
    return dict(held[1])


#: Round-config key the engine sets when it resends a failed client's message (0 = first try).
ATTEMPT = "fedsim-attempt"


def injected_fault(cfg: C.ExperimentConfig, partition_id: int, server_round: int, attempt: int = 0) -> str | None:
    """The fault ``engine.faults`` injects into this training call: ``"raise"``, ``"hang"`` or None.

    Seeded by (root seed, round, partition[, attempt for transient faults]), so the expected fault
    counts of a run can be computed by anyone (the tests do).
    """
    f = cfg.engine.faults
    if partition_id in f.fail_partitions and (not f.fail_rounds or server_round in f.fail_rounds):
        if not (f.transient and attempt > 0):
            return "raise"
    if f.raise_fraction <= 0 and f.hang_fraction <= 0:
        return None
    if f.transient and attempt > 0:
        return None
    import random

    u = random.Random(derive_seed(cfg.seed, "fault", server_round, partition_id)).random()
    if u < f.raise_fraction:
        return "raise"
    if u < f.raise_fraction + f.hang_fraction:
        return "hang"
    return None


_hangs_released = threading.Event()


def release_hangs() -> None:
    """End the injected hangs now waiting in this process (abandoned calls then finish as failures)."""
    global _hangs_released
    released, _hangs_released = _hangs_released, threading.Event()
    released.set()


def _maybe_fail(cfg: C.ExperimentConfig, partition_id: int, server_round: int, attempt: int) -> None:
    _strike(cfg, injected_fault(cfg, partition_id, server_round, attempt), partition_id, server_round)


def _strike(cfg: C.ExperimentConfig, fault: str | None, partition_id: int, server_round: int) -> None:
    """Carry out an injected fault (:func:`injected_fault`'s answer): raise, or hang and then raise."""
    if fault == "raise":
        raise SimulatedClientFailure(f"injected failure: partition {partition_id}, round {server_round}")
    if fault == "hang":  # hang_s (inf: for ever) unless the call's deadline abandons it or its actor is killed
        _hangs_released.wait(bounded_wait(cfg.engine.faults.hang_s))
        raise SimulatedClientFailure(f"injected hang of {cfg.engine.faults.hang_s:g}s ended: partition "
                                     f"{partition_id}, round {server_round}")


_decode_lock = threading.Lock()
_last_decoded: tuple[Any, dict[str, torch.Tensor]] | None = None


def _decoded(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``, decoded once per record object.

    Strategies send one ArrayRecord object to every client of a round; in-process engines would
    otherwise decode the same bytes once per client.  Learners only read the tensors (they copy them
    into their model), so sharing the decoded dict is safe.
    """
    global _last_decoded
    with _decode_lock:
        if _last_decoded is not None and _last_decoded[0] is record:
            return _last_decoded[1]
    state = record.to_torch_state_dict()
    with _decode_lock:
        _last_decoded = (record, state)
    return state


def reply_metric_values(result: Any, cfg: C.ExperimentConfig | None = None) -> dict[str, Any]:
    """The metric values of a ``train`` reply: the learner's metrics and the weight keys.

    Under ``privacy.release=strict`` only the ledger's metrics, weighing 1
    (:func:`privacy.release.reply_metrics`)."""
    values, weight = dict(result.metrics), result.num_examples
    if cfg is not None and cfg.privacy.enabled:
        from privacy.release import reply_metrics

        values, weight = reply_metrics(cfg, values, weight)
    return {**values, NUM_EXAMPLES: weight, UNIT_WEIGHT: 1}


def train_reply(msg: Message, result: Any, cfg: C.ExperimentConfig | None = None) -> Message:
    """The reply of a ``train`` message from a learner's :class:`~fedsim.contracts.learner.TrainResult`."""
    metrics = metric_record(reply_metric_values(result, cfg))
    arrays = resident_record(result.arrays, copy=not getattr(result, "owned", False))
    return Message(ReplyRecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def result_reply(msg: Message, result: Any, cfg: C.ExperimentConfig | None = None) -> Message:
    """:func:`train_reply`'s reply as a :class:`~fedsim.engine.records.ResultReply`: the same content, built
    only if something reads it (the in-process engine's replies)."""
    return ResultReply(msg, host_arrays(result.arrays, copy=not getattr(result, "owned", False)),
                       reply_metric_values(result, cfg))


def evaluate_reply(msg: Message, result: Any) -> Message:
    metrics = metric_record({**result.metrics, NUM_EXAMPLES: result.num_examples})
    return Message(ReplyRecordDict({"metrics": metrics}), reply_to=msg)


class _inside_learner:  # noqa: N801  (a cheap context manager: entered once per client call)
    """Mark this thread as using the learner for the block."""

    __slots__ = ("ident",)

    def __enter__(self) -> None:
        self.ident = threading.get_ident()
        with _cache_lock:
            _in_learner.add(self.ident)

    def __exit__(self, *exc: Any) -> None:
        with _cache_lock:
            _in_learner.discard(self.ident)


def query_reply(msg: Message, context: Context) -> Message:
    """The reply of fedsim's ClientApp to the set-up query: the node's partition id."""
    pid = int(context.node_config["partition-id"])
    return Message(RecordDict({"metrics": MetricRecord({PARTITION_ID: pid})}), reply_to=msg)


def learner_call(spec: RunSpec, msg: Message, context: Context, method: str, cfg: C.ExperimentConfig | None = None,
                 configs: dict[int, tuple[Any, dict[str, Any]]] | None = None) -> Callable[[], Any]:
    """What fedsim's ClientApp does for a ``train`` / ``evaluate`` message, as a call to run later: the
    injected fault (training only), then the learner's method on the message's arrays, returning its
    :class:`~fedsim.contracts.learner.TrainResult` / ``EvalResult`` (:func:`train_reply` / :func:`evaluate_reply`
    make the reply).  The learner is looked up when the call runs (a timeout may have replaced it).
    ``cfg``: ``spec.cfg`` when the caller has it already; ``configs``: :func:`node_context`'s cache."""
    cfg = spec.cfg if cfg is None else cfg
    ctx = node_context(msg, context, cfg, configs)
    fault = (injected_fault(cfg, ctx.partition_id, ctx.server_round, int(ctx.config.get(ATTEMPT, 0)))
             if method == "train" else None)  # decided now (it is seeded), carried out when the call runs
    threads = cfg.engine.threads_per_client
    missing: Exception | None = None
    try:
        arrays = _decoded(msg.content["arrays"])
    except Exception as exc:  # no or bad arrays: the call raises it, as the learner call would
        missing = exc

    def call() -> Any:
        if fault is not None:
            _strike(cfg, fault, ctx.partition_id, ctx.server_round)
        if missing is not None:
            raise missing
        with torch_threads(threads), _inside_learner():
            return getattr(get_learner(spec), method)(arrays, ctx)

    return call


def build_client_app(spec: RunSpec, deadline: float | None = None) -> ClientApp:
    """A Flower ClientApp serving train / evaluate / query with this run's learner.

    With ``deadline`` each train / evaluate call runs under :func:`call_with_deadline` inside the
    ClientApp (the flower engine, whose runtime has no per-call limit of its own, and the ray
    engine's actors): an overrun is answered with a :class:`ClientTimeout` error reply and frees its
    worker for the next call.  The learner is built (data loaded) before that clock starts.
    """
    app = ClientApp()

    app.query()(query_reply)

    def serve(msg: Message, context: Context, method: str) -> Any:
        if deadline is not None:  # a process's first call builds the learner: set-up, not the client's time
            warm_learner(spec)
        return call_with_deadline(learner_call(spec, msg, context, method), deadline)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return train_reply(msg, serve(msg, context, "train"), spec.cfg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return evaluate_reply(msg, serve(msg, context, "evaluate"))

    return app
