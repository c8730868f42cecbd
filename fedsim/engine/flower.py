"""The ``flower`` engine: Flower's simulation runtime with its Ray backend (``run_simulation``).

Quiet by default (telemetry off, Ray log forwarding off, Flower's logger at ERROR), resources are
checked before Ray starts (an oversized ``client_resources`` request otherwise hangs Flower's actor
pool forever), and a watchdog stops a simulation that exceeds ``engine.flower.timeout_s``.

Hangs are contained although Flower's runtime has no per-call deadline: each train / evaluate call
runs under :func:`~fedsim.engine.runtime.client_call_limit` inside the ClientApp (the overrunning
thread is abandoned in its actor, the call answered with a timeout error), so a hanging client holds
its actor for that long only and the calls after it run.  The server waits on Flower's grid through
:class:`StoppableGrid`: every call is answered, bounded by that limit, and the server thread stops
at once when the run is interrupted or timed out (Flower joins it before returning).

Signals: Ray is started here, before ``run_simulation``, with fedsim's signal handlers kept (the
handler ``ray.init`` installs would end a SIGTERM-ed run FAILED instead of KILLED).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedsim.engine import reaper
from fedsim.engine.driver import error_reply
from fedsim.engine.ray_address import check_cluster, cluster_address, joining
from fedsim.contracts.history import RoundObserver
from fedsim.engine.runtime import RunSpec, bounded_wait, build_client_app, client_call_limit
from fedsim.engine.server import ServerResult, run_server
from fedsim.registry import ENGINES
from fedsim.errors import ConfigError, RunFailedError
from fedsim.logs import quiet_third_party
from fedsim.run_lifecycle import signal_handlers_kept

#: Seconds a round may wait beyond its calls' deadlines (Flower's queues and polling).
WAIT_SLACK_S = 30.0
#: Seconds the watchdog waits for a stopped simulation to return before interrupting the main thread.
WATCHDOG_GRACE_S = 15.0


class SimulationStopped(RunFailedError):
    """The server thread was told to stop (the run was interrupted or exceeded its time limit)."""


class StoppableGrid(Grid):
    """Flower's simulation grid, waited on call by call, with a stop switch for the server thread.

    ``send_and_receive`` returns when every reply is in, or after ``calls × limit + slack`` (each
    call is bounded by ``limit`` inside the ClientApp, so that only happens if the runtime lost one),
    and raises :class:`SimulationStopped` within ``poll_s`` of ``stop`` being set.
    """

    def __init__(self, inner: Grid, limit: float, stop: threading.Event, poll_s: float = 0.05) -> None:
        self.inner = inner
        self.limit = limit
        self.stop = stop
        self.poll_s = poll_s

    def set_run(self, run_id: int) -> None:  # pragma: no cover - Flower sets the inner run
        self.inner.set_run(run_id)

    @property
    def run(self):  # type: ignore[override]
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if timeout is not None and timeout <= 0:
            return [error_reply(m, "timeout: the round's deadline passed before this client ran") for m in messages]
        limit = self.limit if timeout is None else min(self.limit, timeout)
        waiting = set(self.push_messages(messages))
        give_up = time.monotonic() + len(messages) * limit + WAIT_SLACK_S
        replies: list[Message] = []
        while waiting and time.monotonic() < give_up:
            if self.stop.is_set():
                raise SimulationStopped("the Flower simulation was stopped")
            got = list(self.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if waiting:
                time.sleep(self.poll_s)
        return replies


def backend_config(spec: RunSpec) -> dict[str, Any]:
    """Flower's backend_config for this run, after checking the request fits the machine."""
    fc = spec.cfg.engine.flower
    init_args: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR,
                                 "include_dashboard": False}
    address = cluster_address(fc.address)  # as ray.init and the ray engine read it
    if address:  # a cluster's CPUs and GPUs are its own: ray.init refuses num_cpus when joining one
        check_cluster(fc.address, "engine.flower.address")
        init_args["address"] = address
    else:
        cpus = fc.ray_num_cpus or os.cpu_count() or 1
        if fc.client_num_cpus > cpus:
            raise ConfigError(f"engine.flower.client_num_cpus={fc.client_num_cpus} exceeds the {cpus} CPUs Ray may use; "
                              f"lower it or raise engine.flower.ray_num_cpus")
        if fc.client_num_gpus > 0:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("engine.flower.client_num_gpus > 0 but no CUDA GPU is visible; set it to 0")
        init_args["num_cpus"] = cpus
    return {"client_resources": {"num_cpus": fc.client_num_cpus, "num_gpus": fc.client_num_gpus},
            "init_args": init_args}


