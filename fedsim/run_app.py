"""``fedsim run-app PATH``: a user's Flower app (``ServerApp`` + ``ClientApp``) on fedsim's engines.

The reverse of :mod:`fedsim.export`.  ``PATH`` is a standard Flower app directory: its
``pyproject.toml`` names the components (``[tool.flwr.app.components]`` ``serverapp`` /
``clientapp``, ``"module:attr"``) and the run config (``[tool.flwr.app.config]``), and may declare a
simulation federation (``[tool.flwr.federations.<default>] options.num-supernodes``).  The app's
directory goes on ``sys.path`` (as ``flwr run`` does); engine processes load the ClientApp from it
themselves.

What fedsim adds around the user's code, on every engine:

* the grid: the user's ServerApp ``main(grid, context)`` runs against the engine's node grid
  (``local``: :class:`~fedsim.engine.local.InProcessGrid`; ``ray``:
  :class:`~fedsim.engine.ray_pool.RayActorGrid`; ``flower``: Flower's own simulation runtime),
  wrapped in :class:`AppGrid`, which puts node ids and replies in partition order (so a seeded
  Flower strategy samples and aggregates alike on every engine) and records the traffic; each node's
  ``Context`` carries ``node_config`` ``partition-id`` / ``num-partitions`` and the run config;
* seeding: the ServerApp starts with Python's, NumPy's and torch's generators seeded from
  ``(seed, "server-app")``, and every ClientApp call runs with them seeded from
  ``(seed, message kind, round, partition)`` (and restored afterwards) on one torch thread, so the
  same seed gives the same metrics on every engine;
* tracking: one MLflow run (experiment ``flower-apps``) with params ``run_config.<key>``, ``engine``,
  ``num_nodes``, ``seed`` and, per round (the ``server-round`` of the messages), the example-weighted
  mean (by ``num-examples``) of every numeric metric of the replies as ``train/<key>`` /
  ``evaluate/<key>``, and the client counts ``round/train_ok``, ``round/train_failed``,
  ``round/evaluate_ok``, ``round/evaluate_failed`` (plus ``round/clients_ok`` / ``clients_failed`` /
  ``seconds``); the run ends FINISHED, FAILED or KILLED (:mod:`fedsim.run_lifecycle`);
* progress: fedsim's bar over rounds (``num-server-rounds`` of the run config, when it has one).

Legacy apps (``ServerApp(server_fn=...)`` with a ``flwr.server.strategy`` strategy,
``ClientApp(client_fn=...)`` with a ``NumPyClient``) run through Flower's ``start_grid``: their
replies' metrics are read from Flower's compat records (:func:`reply_outcome`), the round from the
messages' ``group_id``, and a strategy minimum above the simulated nodes is an error up front
(:func:`legacy_checked`).  Flower's legacy server aggregates in the order of a set of futures, so
their metrics repeat up to float rounding only.

Only the traffic of the grid is seen: what the ServerApp computes itself (a centralised
``evaluate_fn``, the ``Result`` of ``strategy.start``) is the user's to log.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import sys
import threading
import time
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedsim.errors import ConfigError, RunFailedError

log = logging.getLogger("fedsim")

#: The engines that can run a user's ServerApp.
APP_ENGINES = ("local", "ray", "flower")
#: Nodes when neither ``--num-nodes`` nor the app's federation says how many.
DEFAULT_NUM_NODES = 10
#: The MLflow experiment of ``fedsim run-app`` runs.
EXPERIMENT = "flower-apps"
#: Run-config key that sizes the progress bar (Flower's templates use it for the rounds).
ROUNDS_KEY = "num-server-rounds"
#: Consecutive ``get_node_ids`` calls without a message, and seconds they span, before the run fails
#: (Flower's strategies poll once a second while fewer nodes than they need are connected; simulated
#: nodes never join later).
MAX_NODE_POLLS, MAX_NODE_POLL_S = 5, 3.0
#: Content key of the node discovery query (the ``flower`` engine's random node ids -> partitions).
DISCOVER_KEY = "fedsim-discover"
PARTITION_ID, NUM_EXAMPLES, SERVER_ROUND = "partition-id", "num-examples", "server-round"  # Flower's keys

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_COMPONENT = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")  # Flower's own pattern (flwr.common.config)


# --------------------------------------------------------------------------------------- the app


@dataclass(frozen=True)
class FlowerApp:
    """A Flower app directory as its ``pyproject.toml`` declares it."""

    path: Path
    name: str
    serverapp: str  # "module:attr"
    clientapp: str
    config: dict[str, Any]  # [tool.flwr.app.config], flattened with dots
    num_supernodes: int | None  # options.num-supernodes of the default federation, if declared


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


def load_app(path: str | Path) -> FlowerApp:
    """Read and check the app at ``path``; every problem is a one-line :class:`ConfigError`."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"{path}: no such directory; give a Flower app directory (with a pyproject.toml)")
    if not root.is_dir():
        raise ConfigError(f"{path}: not a directory; give a Flower app directory (with a pyproject.toml)")
    toml = root / "pyproject.toml"
    if not toml.is_file():
        raise ConfigError(f"{path}: no pyproject.toml; a Flower app declares its components in "
                          f"pyproject.toml's [tool.flwr.app] section")
    try:
        data = tomllib.loads(toml.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{toml}: not valid TOML ({' '.join(str(exc).split())})") from None
    app = ((data.get("tool") or {}).get("flwr") or {}).get("app")
    if not isinstance(app, dict):
        raise ConfigError(f"{toml}: no [tool.flwr.app] section; this is not a Flower app")
    components = app.get("components")
    if not isinstance(components, dict):
        raise ConfigError(f"{toml}: no [tool.flwr.app.components] section (serverapp = \"pkg.module:app\", "
                          f"clientapp = \"pkg.module:app\")")
    refs = {}
    for kind in ("serverapp", "clientapp"):
        ref = components.get(kind)
        if not isinstance(ref, str) or not _COMPONENT.match(ref.strip()):
            got = "missing" if ref is None else repr(ref)
            raise ConfigError(f"{toml}: [tool.flwr.app.components] {kind} is {got}; expected \"module:attribute\", "
                              f"e.g. \"mypkg.{kind.replace('app', '_app')}:app\"")
        refs[kind] = ref.strip()
    config = app.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{toml}: [tool.flwr.app.config] must be a table of key = value")
    config = _flatten(config)
    for key, value in config.items():
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"{toml}: [tool.flwr.app.config] {key} = {value!r}: a run-config value is a bool, "
                              f"an int, a float or a string")
    project = data.get("project") or {}
    name = str(project.get("name") or root.resolve().name)
    return FlowerApp(root.resolve(), name, refs["serverapp"], refs["clientapp"], config, _num_supernodes(data, toml))


