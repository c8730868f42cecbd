"""Runs that cannot mean anything fail: non-finite client replies are failed clients, a non-finite
global model fails the run, and neither ends FINISHED."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, Message, MessageType, RecordDict
from mlflow import MlflowClient

from clients.supervised import SupervisedLearner
from fedsim import config as C
from fedsim.cli import main
from fedsim.engine import server
from fedsim.engine.arrays import ResidentArray
from fedsim.engine.grid import finite_array, non_finite_reason
from fedsim.engine.local import server_identity
from fedsim.errors import RunFailedError
from fedsim.runner import run_experiment

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["rounds=2", "num_clients=6", "strategy.fraction_train=1.0", "strategy.fraction_evaluate=0.0",
         "engine.vectorise=false", "data.partition.name=iid"]


def load(*overrides: str) -> C.ExperimentConfig:
    return C.load_config("fedavg_digits", [*SMALL, "tracking.enabled=false", *overrides], {})


def reply(loss: float, weight: float) -> Message:
    content = RecordDict({"arrays": ArrayRecord({"w": torch.tensor([1.0, weight])}),
                          "metrics": MetricRecord({"train_loss": loss, "num-examples": 3})})
    with server_identity(run_id=1):  # Flower's Message reads the task identity a runtime sets
        return Message(content, 1, MessageType.TRAIN)


def test_non_finite_reason_names_the_loss_or_the_parameter() -> None:
    assert non_finite_reason(reply(0.5, 2.0)) is None
    assert non_finite_reason(reply(float("nan"), 2.0)) == "non-finite loss (nan): lower client.lr"
    assert non_finite_reason(reply(float("inf"), 2.0)) == "non-finite loss (inf): lower client.lr"
    assert non_finite_reason(reply(0.5, float("-inf"))) == "non-finite parameters (w): lower client.lr"


@pytest.mark.parametrize("make", [ResidentArray, lambda a: ArrayRecord({"w": torch.from_numpy(a)})["w"]],
                         ids=["resident", "serialised"])
def test_finite_array_finds_every_nan_and_infinity(make) -> None:
    big = np.full(4, np.finfo(np.float32).max, dtype=np.float32)  # finite, though its sum is not
    assert finite_array(make(big))
    for bad in (np.nan, np.inf, -np.inf):
        arr = np.ones(5, dtype=np.float32)
        arr[3] = bad
        assert not finite_array(make(arr))
    mixed = big.copy()
    mixed[0] = -np.inf
    assert not finite_array(make(mixed))
    assert finite_array(make(np.arange(4, dtype=np.int64)))  # integer arrays are always finite


def test_a_huge_learning_rate_fails_the_run_in_one_line(tmp_path, capsys) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = main(["run", "fedavg_digits", *SMALL, "client.lr=1e30", "--tracking-uri", uri,
                 "engine.checkpoint_dir=" + str(tmp_path / "ckpt"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith("fedsim: error: round failed: 0 training results")
    assert "non-finite loss (nan): lower client.lr" in err[0]
    runs = MlflowClient(uri).search_runs([e.experiment_id for e in MlflowClient(uri).search_experiments()])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not (tmp_path / "ckpt").exists()  # no checkpoint was written, so no directory either


def test_one_poisoned_client_is_a_counted_failure_and_the_run_goes_on(monkeypatch) -> None:
    train = SupervisedLearner.train

    def poisoned(self, arrays, ctx):
        result = train(self, arrays, ctx)
        if ctx.partition_id == 2:
            result.metrics["train_loss"] = float("nan")
        if ctx.partition_id == 4:
            result.arrays = {k: torch.full_like(v, float("inf")) for k, v in result.arrays.items()}
        return result

    monkeypatch.setattr(SupervisedLearner, "train", poisoned)
    summary = run_experiment(load())
    for record in summary.history.records[1:]:
        assert record.clients_ok == 4 and record.clients_failed == 2
        assert sorted(record.client_metrics) == [0, 1, 3, 5]
        assert record.failures[0] == "train: partition 2: non-finite loss (nan): lower client.lr"
        assert record.failures[1].startswith("train: partition 4: non-finite parameters (")
    assert np.isfinite(summary.history.final()["eval/accuracy"]) and summary.history.final()["eval/accuracy"] > 0.3
    assert all(torch.isfinite(t).all() for t in summary.final_arrays.values() if t.is_floating_point())


def test_too_few_finite_replies_fail_the_round(monkeypatch) -> None:
    train = SupervisedLearner.train

    def poisoned(self, arrays, ctx):
        result = train(self, arrays, ctx)
        if ctx.partition_id < 3:
            result.metrics["train_loss"] = float("inf")
        return result

    monkeypatch.setattr(SupervisedLearner, "train", poisoned)
    with pytest.raises(RunFailedError, match="3 training results, the strategy needs at least 4"):
        run_experiment(load("strategy.min_train_results=4"))


def test_a_non_finite_global_model_fails_the_run_naming_the_round(monkeypatch) -> None:
    play = server.play_round

    def diverging(strategy, grid, server_round, arrays, timeout):
        arrays = play(strategy, grid, server_round, arrays, timeout)
        if server_round == 2:
            state = arrays.to_torch_state_dict()
            first = next(iter(state))
            state[first] = torch.full_like(state[first], float("nan"))
            arrays = ArrayRecord(state)
        return arrays

    monkeypatch.setattr(server, "play_round", diverging)
    with pytest.raises(RunFailedError, match=r"^round 2: the aggregated global model is not finite \(") as err:
        run_experiment(load("rounds=3"))
    assert "lower client.lr" in str(err.value) and "\n" not in str(err.value)
