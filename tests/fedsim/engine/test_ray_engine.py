"""The ``ray`` engine: a pool of long-lived Ray actors behind a Flower Grid.

Pure parts (least-loaded scheduling, pool sizing, the resource check) are tested without Ray; the
rest shares one local Ray of 2 CPUs (started once for the module).
"""

from __future__ import annotations

import time

import pytest

from fedsim import config as C
from fedsim.engine import ray_pool as R
from fedsim.engine.runtime import RunSpec, injected_fault
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

BASE = ["rounds=2", "num_clients=4", "engine.ray.num_actors=2", "engine.ray.ray_num_cpus=2", "tracking.enabled=false",
        "engine.checkpoint=false", "strategy.fraction_train=1.0", "data.partition.name=iid"]


def digits(*overrides: str, engine: str = "ray") -> C.ExperimentConfig:
    return C.load_config("fedavg_digits", [*BASE, f"engine.name={engine}", *overrides], {})


# -- without Ray ----------------------------------------------------------------------------------
def test_least_loaded_spreads_calls_and_prefers_the_last_actor_on_ties() -> None:
    s = R.LeastLoaded(3)
    assert [s.assign(n) for n in (1, 2, 3, 4, 5, 6)] == [0, 1, 2, 0, 1, 2]
    assert s.load == [2, 2, 2]
    for slot in (0, 1, 2, 0, 1, 2):
        s.release(slot)
    # all idle: each node goes back to the actor that served it last
    assert [s.assign(n) for n in (3, 2, 1)] == [2, 1, 0]
    s.release(1)
    s.release(2)
    assert s.assign(9) == 1  # a new node on a tie: lowest index among the least loaded (1 and 2)


def test_least_loaded_counts_a_starting_replacement_as_busy() -> None:
    s = R.LeastLoaded(2)
    s.assign(1)
    s.reset(0)  # actor 0 replaced and starting: load 1
    assert s.load == [1, 0]
    assert s.assign(2) == 1
    s.release(0)  # started
    assert s.assign(3) == 0


def test_pool_size_fills_the_cpus_beside_dedicated_actors() -> None:
    rc = C.RayEngineConfig(actor_num_cpus=1.0)
    assert R.pool_size(rc, num_clients=10, cpus=4, gpus=0) == 4
    assert R.pool_size(rc, num_clients=3, cpus=8, gpus=0) == 3  # never more actors than clients
    rc = C.RayEngineConfig(actor_num_cpus=0.5, client_resources={"0": C.ResourceHint(num_cpus=2.0)})
    assert R.pool_size(rc, num_clients=10, cpus=4, gpus=0) == 4  # (4 - 2) / 0.5
    rc = C.RayEngineConfig(actor_num_cpus=1.0, actor_num_gpus=0.25)
    assert R.pool_size(rc, num_clients=10, cpus=16, gpus=1) == 4
    assert R.pool_size(C.RayEngineConfig(actor_num_cpus=4.0), num_clients=10, cpus=2, gpus=0) == 1
    assert R.pool_size(C.RayEngineConfig(num_actors=7), num_clients=2, cpus=1, gpus=0) == 7


@pytest.mark.parametrize("override, message", [
    ("engine.ray.actor_num_cpus=4", "an actor of 4 CPUs exceeds the 2 CPUs Ray may use"),
    ("engine.ray.client_resources.1.num_cpus=3", r"client_resources.1: an actor of 3 CPUs exceeds the 2 CPUs"),
    ("engine.ray.num_actors=3", "num_actors=3 actors .* need 3 CPUs and 0 GPUs but Ray has 2"),
    ("engine.ray.client_resources.9.num_cpus=1", r"partitions \[9\] outside 0..3"),
])
def test_impossible_actor_size_is_a_config_error_before_ray_starts(override: str, message: str) -> None:
    import ray

    started = ray.is_initialized()
    with pytest.raises(ConfigError, match=message):
        run_experiment(digits(override))
    assert ray.is_initialized() == started


def test_gpu_actor_without_cuda_is_a_config_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        R.check_ray_resources(RunSpec.from_config(digits("engine.ray.actor_num_gpus=0.5")))


# -- with a local Ray -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    import ray

    started = R._init_ray(digits())
    yield
    if started:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard, not a speed check
def test_ray_engine_matches_local_engine(local_ray, caplog) -> None:
    """Same per-round metrics; partition 3 on a dedicated actor, the others on a pool of one."""
    local = run_experiment(digits("engine.vectorise=false", engine="local"))  # bit-identical: clients one by one
    with caplog.at_level("INFO", logger="fedsim"):
        ray_run = run_experiment(digits("engine.ray.num_actors=1", "engine.ray.client_resources.3.num_cpus=1"))
    ray_rows = ray_run.history.as_rows()
    assert ray_rows == local.history.as_rows()
    for key, value in local.final_arrays.items():
        assert (ray_run.final_arrays[key] == value).all(), key
    assert [r["round/clients_ok"] for r in ray_rows[1:]] == [4.0, 4.0]
    started = [m for m in caplog.messages if "starting actor" in m]
    assert started == ["ray engine: starting actor dedicated-cpu1-gpu0 for partition 3"]


def _seed_with_one_hang(fraction: float) -> tuple[int, int]:
    """A seed whose round 1 hangs exactly one of the 4 training calls and round 2 none."""
    for seed in range(500):
        cfg = digits(f"seed={seed}", f"engine.faults.hang_fraction={fraction}")
        hung = [[p for p in range(4) if injected_fault(cfg, p, r) == "hang"] for r in (1, 2)]
        if len(hung[0]) == 1 and not hung[1]:
            return seed, hung[0][0]
    raise AssertionError("no such seed")


