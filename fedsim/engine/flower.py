"""The ``flower`` engine: Flower's simulation runtime with its Ray backend (``run_simulation``).

Quiet by default (telemetry off, Ray log forwarding off, Flower's logger at ERROR), resources are
checked before Ray starts (an oversized ``client_resources`` request otherwise hangs Flower's actor
pool forever), and a watchdog interrupts a simulation that exceeds ``engine.flower.timeout_s``.
"""

from __future__ import annotations

import _thread
import logging
import os
import threading
from typing import Any

from fedsim.engine.history import RoundObserver
from fedsim.engine.runtime import RunSpec, build_client_app
from fedsim.engine.server import ServerResult, run_server
from fedsim.errors import ConfigError, RunFailedError
from fedsim.logs import quiet_third_party

def backend_config(spec: RunSpec) -> dict[str, Any]:
    """Flower's backend_config for this run, after checking the request fits the machine."""
    fc = spec.cfg.engine.flower
    init_args: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR,
                                 "include_dashboard": False}
    if fc.address:
        init_args["address"] = fc.address
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


def run_flower(spec: RunSpec, observers: list[RoundObserver]) -> ServerResult:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    cfg = spec.cfg
    verbose = cfg.engine.verbose
    quiet_third_party(verbose)
    config = backend_config(spec)
    outcome: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            outcome["result"] = run_server(grid, spec, observers)
        except BaseException as exc:  # re-raised in the caller's thread below
            outcome["error"] = exc

    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        _thread.interrupt_main()

    watchdog = threading.Timer(cfg.engine.flower.timeout_s, on_timeout)
    watchdog.daemon = True
    watchdog.start()
    try:
        run_simulation(server_app=server, client_app=build_client_app(spec), num_supernodes=cfg.num_clients,
                       backend_config=config, verbose_logging=verbose)
    except KeyboardInterrupt:
        if timed_out.is_set():
            raise RunFailedError(f"the Flower simulation exceeded engine.flower.timeout_s="
                                 f"{cfg.engine.flower.timeout_s:.0f}s and was stopped") from None
        raise
    finally:
        watchdog.cancel()
        _shutdown_ray()
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise RunFailedError("the Flower simulation ended without a result (see the log above)")
    return outcome["result"]


def _shutdown_ray() -> None:
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # pragma: no cover - best effort cleanup
        pass
