"""Stream metrics on hand-made batches, collapse diagnostics, merge invariance and transport."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.metrics import stream as sm
from fedsim.metrics.stream import StreamRecorder, merge_recorders


def _hand() -> StreamRecorder:
    r = StreamRecorder(3, domains=["a", "b"])
    r.record(0, "a", [0, 1, 2, 0], [0, 1, 1, 0])  # 3/4, hist [2, 1, 1]
    r.record(0, "b", [2, 2], [2, 0])  # 1/2, hist [0, 0, 2]
    r.record(1, "a", [0, 0, 0, 0], [0, 1, 2, 0])  # 2/4, collapsed on class 0
    r.record(1, "b", [1, 1], [2, 0])  # 0/2
    return r


def test_accuracy_per_block_cycle_domain_and_overall():
    r = _hand()
    assert r.blocks == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    np.testing.assert_allclose(r.block_accuracy(), [0.75, 0.5, 0.5, 0.0])
    np.testing.assert_allclose(r.cycle_accuracy(), [4 / 6, 2 / 6])
    assert r.domain_accuracy() == pytest.approx({"a": 5 / 8, "b": 1 / 4})
    assert r.accuracy() == pytest.approx(6 / 12)  # weighted by examples, not a mean of block accuracies
    assert r.error_rate() == pytest.approx(0.5)
    np.testing.assert_allclose(r.cycle_domain_accuracy(), [[0.75, 0.5], [0.5, 0.0]])


def test_weighting_by_examples():
    r = StreamRecorder(2)
    r.record(0, "x", [0] * 9, [0] * 9)  # 9/9
    r.record(0, "y", [0], [1])  # 0/1
    assert r.accuracy() == pytest.approx(0.9)  # the mean of block accuracies would be 0.5


def test_collapse_diagnostics():
    r = _hand()
    np.testing.assert_allclose(r.block_entropy(), [1.5 * math.log(2), 0.0, 0.0, 0.0], atol=1e-12)
    np.testing.assert_array_equal(r.block_distinct(), [3, 1, 1, 1])
    # cycle 0 hist [2, 1, 3] / 6; cycle 1 hist [4, 2, 0] / 6
    h0 = -(1 / 3 * math.log(1 / 3) + 1 / 6 * math.log(1 / 6) + 0.5 * math.log(0.5))
    h1 = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    np.testing.assert_allclose(r.cycle_entropy(), [h0, h1])
    np.testing.assert_allclose(r.cycle_entropy(normalized=True), [h0 / math.log(3), h1 / math.log(3)])
    np.testing.assert_array_equal(r.cycle_distinct(), [3, 2])


@pytest.mark.parametrize("C", [2, 5, 10])
def test_uniform_vs_collapsed_entropy(C):
    assert sm.marginal_entropy(np.full(C, 7)) == pytest.approx(math.log(C))
    assert sm.marginal_entropy(np.full(C, 7), normalized=True) == pytest.approx(1.0)
    collapsed = np.zeros(C)
    collapsed[C - 1] = 50
    assert sm.marginal_entropy(collapsed) == 0.0 and sm.distinct_classes(collapsed) == 1
    r = StreamRecorder(C)
    r.record(0, "d", np.arange(C).repeat(3), np.zeros(3 * C, dtype=int))
    r.record(1, "d", np.zeros(3 * C, dtype=int), np.zeros(3 * C, dtype=int))
    np.testing.assert_allclose(r.cycle_entropy(), [math.log(C), 0.0], atol=1e-12)
    np.testing.assert_array_equal(r.cycle_distinct(), [C, 1])
    assert math.isnan(sm.marginal_entropy(np.zeros(C)))


def test_degradation_drop_and_slope():
    r = _hand()
    assert r.accuracy_drop() == pytest.approx(2 / 6)
    assert r.accuracy_slope() == pytest.approx(-2 / 6)
    acc = [0.9, 0.8, 0.75, 0.5, 0.45]
    rec = StreamRecorder(2)
    for c, a in enumerate(acc):
        k = int(round(a * 20))
        rec.record(c, "d", np.zeros(20, dtype=int), np.r_[np.zeros(k, int), np.ones(20 - k, int)])
    assert rec.accuracy_slope() < 0 and rec.accuracy_drop() > 0
    assert rec.accuracy_slope() == pytest.approx(np.polyfit(np.arange(5), acc, 1)[0])
    assert sm.least_squares_slope([0.1, 0.2, 0.4]) > 0
    # the slope uses the cycle numbers, not positions
    assert sm.least_squares_slope([1.0, 0.0], x=[0, 4]) == pytest.approx(-0.25)
    single = StreamRecorder(2)
    single.record(0, "d", [0], [0])
    assert math.isnan(single.accuracy_drop()) and math.isnan(single.accuracy_slope())


def _random_batches(seed: int, n: int = 30, C: int = 4):
    rng = np.random.default_rng(seed)
    doms = ["fog", "snow", "blur"]
    out = []
    for _ in range(n):
        size = int(rng.integers(1, 9))
        out.append((int(rng.integers(0, 3)), doms[int(rng.integers(0, 3))],
                    rng.integers(0, C, size), rng.integers(0, C, size)))
    return out


def test_merge_equals_recording_the_concatenation():
    batches = _random_batches(0)
    whole = StreamRecorder(4, domains=["fog", "snow", "blur"])
    parts = [StreamRecorder(4, domains=["fog", "snow", "blur"]) for _ in range(3)]
    for i, (c, d, p, y) in enumerate(batches):
        whole.record(c, d, p, y)
        parts[i % 3].record(c, d, p, y)
    before = [x.to_metrics() for x in parts]
    merged = merge_recorders(parts)
    assert merged.to_metrics() == whole.to_metrics()
    assert merged.rows() == whole.rows()
    assert merged.summary_metrics() == whole.summary_metrics()
    assert (parts[0] + parts[1] + parts[2]).to_metrics() == whole.to_metrics()
    assert [x.to_metrics() for x in parts] == before  # merging does not modify its inputs


def test_to_metrics_from_metrics_round_trip_through_a_client_dict():
    r = _hand()
    m = r.to_metrics("tta_counts")
    assert all(isinstance(v, float) for v in m.values())
    assert m["tta_counts/0/a/n"] == 4.0 and m["tta_counts/0/a/correct"] == 3.0
    assert [m[f"tta_counts/1/a/hist/{k}"] for k in range(3)] == [4.0, 0.0, 0.0]
    client_reply = {"loss": 0.3, "num-examples": 12, **m}  # other keys are ignored
    back = StreamRecorder.from_metrics(client_reply, "tta_counts")
    assert back.num_classes == 3
    assert back.rows() == r.rows() and back.to_metrics("tta_counts") == m
    # federated: two clients' replies rebuilt and summed = one recorder fed everything
    other = StreamRecorder(3)
    other.record(1, "b", [2, 2, 2], [2, 2, 0])
    server = merge_recorders([StreamRecorder.from_metrics(x.to_metrics()) for x in (r, other)])
    assert server.to_metrics() == (r + other).to_metrics()
    assert server.block(1, "b").n == 5 and server.block(1, "b").correct == 2


def test_from_metrics_domain_order_and_errors():
    r = _hand()
    back = StreamRecorder.from_metrics(r.to_metrics(), domains=["b", "a"])
    assert back.blocks == [(0, "b"), (0, "a"), (1, "b"), (1, "a")]
    bad = r.to_metrics()
    del bad["stream/0/a/hist/2"]
    with pytest.raises(ConfigError, match="incomplete"):
        StreamRecorder.from_metrics(bad)
    with pytest.raises(ConfigError, match="malformed"):
        StreamRecorder.from_metrics({"stream/0/a/nn": 1.0})
    inconsistent = r.to_metrics()
    inconsistent["stream/0/a/n"] = 5.0
    with pytest.raises(ConfigError, match="sum"):
        StreamRecorder.from_metrics(inconsistent)
    assert StreamRecorder.from_metrics({}).blocks == []


def test_rows_table():
    rows = _hand().rows()
    assert [(r["cycle"], r["domain"], r["n"]) for r in rows] == [(0, "a", 4), (0, "b", 2), (1, "a", 4), (1, "b", 2)]
    assert rows[0]["accuracy"] == pytest.approx(0.75) and rows[0]["distinct"] == 3
    assert rows[2]["entropy"] == 0.0 and rows[0]["entropy_norm"] == pytest.approx(1.5 * math.log(2) / math.log(3))
    assert set(rows[0]) == {"cycle", "domain", "n", "correct", "accuracy", "entropy", "entropy_norm", "distinct"}


def test_summary_metrics():
    m = _hand().summary_metrics("tta")
    assert m["tta/accuracy"] == pytest.approx(0.5) and m["tta/error"] == pytest.approx(0.5)
    assert m["tta/cycle/1/accuracy"] == pytest.approx(2 / 6) and m["tta/cycle/0/distinct"] == 3.0
    assert m["tta/domain/b/accuracy"] == pytest.approx(0.25)
    assert m["tta/acc_drop"] == pytest.approx(2 / 6) and m["tta/acc_slope"] == pytest.approx(-2 / 6)
    assert all(math.isfinite(v) for v in m.values())


def test_scores_and_tensors_are_accepted():
    r = StreamRecorder(3)
    logits = torch.tensor([[0.1, 2.0, 0.0], [3.0, 0.0, 0.0]])
    r.record(0, 7, logits, torch.tensor([1, 2]))  # int domain becomes "7"
    b = r.block(0, "7")
    assert (b.n, b.correct) == (2, 1) and list(b.hist) == [1, 1, 0]
    r.record(0, "7", np.array([], dtype=int), np.array([], dtype=int))  # empty batch: no-op
    assert r.block(0, "7").n == 2


@pytest.mark.parametrize("call", [
    lambda r: r.record(0, "a", [0, 1], [0]),
    lambda r: r.record(0, "a", [0, 3], [0, 1]),
    lambda r: r.record(0, "a", [0.5, 1.0], [0, 1]),
    lambda r: r.record(0, "a", ["x", "y"], [0, 1]),
    lambda r: r.record(-1, "a", [0], [0]),
    lambda r: r.record(0, "a/b", [0], [0]),
    lambda r: r.record(0, "a", np.zeros((2, 4)), [0, 1]),
    lambda r: r.add_counts(0, "a", 3, 4, [1, 1, 1]),
    lambda r: r.block(5, "a"),
    lambda r: r.merge(StreamRecorder(4)),
    lambda r: r.to_metrics("/bad"),
])
def test_bad_input_is_a_config_error(call):
    with pytest.raises(ConfigError):
        call(StreamRecorder(3))


def test_bad_num_classes():
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ConfigError):
            StreamRecorder(bad)