def _dead(handle) -> None:
    """Wait until a killed actor is gone (``ray.kill`` takes effect asynchronously)."""
    import ray

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(handle.warm.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError("the killed actor still answers")


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard, not a speed check
def test_dead_and_hung_actors_become_error_replies_and_are_replaced(local_ray) -> None:
    """One pool, one Ray task per call: spread of calls, an actor killed under the grid, then a run with a hung client."""
    import ray
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedsim.contracts.history import History
    from fedsim.engine.server import run_server

    seed, hung = _seed_with_one_hang(0.25)
    # a roomy client limit (as in test_hangs): a loaded CI machine must not time out the healthy calls
    spec = RunSpec.from_config(digits(f"seed={seed}", "engine.faults.hang_fraction=0.25", "engine.client_timeout_s=10",
                                      "engine.ray.calls_per_task=1"))  # one task per call (batches: the next test)
    grid = R.RayActorGrid(spec)
    history = History()
    try:
        with R.task_identity(1, SUPERLINK_NODE_ID):
            def query_all(timeout: float = 60) -> list[Message]:
                msgs = [Message(RecordDict(), n, MessageType.QUERY) for n in grid.get_node_ids()]
                return grid.send_and_receive(msgs, timeout=timeout)

            assert not any(r.has_error() for r in query_all())
            assert grid.calls_served == {"pool-0": 2, "pool-1": 2}  # least-loaded: spread evenly
            dead = grid.actors["pool-0"].handle
            ray.kill(dead, no_restart=True)
            _dead(dead)
            replies = query_all()
            errors = [r for r in replies if r.has_error()]
            assert len(replies) == 4 and len(errors) == 1  # the call queued behind it went elsewhere
            assert errors[0].error.code == 2 and errors[0].error.reason.startswith("actor died")
            assert grid.replaced == 1 and grid.actors["pool-0"].handle is not dead

            run_server(grid, spec, [history])
            assert grid.replaced == 1  # the actor timed the hung call out itself: no restart

            # a hang the actor does not cut in time (here: a 1 s budget below its own 10 s deadline) is
            # cut by the driver KILL_GRACE_S later, and its actor is killed and replaced
            hang = Message(RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"server-round": 1})}),
                           hung + 1, MessageType.TRAIN)
            start = time.monotonic()
            [reply] = grid.send_and_receive([hang], timeout=1.0)
            assert reply.error.reason == "timeout: no reply within 1.0s"
            assert time.monotonic() - start < 1 + R.KILL_GRACE_S + 30 and grid.replaced == 2

            # no time left: every call gets a timeout reply without running, and no actor is killed
            late = query_all(timeout=0.0)
            assert [r.error.reason for r in late] == ["timeout: the round's deadline passed before this client ran"] * 4
            assert grid.replaced == 2
            assert [r.error.reason for r in query_all() if r.has_error()] == []
    finally:
        grid.close()
    r1, r2 = history.records[1:]
    assert (r1.clients_ok, r1.clients_failed) == (3, 1)
    assert r1.failures == [f"train: partition {hung}: timeout: no reply within 10.0s"]
    assert r1.seconds < 10 + 40  # the client deadline (+ a loaded machine), not the 3600 s hang
    assert (r2.clients_ok, r2.clients_failed) == (4, 0)  # the run went on


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard, not a speed check
def test_batched_calls_keep_each_calls_budget_and_outcome(local_ray) -> None:
    """engine.ray.calls_per_task=2: one Ray task per actor per round; a dead actor's batch is sent
    again call by call, a hang inside a batch costs its own slot, and the run equals the local one."""
    import ray
    from flwr.app import Message, MessageType, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedsim.contracts.history import History
    from fedsim.engine.server import run_server

    seed, hung = _seed_with_one_hang(0.25)
    faults = [f"seed={seed}", "engine.faults.hang_fraction=0.25", "engine.client_timeout_s=10"]
    spec = RunSpec.from_config(digits(*faults, "engine.ray.calls_per_task=2"))
    grid = R.RayActorGrid(spec)
    history = History()
    try:
        with R.task_identity(1, SUPERLINK_NODE_ID):
            def query_all() -> list[Message]:
                msgs = [Message(RecordDict(), n, MessageType.QUERY) for n in grid.get_node_ids()]
                return grid.send_and_receive(msgs, timeout=60)

            assert not any(r.has_error() for r in query_all())
            assert grid.tasks_sent == 2 and grid.calls_served == {"pool-0": 2, "pool-1": 2}  # a batch each
            dead = grid.actors["pool-0"].handle
            ray.kill(dead, no_restart=True)
            _dead(dead)
            assert not any(r.has_error() for r in query_all())  # the lost batch ran again, call by call
            assert grid.replaced == 1
            run_server(grid, spec, [history])
            assert grid.replaced == 1  # the actor cut the hung call itself, inside its batch
    finally:
        grid.close()
    r1, r2 = history.records[1:]
    assert (r1.clients_ok, r1.clients_failed) == (3, 1)
    assert r1.failures == [f"train: partition {hung}: timeout: no reply within 10.0s"]
    assert r1.seconds < 10 + 40 and (r2.clients_ok, r2.clients_failed) == (4, 0)
    batched = run_experiment(digits("engine.ray.calls_per_task=3")).history.as_rows()
    assert batched == run_experiment(digits("engine.vectorise=false", engine="local")).history.as_rows()