@ENGINES.register("flower", preflight=backend_config, summary="Flower's simulation runtime (Ray backend)")
def run_flower(spec: RunSpec, observers: list[RoundObserver]) -> ServerResult:
    from flwr.app import Context
    from flwr.serverapp import ServerApp

    cfg = spec.cfg
    verbose = cfg.engine.verbose
    quiet_third_party(verbose)
    config = backend_config(spec)
    limit = client_call_limit(cfg)
    outcome: dict[str, Any] = {}
    stop = threading.Event()
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            outcome["result"] = run_server(StoppableGrid(grid, limit, stop), spec, observers)
        except BaseException as exc:  # re-raised in the caller's thread below
            outcome["error"] = exc

    client_app = build_client_app(spec, deadline=limit)
    if simulate(server, client_app, cfg.num_clients, config, verbose, cfg.engine.flower.timeout_s, stop):
        raise RunFailedError(f"the Flower simulation exceeded engine.flower.timeout_s="
                             f"{cfg.engine.flower.timeout_s:g}s and was stopped")
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise RunFailedError("the Flower simulation ended without a result (see the log above)")
    return outcome["result"]


def simulate(server: Any, client_app: Any, num_nodes: int, config: dict[str, Any], verbose: bool,
             timeout_s: float, stop: threading.Event) -> bool:
    """Flower's ``run_simulation`` on Ray under the watchdog; True when it ran past ``timeout_s``.

    ``stop`` is set when the simulation returns (the server thread, if still running, stops at its
    next poll).  A Ray session that was already running (the user's own, a sweep's) stays up: only a
    Ray started here is shut down.
    """
    from flwr.simulation import run_simulation

    finished, timed_out = threading.Event(), threading.Event()
    watchdog = threading.Thread(target=_watchdog, args=(timeout_s, stop, finished, timed_out),
                                name="fedsim-flower-watchdog", daemon=True)
    started = _init_ray(config)
    watchdog.start()
    try:
        with contextlib.nullcontext() if started else _ray_session_kept():
            run_simulation(server_app=server, client_app=client_app, num_supernodes=num_nodes,
                           backend_config=config, verbose_logging=verbose)
    except KeyboardInterrupt:
        if not timed_out.is_set():
            raise
    finally:
        finished.set()
        stop.set()
        if started:
            _shutdown_ray()
    return timed_out.is_set()


@contextlib.contextmanager
def _ray_session_kept() -> Iterator[None]:
    """Within the block, Flower's Ray backend ends its own actors but not the Ray session.

    Flower's ``RayBackend.terminate`` calls ``ray.shutdown()``, which would end a session the user
    (or a caller such as a sweep) started before the run.  Flower looks the class up in its module
    each time it builds a backend, so the subclass is swapped in for the block only.
    """
    import ray
    from flwr.server.superlink.fleet.vce.backend import raybackend

    original = raybackend.RayBackend

    class SessionKeepingRayBackend(original):  # type: ignore[misc, valid-type]
        def terminate(self) -> None:
            pool = self.pool
            if pool is None:
                return
            busy = list(getattr(pool, "_future_to_actor", {}).values())  # a hung call's actor is not idle
            for actor in [*pool.pool, *busy]:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)

    raybackend.RayBackend = SessionKeepingRayBackend
    try:
        yield
    finally:
        raybackend.RayBackend = original


def _watchdog(timeout_s: float, stop: threading.Event, finished: threading.Event, timed_out: threading.Event) -> None:
    """After ``timeout_s``: stop the server; if the simulation still has not returned, interrupt it."""
    if finished.wait(bounded_wait(timeout_s)):
        return
    timed_out.set()
    stop.set()
    if not finished.wait(WATCHDOG_GRACE_S):
        os.kill(os.getpid(), signal.SIGINT)  # a real signal wakes a main thread blocked in a join


def _init_ray(config: dict[str, Any]) -> bool:
    """Start Ray as Flower's backend would, but keep fedsim's signal handlers (see the module doc);
    True when this call started it (False: a session was already running)."""
    import ray

    if ray.is_initialized():
        return False
    if "address" not in config["init_args"]:
        reaper.ensure_started()  # the agents of a local Ray must not outlive a killed driver
    pythonpath = os.pathsep.join([*sys.path, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    with signal_handlers_kept(), joining(config["init_args"].get("address"), "engine.flower.address"):
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **{"include_dashboard": False,
                                                                            **config["init_args"]})
    return True


def _shutdown_ray() -> None:
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # pragma: no cover - best effort cleanup
        pass
