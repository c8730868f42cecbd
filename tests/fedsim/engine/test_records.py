"""ReplyRecordDict: Flower's RecordDict with cheap typed views, indistinguishable from it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsim.engine.records import ReplyRecordDict, metric_record


def contents() -> dict:
    return {"arrays": ArrayRecord({"w": torch.arange(3.0)}), "metrics": MetricRecord({"loss": 0.5, "n": 4}),
            "config": ConfigRecord({"lr": 0.1}), "more": MetricRecord({"x": 1.0})}


def test_the_views_equal_flowers() -> None:
    fast, flower = ReplyRecordDict(contents()), RecordDict(contents())
    for view in ("array_records", "metric_records", "config_records"):
        assert list(getattr(fast, view).keys()) == list(getattr(flower, view).keys())
        assert all(getattr(fast, view)[k] is fast[k] for k in getattr(fast, view))
    assert isinstance(fast, RecordDict) and type(fast).__qualname__ == "RecordDict"


def test_a_view_still_writes_through_to_the_record_dict() -> None:
    fast = ReplyRecordDict(contents())
    fast.metric_records["added"] = MetricRecord({"y": 2.0})
    assert fast["added"]["y"] == 2.0
    del fast.array_records["arrays"]
    assert "arrays" not in fast and "arrays" not in fast.array_records


def test_it_pickles_as_itself_and_deflates_as_a_plain_record_dict() -> None:
    fast = ReplyRecordDict(contents())
    back = pickle.loads(pickle.dumps(fast))
    assert type(back) is ReplyRecordDict and list(back.keys()) == list(fast.keys())
    assert np.array_equal(back["arrays"]["w"].numpy(), fast["arrays"]["w"].numpy())
    assert fast.object_id == RecordDict(contents()).object_id  # Flower's content hash: the same object


def test_metric_record_equals_flowers_and_keeps_its_checks() -> None:
    values = {"loss": 0.5, "steps": 3, "np": np.float64(0.25), "hist": [1.0, 2.0]}
    for v in (values, {"loss": 0.5, "steps": 3}):
        made = metric_record(v)
        assert made == MetricRecord(v) and made.object_id == MetricRecord(v).object_id
    for bad in ({"flag": True}, {"s": "text"}, {3: 1.0}):
        with pytest.raises(TypeError):
            MetricRecord(bad)
        with pytest.raises(TypeError):
            metric_record(bad)


def test_a_reply_record_dict_refuses_what_flowers_refuses() -> None:
    with pytest.raises(TypeError):
        ReplyRecordDict({"x": {"not": "a record"}})
    with pytest.raises(TypeError):
        ReplyRecordDict({1: MetricRecord({"a": 1.0})})
    assert ReplyRecordDict({}) == RecordDict({}) and ReplyRecordDict().object_id == RecordDict().object_id


def test_a_kept_view_is_dropped_when_the_record_dict_changes() -> None:
    rd = ReplyRecordDict({"arrays": ArrayRecord(), "metrics": MetricRecord({"a": 1.0})})
    view = rd.metric_records
    assert rd.metric_records is view  # built once
    view["more"] = MetricRecord({"b": 2.0})  # through the view: written through, the kept views dropped
    assert list(rd.metric_records) == ["metrics", "more"] and rd.metric_records is not view
    rd["direct"] = MetricRecord({"c": 3.0})  # straight into the RecordDict
    assert list(rd.metric_records) == ["metrics", "more", "direct"]
    del rd["more"]
    assert list(rd.metric_records) == ["metrics", "direct"] and list(rd.array_records) == ["arrays"]


def test_metric_aggregation_is_flowers_bit_for_bit() -> None:
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from fedsim.engine.records import aggregate_metric_records

    rng = np.random.default_rng(0)
    records = []
    for i in range(50):
        metrics = {"num-examples": int(rng.integers(1, 400)), "loss": float(rng.normal()), "steps": int(rng.integers(1, 9)),
                   "curve": [float(v) for v in rng.normal(size=3)]}
        records.append(ReplyRecordDict({"metrics": MetricRecord(metrics)}) if i % 2 else RecordDict({"metrics": MetricRecord(metrics)}))
    ours, flowers = aggregate_metric_records(records, "num-examples"), aggregate_metricrecords(records, "num-examples")
    assert list(ours) == list(flowers) and all(ours[k] == flowers[k] for k in flowers)  # exact, not approximate


def test_strategies_that_use_flowers_default_get_the_one_pass_twin() -> None:
    from fedsim import config as C
    from fedsim.engine.records import aggregate_metric_records
    from fedsim.engine.runtime import RunSpec
    from fedsim.engine.server import build_strategy

    strategy = build_strategy(RunSpec.from_config(C.load_config("fedavg_digits", ["tracking.enabled=false"], {})))
    assert strategy.train_metrics_aggr_fn is aggregate_metric_records
    assert strategy.evaluate_metrics_aggr_fn is aggregate_metric_records
