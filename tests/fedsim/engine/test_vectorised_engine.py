"""engine.vectorise on the local engine: the same per-round metrics as sequential clients."""

from __future__ import annotations

import logging

import pytest

from fedsim import config as C
from fedsim.runner import run_experiment

BASE = ["rounds=2", "tracking.enabled=false", "strategy.fraction_train=1.0", "client.momentum=0.9"]


def rows(*overrides: str) -> list[dict[str, float]]:
    return run_experiment(C.load_config("fedavg_digits", [*BASE, *overrides], {})).history.as_rows()


def assert_same(a: list[dict[str, float]], b: list[dict[str, float]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox"])
def test_vectorised_rounds_equal_sequential_rounds(strategy: str) -> None:
    over = [f"strategy.name={strategy}", "engine.vectorise_chunk=7"]
    assert_same(rows(*over, "engine.vectorise=true"), rows(*over, "engine.vectorise=false"))


def test_faulty_clients_still_fail_one_by_one() -> None:
    over = ["engine.faults.fail_partitions=[2,5]", "engine.faults.fail_rounds=[1]"]
    vec = rows(*over, "engine.vectorise=true")
    assert vec[1]["round/clients_failed"] == 2 and vec[2]["round/clients_failed"] == 0
    assert_same(vec, rows(*over, "engine.vectorise=false"))


def test_an_unsupported_cohort_falls_back_and_says_why(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        vec = rows("engine.vectorise=true", "model.params.dropout=0.3")
    assert "training clients one by one" in caplog.text and "dropout" in caplog.text
    assert vec == rows("model.params.dropout=0.3", "engine.vectorise=false")


class CountSequentialCalls:
    """Count the clients trained one by one (``SupervisedLearner.train`` calls)."""

    def __init__(self, monkeypatch) -> None:
        from clients.supervised import SupervisedLearner

        self.calls, original = 0, SupervisedLearner.train

        def counted(learner, arrays, ctx):  # type: ignore[no-untyped-def]
            self.calls += 1
            return original(learner, arrays, ctx)

        monkeypatch.setattr(SupervisedLearner, "train", counted)


def test_auto_is_the_default_and_vectorises_a_small_mlp(monkeypatch, caplog) -> None:
    assert C.load_config("fedavg_digits", [], {}).engine.vectorise == "auto"
    counter = CountSequentialCalls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        auto = rows()
    assert counter.calls == 0 and "one by one" not in caplog.text
    assert_same(auto, rows("engine.vectorise=false"))
    assert counter.calls == 2 * 20  # the sequential run: 2 rounds x 20 clients


def test_auto_trains_a_cnn_one_by_one_without_a_warning(monkeypatch, caplog) -> None:
    counter = CountSequentialCalls(monkeypatch)
    cnn = ["model.name=cnn", "model.params={channels: [4], hidden: 8}"]
    with caplog.at_level(logging.DEBUG, logger="fedsim"):
        auto = rows(*cnn)
    assert counter.calls == 2 * 20
    assert "Conv2d" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.WARNING
                                             and "one by one" in r.getMessage()]
    assert auto == rows(*cnn, "engine.vectorise=false")


def test_bad_vectorise_value_is_a_one_line_error() -> None:
    from fedsim.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.vectorise must be true, false or auto"):
        C.load_config("fedavg_digits", ["engine.vectorise=sometimes"], {})
    with pytest.raises(ConfigError, match=r"key 'engine.vectorise'.*true, false or a word such as auto"):
        C.load_config("fedavg_digits", ["engine.vectorise=3"], {})
