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
    assert_same(rows(*over, "engine.vectorise=true"), rows(*over))


def test_faulty_clients_still_fail_one_by_one() -> None:
    over = ["engine.faults.fail_partitions=[2,5]", "engine.faults.fail_rounds=[1]"]
    vec = rows(*over, "engine.vectorise=true")
    assert vec[1]["round/clients_failed"] == 2 and vec[2]["round/clients_failed"] == 0
    assert_same(vec, rows(*over))


def test_an_unsupported_cohort_falls_back_and_says_why(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        vec = rows("engine.vectorise=true", "model.params.dropout=0.3")
    assert "training clients one by one" in caplog.text and "dropout" in caplog.text
    assert vec == rows("model.params.dropout=0.3")
