"""Flower's simulation runtime (Ray backend) runs the same strategy and ClientApp as the local
engine and gives bit-identical per-round metrics for the same seed (the local engine's default
vectorised cohort: the same to float tolerance)."""

from __future__ import annotations

import pytest

from fedsim import config as C
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def digits_cfg(engine: str, *overrides: str) -> C.ExperimentConfig:
    cfg = C.load_config("fedavg_digits", ["engine.flower.ray_num_cpus=2", *overrides],
                        {"rounds": 2, "clients": 6, "engine": engine})
    cfg.tracking.enabled = False
    return cfg


def test_local_and_flower_give_identical_history() -> None:
    overrides = ("data.partition.name=dirichlet", "data.partition.min_partition_size=5",
                 "strategy.fraction_train=1.0", "strategy.fraction_evaluate=0.5",
                 "engine.faults.fail_partitions=[2]", "engine.faults.fail_rounds=[2]")
    local = run_experiment(digits_cfg("local", *overrides, "engine.vectorise=false"))
    flower = run_experiment(digits_cfg("flower", *overrides))
    assert flower.history.as_rows() == local.history.as_rows()
    auto = run_experiment(digits_cfg("local", *overrides)).history.as_rows()  # engine.vectorise=auto
    assert len(auto) == len(local.history.as_rows())
    for a, b in zip(auto, flower.history.as_rows()):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in a)
    # the injected failure went through Flower's runtime as an error reply, counted in round 2
    assert [r.clients_ok for r in flower.history.records] == [0, 6, 5]
    assert flower.history.records[2].clients_failed >= 1
    assert any("injected failure" in f for f in flower.history.records[2].failures)
    for key, value in local.final_arrays.items():
        assert (flower.final_arrays[key] == value).all(), key


def test_oversized_client_resources_rejected_before_ray_starts() -> None:
    cfg = digits_cfg("flower", "engine.flower.client_num_cpus=4")
    with pytest.raises(ConfigError, match="client_num_cpus=4.0 exceeds the 2 CPUs"):
        run_experiment(cfg)


def test_a_ray_session_started_before_the_run_stays_up_and_gets_its_cpus_back() -> None:
    """Flower's backend ends with ``ray.shutdown()``; a session the user started must survive it,
    with Flower's actors gone (all CPUs free again) and the user's objects still there."""
    import time

    import ray

    from fedsim.engine.flower import _init_ray

    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        mine = ray.put("the user's object")
        result = run_experiment(digits_cfg("flower", "data.partition.name=iid"))
        assert [r.round for r in result.history.records] == [0, 1, 2]
        assert ray.is_initialized() and ray.get(mine) == "the user's object"
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == 2, "Flower's actors still hold CPUs"
        assert _init_ray({"init_args": {}}) is False  # a running session is reused, never restarted
    finally:
        ray.shutdown()
