"""evaluation.every: the server evaluates at round 0, every k-th round and always the last one; the
rounds in between train exactly as with evaluation every round."""

from __future__ import annotations

import pytest

from fedsim import config as C
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment


def run(*overrides: str):
    cfg = C.load_config("fedavg_digits", ["data.partition.name=iid", *overrides], {"rounds": 5, "clients": 3})
    cfg.tracking.enabled = False
    return run_experiment(cfg).history


def test_every_k_rounds_and_the_last() -> None:
    sparse, dense = run("evaluation.every=2"), run()
    assert [r for r, _ in sparse.series("eval/accuracy")] == [0, 2, 4, 5]
    assert [r for r, _ in dense.series("eval/accuracy")] == [0, 1, 2, 3, 4, 5]
    assert dict(sparse.series("eval/accuracy")) == {r: v for r, v in dense.series("eval/accuracy") if r in (0, 2, 4, 5)}
    assert sparse.series("train/loss") == dense.series("train/loss")


def test_every_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="evaluation.every"):
        run("evaluation.every=0")