def _num_supernodes(data: dict[str, Any], toml: Path) -> int | None:
    """``options.num-supernodes`` of the default federation (or the only one), if the app declares it."""
    federations = ((data.get("tool") or {}).get("flwr") or {}).get("federations")
    if not isinstance(federations, dict):
        return None
    tables = {k: v for k, v in federations.items() if isinstance(v, dict)}
    default = federations.get("default")
    table = tables.get(default) if isinstance(default, str) else (next(iter(tables.values())) if len(tables) == 1
                                                                  else None)
    value = ((table or {}).get("options") or {}).get("num-supernodes")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{toml}: options.num-supernodes = {value!r}; expected a positive integer")
    return value


# ------------------------------------------------------------------------------------ run config


def parse_overrides(items: Sequence[str]) -> list[tuple[str, str]]:
    """``key=value`` pairs from ``--run-config`` strings (several space-separated pairs each, as Flower
    reads them) and single ``key=value`` arguments, in order."""
    pairs: list[tuple[str, str]] = []
    for item in items:
        text = item.strip()
        if not text:
            continue
        found = _PAIR.findall(text)
        rest = _PAIR.sub("", text).strip()
        if not found or rest:
            raise ConfigError(f"run config {item!r}: expected key=value pairs separated by spaces, e.g. "
                              f"'num-server-rounds=3 lr=0.1 name=\"run a\"'")
        pairs += [(k, v) for k, v in found]
    return pairs


def _typed(raw: str) -> Any:
    """A value as TOML reads it (``3`` int, ``0.1`` float, ``true`` bool, ``"x"`` string); else the text."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip("'\"")


def merge_run_config(defaults: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The app's run config with ``overrides`` applied: only declared keys, each with its default's type
    (an int is accepted for a float; a number or bool is kept as text for a string)."""
    merged = dict(defaults)
    for key, raw in parse_overrides(overrides):
        if key not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise ConfigError(f"run config: unknown key {key!r}; the app declares {known} "
                              f"([tool.flwr.app.config] of its pyproject.toml)")
        default, value = defaults[key], _typed(raw)
        if isinstance(default, str):
            value = value if isinstance(value, str) else raw.strip("'\"")
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"run config: {key}={raw} is not a bool (true or false)")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"run config: {key}={raw} is not an integer (the default is {default})")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"run config: {key}={raw} is not a number (the default is {default})")
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"run config: {key}={raw} is not a finite number")
        merged[key] = value
    return merged


