"""System heterogeneity (simulated speeds, dropouts, deadline) and fault handling (raise, hang, retry)."""

from __future__ import annotations

import pytest

from clients.supervised import SupervisedLearner, SupervisedParams
from fedsim import config as C
from fedsim.engine.runtime import injected_fault
from fedsim.engine.system import SystemModel
from fedsim.errors import RunFailedError
from fedsim.runner import run_experiment

ALL = ["rounds=2", "strategy.fraction_train=1.0", "strategy.fraction_evaluate=0.0", "tracking.enabled=false"]


def load(*overrides: str) -> C.ExperimentConfig:
    return C.load_config("fedavg_digits", [*ALL, *overrides], {})


def test_system_model_is_seeded_and_lognormal() -> None:
    cfg = load("engine.system.enabled=true", "engine.system.speed_sigma=0.8")
    work = {pid: 10.0 for pid in range(200)}
    a = SystemModel(cfg.engine.system, 0, work.__getitem__)
    b = SystemModel(cfg.engine.system, 0, work.__getitem__)
    speeds = [a.speed(p) for p in range(200)]
    assert speeds == [b.speed(p) for p in range(200)]
    assert min(speeds) < 0.5 < 2.0 < max(speeds)  # sigma 0.8: a wide spread around the median 1
    assert a.duration(3) == pytest.approx(10 * 0.05 / a.speed(3))


def test_deadline_drops_exactly_the_stragglers_the_model_names() -> None:
    cfg = load("engine.system.enabled=true", "engine.system.speed_sigma=1.0", "engine.system.deadline_s=0.4",
               "engine.system.dropout=0.2", "engine.system.seconds_per_step=0.02")
    summary = run_experiment(cfg)
    learner = SupervisedLearner(cfg, SupervisedParams())
    model = SystemModel(cfg.engine.system, cfg.seed, learner.local_work)
    lost = 0
    for record in summary.history.records[1:]:
        plan = model.plan(list(range(cfg.num_clients)), record.round)
        assert sorted(record.client_metrics) == plan.in_time
        assert record.stragglers == len(plan.stragglers) and record.clients_dropped == len(plan.dropped)
        assert record.clients_ok == len(plan.in_time) and record.clients_failed == 0
        assert record.as_metrics()["round/sim_seconds"] == pytest.approx(0.4)
        lost += len(plan.stragglers) + len(plan.dropped)
    assert lost > 0  # the setting really exercises the deadline and the dropouts


def test_no_system_model_logs_no_simulated_time() -> None:
    summary = run_experiment(load("rounds=1"))
    assert "round/sim_seconds" not in summary.history.final()


def expected_faults(cfg: C.ExperimentConfig, rnd: int) -> dict[str, int]:
    kinds = [injected_fault(cfg, pid, rnd) for pid in range(cfg.num_clients)]
    return {"raise": kinds.count("raise"), "hang": kinds.count("hang")}


def test_raising_and_hanging_clients_are_counted_and_the_run_completes() -> None:
    cfg = load("engine.faults.raise_fraction=0.1", "engine.faults.hang_fraction=0.05",
               "engine.client_timeout_s=1.0", "engine.faults.hang_s=60")
    summary = run_experiment(cfg)
    total = 0
    for record in summary.history.records[1:]:
        want = expected_faults(cfg, record.round)
        assert record.clients_failed == want["raise"] + want["hang"]
        assert record.clients_ok == cfg.num_clients - record.clients_failed
        assert sum("timeout" in f for f in record.failures) == want["hang"]
        assert sum("injected failure" in f for f in record.failures) == want["raise"]
        total += want["hang"]
    assert total >= 1  # the seed really produces a hang to time out


def test_transient_faults_are_recovered_by_retries() -> None:
    cfg = load("engine.faults.raise_fraction=0.3", "engine.faults.transient=true", "engine.retries=1")
    summary = run_experiment(cfg)
    for record in summary.history.records[1:]:
        assert record.clients_failed == 0 and record.clients_ok == cfg.num_clients
        assert record.retries == expected_faults(cfg, record.round)["raise"] > 0


def test_below_the_minimum_the_round_fails_clearly() -> None:
    cfg = load("engine.faults.raise_fraction=0.9", "strategy.min_train_results=5")
    with pytest.raises(RunFailedError, match="training results, the strategy needs at least 5"):
        run_experiment(cfg)


def test_the_round_timeout_caps_each_call_of_a_round_of_hanging_clients() -> None:
    """Every client hangs; each call gets the round timeout (1 s) as its own budget, whatever the
    client limit says, so the sequential round of 4 calls takes about 4 s, not the 60 s hang."""
    import time

    cfg = load("rounds=1", "num_clients=4", "data.partition.name=iid", "engine.faults.hang_fraction=1.0", "engine.faults.hang_s=60",
               "engine.round_timeout_s=1", "engine.client_timeout_s=30")
    start = time.monotonic()
    with pytest.raises(RunFailedError, match="0 training results.*timeout: no reply within 1.0s"):
        run_experiment(cfg)
    assert time.monotonic() - start < 20


def test_bad_engine_values_are_one_line_errors() -> None:
    with pytest.raises(C.ConfigError, match="engine.system.dropout must be in"):
        load("engine.system.dropout=1.5")
    with pytest.raises(C.ConfigError, match="raise_fraction and hang_fraction"):
        load("engine.faults.raise_fraction=0.7", "engine.faults.hang_fraction=0.6")
    with pytest.raises(C.ConfigError, match="engine must be one of"):
        load("engine.name=spark")
