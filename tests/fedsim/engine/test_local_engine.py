"""The in-process engine: learning, determinism, failure accounting, centralised mode."""

from __future__ import annotations

import pytest

from fedsim import config as C
from fedsim.errors import RunFailedError
from fedsim.runner import run_experiment


def small(name: str = "fedavg", *overrides: str, **flags) -> C.ExperimentConfig:
    cfg = C.load_config(name, list(overrides), flags)
    cfg.tracking.enabled = False
    return cfg


def test_fedavg_mnist_dirichlet_learns() -> None:
    """10 clients, Dirichlet(0.5), 3 rounds: measured 0.83 on this machine (chance is 0.10)."""
    summary = run_experiment(small("fedavg", rounds=3))
    acc = [v for _, v in summary.history.series("eval/accuracy")]
    assert acc[0] < 0.2  # round 0 = untrained model
    assert acc[-1] > 0.6
    assert summary.history.final()["round/clients_ok"] == 10


def test_same_seed_same_history_different_seed_differs() -> None:
    a = run_experiment(small("fedavg_digits", rounds=3)).history.as_rows()
    b = run_experiment(small("fedavg_digits", rounds=3)).history.as_rows()
    c = run_experiment(small("fedavg_digits", rounds=3, seed=7)).history.as_rows()
    assert a == b
    assert a != c


def test_client_sampling_uses_fraction() -> None:
    summary = run_experiment(small("fedavg_digits", rounds=2))  # 20 clients, fraction 0.5
    assert [r.clients_ok for r in summary.history.records[1:]] == [10, 10]
    assert "fed_eval/accuracy" in summary.history.final()  # fraction_evaluate 0.25 -> client-side eval


def test_failing_client_is_counted_and_logged(caplog) -> None:
    cfg = small("fedavg_digits", "engine.faults.fail_partitions=[3]", "engine.faults.fail_rounds=[2]",
                "strategy.fraction_train=1.0", rounds=2)
    with caplog.at_level("WARNING", logger="fedsim"):
        summary = run_experiment(cfg)
    r1, r2 = summary.history.records[1], summary.history.records[2]
    assert (r1.clients_ok, r1.clients_failed) == (20, 0)
    assert r2.clients_ok == 19 and r2.clients_failed >= 1
    assert any("partition 3" in f and "injected failure" in f for f in r2.failures)
    assert any("injected failure" in m for m in caplog.messages)


def test_too_few_results_fails_the_run() -> None:
    cfg = small("fedavg_digits", "strategy.fraction_train=1.0", "strategy.min_train_results=4",
                "data.partition.name=iid", rounds=2, clients=4)
    cfg.engine.faults.fail_partitions = [1]
    with pytest.raises(RunFailedError, match=r"3 training results, the strategy needs at least 4"):
        run_experiment(cfg)


def test_centralised_mode_is_one_client_without_aggregation() -> None:
    summary = run_experiment(small("centralised", rounds=1))
    assert summary.history.records[1].clients_ok == 1
    assert summary.history.final()["eval/accuracy"] > 0.6


def test_node_state_persists_across_rounds() -> None:
    """Flower's per-node Context.state survives between rounds in the local engine."""
    from flwr.app import Message, MessageType, RecordDict

    from fedsim.engine.local import InProcessGrid, server_identity

    seen: list[int] = []
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.query()
    def count(msg, context):
        from flwr.app import MetricRecord

        rec = context.state.get("counter", MetricRecord({"n": 0}))
        rec["n"] = int(rec["n"]) + 1
        context.state["counter"] = rec
        seen.append(int(rec["n"]))
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(app, num_nodes=1)
    with server_identity(1):
        for _ in range(3):
            grid.send_and_receive([Message(RecordDict(), 1, MessageType.QUERY)])
    assert seen == [1, 2, 3]


def test_the_rounds_run_with_the_heap_frozen_and_give_it_back(monkeypatch) -> None:
    """frozen_heap: the objects made before the rounds are out of the collector's scans during them
    (gc.freeze), given back after, even on error, and a nested freeze is left to its owner."""
    import gc

    from fedsim.engine.server import frozen_heap

    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen  # not unfrozen by the inner run
    finally:
        gc.unfreeze()