# ---------------------------------------------------------------------------------- components


def _on_sys_path(directory: Path) -> None:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))


@contextlib.contextmanager
def app_on_path(directory: Path) -> Iterator[None]:
    """The app's directory first on ``sys.path`` for the block (as ``flwr run`` puts it), removed after
    if it was not there before (engine worker processes keep it: they serve this app only)."""
    entry = str(directory)
    added = entry not in sys.path
    _on_sys_path(directory)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _forget_foreign(module: str, directory: Path) -> None:
    """Drop cached modules of ``module``'s top package that come from another directory (another app
    of the same package name, loaded before in this process); only for a package the app ships."""
    top = module.split(".")[0]
    if not ((directory / top).is_dir() or (directory / f"{top}.py").is_file()):
        return  # an installed package: imported as it is
    for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
        file = getattr(sys.modules[name], "__file__", None)
        if file and not Path(file).resolve().is_relative_to(directory):
            del sys.modules[name]


_load_lock = threading.Lock()


def load_component(app_dir: Path, ref: str, kind: str) -> Any:
    """The ``ServerApp`` / ``ClientApp`` named by ``ref`` ("module:attr") in the app at ``app_dir``."""
    from fedsim.registry import import_user_module

    module_name, _, attrs = ref.partition(":")
    with _load_lock:
        _on_sys_path(app_dir)
        _forget_foreign(module_name, app_dir)
        obj: Any = import_user_module(module_name, f"[tool.flwr.app.components] {kind} = {ref!r}")
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"[tool.flwr.app.components] {kind} = {ref!r}: module {module_name!r} has no "
                              f"attribute {attrs!r}")
        obj = getattr(obj, attr)
    expected = ServerApp if kind == "serverapp" else ClientApp
    if not isinstance(obj, expected):
        raise ConfigError(f"[tool.flwr.app.components] {kind} = {ref!r} is a {type(obj).__name__}, not a "
                          f"flwr {expected.__name__}")
    return obj


# ------------------------------------------------------------------------------- the plan of a run


@dataclass(frozen=True)
class AppPlan:
    """What a run of an app is: picklable, shipped to engine processes."""

    app: FlowerApp
    run_config: dict[str, Any]
    engine: str
    num_nodes: int
    seed: int
    verbose: bool = False

    def spec(self) -> Any:
        """A fedsim RunSpec holding the engine settings (defaults) for the ray and flower engines."""
        from fedsim import config as C
        from fedsim.engine.runtime import RunSpec

        cfg = C.ExperimentConfig()
        cfg.name, cfg.num_clients, cfg.seed = self.app.name[:200] or "app", self.num_nodes, self.seed
        cfg.engine.name, cfg.engine.verbose, cfg.tracking.enabled = self.engine, self.verbose, False
        return RunSpec.from_config(cfg)


def plan_run(path: str | Path, overrides: Sequence[str] = (), *, engine: str = "local", num_nodes: int | None = None,
             seed: int = 0, verbose: bool = False) -> AppPlan:
    """Check everything before a run starts: the app, its components, the run config, the engine."""
    if engine not in APP_ENGINES:
        raise ConfigError(f"engine {engine!r} cannot run a Flower app's ServerApp; `fedsim run-app` runs on "
                          f"{', '.join(APP_ENGINES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 4294967295:
        raise ConfigError(f"--seed {seed}: expected an integer in 0..4294967295")
    app = load_app(path)
    run_config = merge_run_config(app.config, overrides)
    nodes = num_nodes if num_nodes is not None else (app.num_supernodes or DEFAULT_NUM_NODES)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 100_000:
        raise ConfigError(f"--num-nodes {nodes}: expected an integer in 1..100000")
    rounds = run_config.get(ROUNDS_KEY)
    if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds < 0:
        raise ConfigError(f"run config: {ROUNDS_KEY}={rounds} is negative")
    with app_on_path(app.path):
        load_component(app.path, app.serverapp, "serverapp")
        load_component(app.path, app.clientapp, "clientapp")
    plan = AppPlan(app, run_config, engine, nodes, seed, verbose)
    if engine == "ray":
        from fedsim.engine.ray_pool import check_ray_resources

        check_ray_resources(plan.spec())
    elif engine == "flower":
        from fedsim.engine.flower import backend_config

        backend_config(plan.spec())
    return plan


# ------------------------------------------------------------------------------- client side


@contextlib.contextmanager
def seeded(root: int, *parts: int | str) -> Iterator[None]:
    """The block with Python's, NumPy's and torch's global generators seeded from ``(root, *parts)``;
    their states are restored afterwards (a client call in the server's process leaves no trace)."""
    import torch

    from fedsim.seeding import seed_everything

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    seed_everything(root, *parts)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


_clients: dict[tuple[str, str], Any] = {}
#: One ClientApp call at a time per process: each seeds the global generators and sets torch's
#: threads, and Flower's legacy server (``ServerApp(server_fn=...)``) sends from a thread pool.
_CLIENT_CALLS = threading.Lock()


class AppClient(ClientApp):
    """The user's ClientApp as every engine runs it: loaded once per process from the app directory,
    called with the run config in its Context, seeded per (seed, kind, round, partition), on one torch
    thread.  Answers the engine's discovery query itself.  Picklable (the user's app is not pickled)."""

    def __init__(self, plan: AppPlan) -> None:
        super().__init__()
        self.plan = plan

    def user_app(self) -> ClientApp:
        key = (str(self.plan.app.path), self.plan.app.clientapp)
        if key not in _clients:
            _clients[key] = load_component(self.plan.app.path, self.plan.app.clientapp, "clientapp")
        return _clients[key]

    def __call__(self, message: Message, context: Context) -> Message:
        from fedsim.threads import torch_threads

        partition = int(context.node_config[PARTITION_ID])
        if message.metadata.message_type == MessageType.QUERY and DISCOVER_KEY in message.content:
            return Message(RecordDict({DISCOVER_KEY: MetricRecord({PARTITION_ID: partition})}), reply_to=message)
        # a Context of its own: Flower's simulation refuses a changed run_config; the state is shared
        own = _with_run_config(context, self.plan.run_config)
        kind = message.metadata.message_type.split(".")[0]
        with _CLIENT_CALLS:
            try:
                with seeded(self.plan.seed, "app-client", kind, max(_round_in(message), 0), partition), \
                        torch_threads(1):
                    return self.user_app()(message, own)
            finally:
                context.state = own.state


def _with_run_config(context: Context, run_config: dict[str, Any]) -> Context:
    """A copy of ``context`` (same node config and state object) carrying ``run_config``."""
    return Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                   state=context.state, run_config=dict(run_config))


def _round_in(message: Any) -> int:
    """The ``server-round`` of a message's config records, else its ``group_id`` when that is a
    number (Flower's legacy ``start_grid`` sends the round there), else -1."""
    for record in message.content.config_records.values():
        value = record.get(SERVER_ROUND)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    group = message.metadata.group_id
    return int(group) if isinstance(group, str) and group.isdigit() else -1


def _numeric(record: Any) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def reply_outcome(reply: Any) -> tuple[dict[str, float], str | None]:
    """A train / evaluate reply's numeric metrics (its ``num-examples`` weight included) and, if it
    failed, why.

    A message-API reply carries its metrics in its metric records.  A legacy reply (a
    ``NumPyClient`` / ``Client`` behind ``ClientApp(client_fn=...)``) carries them in Flower's compat
    layout: ``{fitres,evaluateres}.metrics`` (a config record), ``.num_examples`` (the weight),
    ``evaluateres.loss`` and a ``.status`` whose non-zero code is a failure."""
    if reply.has_error():
        reason = [ln for ln in (reply.error.reason or "").splitlines() if ln.strip()]
        return {}, reason[-1].strip() if reason else str(reply.error.code)
    content = reply.content
    legacy = next((res for res in ("fitres", "evaluateres") if f"{res}.status" in content.config_records), None)
    if legacy is None:
        metrics: dict[str, float] = {}
        for record in content.metric_records.values():
            metrics.update(_numeric(record))
        return metrics, None
    status = content.config_records[f"{legacy}.status"]
    if status.get("code", 0) != 0:
        return {}, f"status {status.get('code')}: {status.get('message', '')}"
    metrics = _numeric(content.config_records.get(f"{legacy}.metrics", {}))
    if f"{legacy}.loss" in content.metric_records:
        metrics.update(_numeric(content.metric_records[f"{legacy}.loss"]))
    examples = content.metric_records.get(f"{legacy}.num_examples", {}).get("num_examples")
    if isinstance(examples, (int, float)):
        metrics[NUM_EXAMPLES] = float(examples)
    return metrics, None


# ------------------------------------------------------------------------------- server side


@dataclass
class _Round:
    started: float
    ok: dict[str, list[tuple[int, dict[str, float]]]] = field(default_factory=dict)  # kind -> (partition, metrics)
    failed: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class RoundCollector:
    """Per-round statistics of the grid traffic, emitted to the observers as each round ends."""

    def __init__(self, observers: list[Any]) -> None:
        self.observers = observers
        self.current: tuple[int, _Round] | None = None
        self.last_round = 0
        self.lock = threading.Lock()

    def round_of(self, kind: str, server_round: int) -> int:
        """The round a message belongs to: its ``server-round``, else the running count."""
        if server_round >= 0:
            return server_round
        return self.last_round + 1 if kind == "train" else max(self.last_round, 1)

    def begin(self, server_round: int) -> None:
        """Traffic of ``server_round`` starts: an earlier round has ended."""
        with self.lock:
            if self.current is not None and server_round != self.current[0]:
                self._flush()
            if self.current is None:
                self.current = (server_round, _Round(time.perf_counter()))
            self.last_round = max(self.last_round, server_round)

    def observe(self, kind: str, server_round: int, replies: list[Any], missing: int,
                partition_of: dict[int, int]) -> None:
        """Record ``replies`` (and ``missing`` unanswered messages) of a ``kind`` round."""
        self.begin(server_round)
        with self.lock:
            assert self.current is not None
            stats = self.current[1]
            for reply in replies:
                partition = partition_of.get(reply.metadata.src_node_id, -1)
                metrics, failure = reply_outcome(reply)
                if failure is not None:
                    stats.failed[kind] = stats.failed.get(kind, 0) + 1
                    stats.failures.append(f"{kind}: partition {partition if partition >= 0 else '?'}: {failure}")
                    continue
                stats.ok.setdefault(kind, []).append((partition, metrics))
            if missing:
                stats.failed[kind] = stats.failed.get(kind, 0) + missing
                stats.failures += [f"{kind}: no reply"] * missing

    def finish(self) -> None:
        with self.lock:
            if self.current is not None:
                self._flush()

    def _flush(self) -> None:
        from fedsim.contracts.history import RoundRecord

        assert self.current is not None
        server_round, stats = self.current
        self.current = None
        metrics: dict[str, float] = {}
        for kind in sorted(set(stats.ok) | set(stats.failed)):
            replies = [m for _, m in sorted(stats.ok.get(kind, []), key=lambda pm: pm[0])]  # arrival order varies
            metrics.update({mlflow_key(f"{kind}/{k}"): v for k, v in weighted_means(replies).items()})
            metrics[f"round/{kind}_ok"] = float(len(replies))
            metrics[f"round/{kind}_failed"] = float(stats.failed.get(kind, 0))
        for failure in stats.failures:
            log.warning("round %d: client failure: %s", server_round, failure)
        record = RoundRecord(server_round, metrics, time.perf_counter() - stats.started,
                             clients_ok=len(stats.ok.get("train", [])),
                             clients_failed=sum(stats.failed.values()), failures=list(stats.failures))
        for obs in self.observers:
            obs.on_round(record)


def mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in metric and param names replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key)[:250]


def weighted_means(replies: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the mean over the replies that have it, weighted by their ``num-examples`` (else 1)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics in replies:
        w = metrics.get(NUM_EXAMPLES, 1.0)
        w = w if math.isfinite(w) and w >= 0 else 1.0
        for k, v in metrics.items():
            if k == NUM_EXAMPLES:
                continue
            sums[k] = sums.get(k, 0.0) + w * v
            weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


class AppGrid(Grid):
    """The grid the user's ServerApp sees: the engine's grid with node ids ``partition + 1`` (the
    ``flower`` engine's are random, so a strategy that samples or orders by node id would differ
    between engines) and replies in partition order, and every train / evaluate reply recorded by a
    :class:`RoundCollector`."""

    def __init__(self, inner: Grid, collector: RoundCollector, partition_of: dict[int, int]) -> None:
        self.inner = inner
        self.collector = collector
        self.partition_of = partition_of  # the engine's node id -> partition
        self.engine_node = {p + 1: node for node, p in partition_of.items()}
        self.app_node = {node: p + 1 for node, p in partition_of.items()}
        self.pushed: dict[str, tuple[str, int]] = {}  # message id -> (kind, round), for push/pull users
        self.polls = 0  # get_node_ids calls since the last message: a strategy waiting for nodes
        self.polling_since = 0.0
        self.in_flight = 0  # send_and_receive calls under way (Flower's legacy server polls meanwhile)
        self.lock = threading.Lock()

    def set_run(self, run_id: int) -> None:  # pragma: no cover - the engine sets the inner run
        self.inner.set_run(run_id)

    @property
    def run(self):  # type: ignore[override]
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def _order(self, node: int) -> tuple[int, int]:
        return self.partition_of.get(node, 1 << 62), node

    def get_node_ids(self) -> list[int]:
        """The nodes in partition order; a strategy that keeps polling for more (every simulated node
        is there from the start, none will join) fails the run instead of waiting for ever."""
        nodes = [self.app_node.get(n, n) for n in sorted(self.inner.get_node_ids(), key=self._order)]
        with self.lock:
            if self.in_flight:  # a round is under way: this is not a wait for nodes
                return nodes
            if self.polls == 0:
                self.polling_since = time.monotonic()
            self.polls += 1
            waiting = self.polls > MAX_NODE_POLLS and time.monotonic() - self.polling_since > MAX_NODE_POLL_S
        if waiting:
            raise RunFailedError(f"the ServerApp keeps waiting for more nodes than the {len(nodes)} simulated "
                                 f"(a strategy's min_available_nodes / min_train_nodes?); raise --num-nodes or "
                                 f"lower the strategy's minimum")
        return nodes

    def _to_engine(self, messages: list[Message]) -> list[Message]:
        for msg in messages:
            msg.metadata.dst_node_id = self.engine_node.get(msg.metadata.dst_node_id, msg.metadata.dst_node_id)
        return messages

    def _to_app(self, replies: list[Message]) -> list[Message]:
        for reply in replies:  # Metadata has no setter for the source
            reply.metadata.__dict__["_src_node_id"] = self.app_node.get(reply.metadata.src_node_id,
                                                                         reply.metadata.src_node_id)
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.polls = 0
        messages = self._to_engine(list(messages))
        ids = list(self.inner.push_messages(messages))
        for msg_id, msg in zip(ids, messages):
            self.pushed[msg_id] = _kind_round(msg, self.collector)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            kind, server_round = self.pushed.pop(reply.metadata.reply_to_message_id, ("", -1))
            if kind in ("train", "evaluate"):
                self.collector.observe(kind, server_round, [reply], 0, self.partition_of)
        return self._to_app(replies)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages:
            return []
        kind, server_round = _kind_round(messages[0], self.collector)
        tracked = kind in ("train", "evaluate")
        if tracked:
            self.collector.begin(server_round)
        with self.lock:
            self.in_flight, self.polls = self.in_flight + 1, 0
        try:
            replies = sorted(self.inner.send_and_receive(self._to_engine(messages), timeout=timeout),
                             key=lambda m: self._order(m.metadata.src_node_id))
        finally:
            with self.lock:
                self.in_flight, self.polls = self.in_flight - 1, 0
        if tracked:
            self.collector.observe(kind, server_round, replies, max(len(messages) - len(replies), 0),
                                   self.partition_of)
        return self._to_app(replies)


def _kind_round(message: Any, collector: RoundCollector) -> tuple[str, int]:
    kind = message.metadata.message_type.split(".")[0]
    return kind, collector.round_of(kind, _round_in(message)) if kind in ("train", "evaluate") else -1


def discover(grid: Any, num_nodes: int, timeout: float) -> dict[int, int]:
    """Node id -> partition id, by asking every node (Flower's simulation gives random node ids)."""
    deadline = time.monotonic() + timeout
    while len(ids := list(grid.get_node_ids())) < num_nodes:
        if time.monotonic() > deadline:
            raise RunFailedError(f"only {len(ids)} of {num_nodes} simulated nodes came up within {timeout:.0f}s")
        time.sleep(0.05)
    msgs = [Message(RecordDict({DISCOVER_KEY: ConfigRecord({})}), node, MessageType.QUERY) for node in ids]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    bad = [r for r in replies if r.has_error()]
    if len(replies) != len(ids) or bad:
        reason = bad[0].error.reason if bad else "no reply"
        raise RunFailedError(f"{len(ids) - len(replies) + len(bad)} nodes did not answer the setup query: {reason}")
    return {r.metadata.src_node_id: int(r.content[DISCOVER_KEY][PARTITION_ID]) for r in replies}


def serve(inner: Any, plan: AppPlan, collector: RoundCollector, partition_of: dict[int, int],
          context: Any = None) -> None:
    """Run the user's ServerApp on ``inner`` (the engine's grid), seeded, then close the last round."""
    server_app = load_component(plan.app.path, plan.app.serverapp, "serverapp")
    if context is None:
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = _with_run_config(context, plan.run_config)
    grid = AppGrid(inner, collector, partition_of)
    try:
        with seeded(plan.seed, "server-app"):
            legacy_checked(server_app, plan.num_nodes)(grid, context)
    finally:
        collector.finish()


#: A legacy strategy's minimums (``flwr.server.strategy.FedAvg`` and its subclasses).
LEGACY_MINIMUMS = ("min_available_clients", "min_fit_clients", "min_evaluate_clients")


def check_legacy_strategy(strategy: Any, num_nodes: int) -> None:
    """A legacy strategy that needs more clients than there are simulated nodes is an error: Flower's
    ``ClientManager.wait_for`` would block for a day instead (it never polls the grid)."""
    for name in LEGACY_MINIMUMS:
        need = getattr(strategy, name, None)
        if isinstance(need, int) and need > num_nodes:
            raise RunFailedError(f"the ServerApp's strategy has {name}={need} but only {num_nodes} nodes are "
                                 f"simulated; raise --num-nodes or lower the strategy's minimum")


def legacy_checked(server_app: ServerApp, num_nodes: int) -> ServerApp:
    """``server_app``, or for a legacy one (``ServerApp(server_fn=...)`` or ``ServerApp(strategy=...)``,
    run by Flower's ``start_grid``) a copy whose strategy is checked by :func:`check_legacy_strategy`
    first.  Reads ServerApp's private ``_main`` / ``_server_fn`` / ``_strategy``; where a Flower
    version names them otherwise, the app runs unchecked."""
    import copy

    if getattr(server_app, "_main", None) is not None:
        return server_app
    server_fn = getattr(server_app, "_server_fn", None)
    if server_fn is None:
        check_legacy_strategy(getattr(server_app, "_strategy", None), num_nodes)
        return server_app

    def checked(context: Context) -> Any:
        components = server_fn(context)
        check_legacy_strategy(getattr(components, "strategy", None), num_nodes)
        return components

    app = copy.copy(server_app)
    app._server_fn = checked
    return app


def _user_error(exc: BaseException) -> RunFailedError:
    from fedsim.registry import _describe

    return RunFailedError(f"the app's ServerApp raised {_describe(exc)}")


# ------------------------------------------------------------------------------------- engines


def run_local(plan: AppPlan, collector: RoundCollector) -> None:
    """The app on fedsim's in-process grid."""
    from fedsim.engine.local import InProcessGrid, server_identity

    grid = InProcessGrid(AppClient(plan), plan.num_nodes)
    for ctx in grid.contexts.values():
        ctx.run_config = dict(plan.run_config)
    with server_identity(run_id=1):
        serve(grid, plan, collector, {node: node - 1 for node in grid.contexts})


def run_ray(plan: AppPlan, collector: RoundCollector) -> None:
    """The app on fedsim's pool of long-lived Ray actors."""
    import ray
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedsim.engine.driver import task_identity
    from fedsim.engine.ray_pool import RayActorGrid, _init_ray, check_ray_resources

    spec = plan.spec()
    check_ray_resources(spec)
    started = _init_ray(spec.cfg)
    grid = None
    try:
        grid = RayActorGrid(spec, plan.num_nodes, client_app=AppClient(plan))
        for ctx in grid.contexts.values():
            ctx.run_config = dict(plan.run_config)
        with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
            serve(grid, plan, collector, {node: node - 1 for node in grid.contexts})
    finally:
        if grid is not None:
            grid.close()
        if started:
            with contextlib.suppress(Exception):
                ray.shutdown()


def run_flower(plan: AppPlan, collector: RoundCollector) -> None:
    """The app on Flower's simulation runtime (``run_simulation``, Ray backend), as the flower engine runs."""
    from fedsim.engine.flower import StoppableGrid, backend_config, simulate
    from fedsim.engine.runtime import client_call_limit
    from fedsim.logs import quiet_third_party

    spec = plan.spec()
    cfg = spec.cfg
    quiet_third_party(plan.verbose)
    config = backend_config(spec)
    limit = client_call_limit(cfg)
    outcome: dict[str, Any] = {}
    stop = threading.Event()
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            stoppable = StoppableGrid(grid, limit, stop)
            serve(stoppable, plan, collector, discover(stoppable, plan.num_nodes, cfg.engine.round_timeout_s), context)
            outcome["done"] = True
        except BaseException as exc:  # re-raised in the caller's thread below
            outcome["error"] = exc

    if simulate(server, AppClient(plan), plan.num_nodes, config, plan.verbose, cfg.engine.flower.timeout_s, stop):
        raise RunFailedError(f"the Flower simulation exceeded {cfg.engine.flower.timeout_s:g}s and was stopped")
    if "error" in outcome:
        raise outcome["error"]
    if "done" not in outcome:
        raise RunFailedError("the Flower simulation ended without running the ServerApp (see the log above)")


ENGINE_RUNS = {"local": run_local, "ray": run_ray, "flower": run_flower}


# ------------------------------------------------------------------------------------- the run


@dataclass
class AppRunSummary:
    """The outcome of :func:`run_app`: the round records, the MLflow run and the wall time."""

    plan: AppPlan
    records: list[Any]
    wall_seconds: float
    run_id: str | None
    tracking_uri: str | None


def run_app(path: str | Path, overrides: Sequence[str] = (), *, engine: str = "local", num_nodes: int | None = None,
            seed: int = 0, tracking: bool = True, tracking_uri: str | None = None, observers: list[Any] | None = None,
            verbose: bool = False, plan: AppPlan | None = None) -> AppRunSummary:
    """Run the Flower app at ``path`` on a fedsim engine (see the module docstring)."""
    from fedsim.contracts.history import History
    from fedsim.logs import quiet_third_party
    from fedsim.run_lifecycle import tracked_run

    quiet_third_party(verbose)
    plan = plan or plan_run(path, overrides, engine=engine, num_nodes=num_nodes, seed=seed, verbose=verbose)
    recorder = None
    if tracking:
        _phase(observers, "opening the MLflow run")
        from fedsim.tracking import MlflowRecorder, git_commit, resolve_tracking_uri

        uri = resolve_tracking_uri(tracking_uri, check=True)
        recorder = MlflowRecorder(uri, EXPERIMENT, run_name=f"{plan.app.name}-{plan.engine}-seed{plan.seed}",
                                  tags={"app": plan.app.name, "app_path": str(plan.app.path), "engine": plan.engine,
                                        "seed": str(plan.seed), "git_commit": git_commit(),
                                        "serverapp": plan.app.serverapp, "clientapp": plan.app.clientapp})
    history = History()
    collector = RoundCollector([history, *(observers or []), *([recorder] if recorder else [])])
    start = time.perf_counter()
    with tracked_run(recorder), app_on_path(plan.app.path):
        if recorder is not None:
            recorder.log_params({**{mlflow_key(f"run_config.{k}"): v for k, v in plan.run_config.items()},
                                 "engine": plan.engine, "num_nodes": plan.num_nodes, "seed": plan.seed})
            recorder.log_text((plan.app.path / "pyproject.toml").read_text(encoding="utf-8"), "pyproject.toml")
        _phase(observers, f"starting the {plan.engine} engine")
        try:
            ENGINE_RUNS[plan.engine](plan, collector)
        except (ConfigError, RunFailedError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the user's code failed: one line naming where, the traceback in the log
            log.log(logging.ERROR if plan.verbose else logging.DEBUG, "the app's ServerApp failed", exc_info=True)
            raise _user_error(exc) from exc
        wall = time.perf_counter() - start
        if recorder is not None:
            recorder.log_metrics({"run/wall_seconds": wall}, step=max([r.round for r in history.records], default=0))
    return AppRunSummary(plan, history.records, wall, recorder.run_id if recorder else None,
                         recorder.uri if recorder else None)


def _phase(observers: list[Any] | None, name: str) -> None:
    """Tell the observers with an ``on_phase`` (the progress bar) what the run does now."""
    for obs in observers or []:
        if hasattr(obs, "on_phase"):
            obs.on_phase(name)


def progress_total(plan: AppPlan) -> int | None:
    """The rounds the progress bar counts to: ``num-server-rounds`` when the run config has it."""
    rounds = plan.run_config.get(ROUNDS_KEY)
    return rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None


class AppProgress:
    """fedsim's round progress bar, showing the first evaluate and train metric of each round."""

    def __init__(self, total: int | None, label: str, console: Any, started: float | None = None) -> None:
        from fedsim.progress import RoundProgress

        self.bar = RoundProgress(total, label, console, started)  # type: ignore[arg-type]

    def __enter__(self) -> "AppProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def on_phase(self, name: str) -> None:
        self.bar.on_phase(name)

    def on_round(self, record: Any) -> None:
        parts = [f"{k} {v:.3f}" for prefix in ("evaluate/", "train/")
                 for k, v in list((k, v) for k, v in sorted(record.metrics.items()) if k.startswith(prefix))[:1]]
        if record.clients_failed:
            parts.append(f"[red]{record.clients_failed} failed[/red]")
        self.bar.progress.update(self.bar.task, completed=record.round, status="  ".join(parts))
