"""One combined training reply for FedAvg-mean strategies, and the lazily built ResultReply.

The combined reply must give Flower's FedAvg the very aggregate it computes from the separate replies
(bit for bit), fail on inconsistent replies exactly as FedAvg does, and be used only for strategies whose
aggregation is FedAvg's own.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx

from fedsim.contracts.learner import TrainResult
from fedsim.engine.cohort_reply import combined_reply, linear_weighting
from fedsim.engine.local import server_identity
from fedsim.engine.records import ResultReply, aggregate_metric_records
from fedsim.engine.runtime import NUM_EXAMPLES, result_reply, train_reply


def instruction(node: int) -> Message:
    with server_identity(run_id=1):
        msg = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = f"m{node}"
    return msg


def results(n: int, seed: int = 0) -> list[TrainResult]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        arrays = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g) * 1e3,
                  "count": torch.tensor([i, 2 * i], dtype=torch.int64)}
        metrics = {"train_loss": float(torch.rand(1, generator=g)), "local_steps": 3 + i}
        out.append(TrainResult(arrays, num_examples=7 + 13 * i, metrics=metrics, owned=True))
    return out


def fedavg() -> FedAvg:
    strategy = FedAvg()
    strategy.train_metrics_aggr_fn = aggregate_metric_records  # what fedsim's build_strategy installs
    return strategy


def assert_same_aggregate(a: tuple, b: tuple) -> None:
    (arrays_a, metrics_a), (arrays_b, metrics_b) = a, b
    assert list(arrays_a.keys()) == list(arrays_b.keys())
    for key in arrays_a.keys():
        x, y = arrays_a[key].numpy(), arrays_b[key].numpy()
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), key  # bit for bit
    assert dict(metrics_a) == dict(metrics_b)
    assert all(type(metrics_a[k]) is type(metrics_b[k]) for k in metrics_a)


@pytest.mark.parametrize("make_reply", [train_reply, result_reply], ids=["flower-records", "result-reply"])
def test_fedavg_of_the_combined_reply_is_fedavg_of_the_replies_bit_for_bit(make_reply) -> None:
    msgs = [instruction(i + 1) for i in range(9)]
    replies = [make_reply(m, r) for m, r in zip(msgs, results(9))]
    expected = fedavg().aggregate_train(1, replies)
    combined = combined_reply(replies, "num-examples", msgs[0])
    assert_same_aggregate(fedavg().aggregate_train(1, [combined]), expected)
    assert combined.content["metrics"][NUM_EXAMPLES] == sum(7 + 13 * i for i in range(9))
    assert combined.metadata.src_node_id == 1  # it answers the first client's message


def test_mixed_reply_kinds_combine_as_well() -> None:
    msgs = [instruction(i + 1) for i in range(4)]
    replies = [(train_reply if i % 2 else result_reply)(m, r) for i, (m, r) in enumerate(zip(msgs, results(4, 3)))]
    expected = fedavg().aggregate_train(1, replies)
    assert_same_aggregate(fedavg().aggregate_train(1, [combined_reply(replies, "num-examples", msgs[0])]), expected)


def test_combining_never_writes_the_replies_arrays() -> None:
    msgs = [instruction(i + 1) for i in range(3)]
    replies = [result_reply(m, r) for m, r in zip(msgs, results(3))]
    before = [{k: a.copy() for k, a in r.plain_values()[0].items()} for r in replies]
    combined_reply(replies, "num-examples", msgs[0])
    for reply, saved in zip(replies, before):
        for key, value in reply.plain_values()[0].items():
            np.testing.assert_array_equal(value, saved[key])


@pytest.mark.parametrize("make_reply", [train_reply, result_reply], ids=["flower-records", "result-reply"])
def test_inconsistent_replies_fail_as_fedavg_fails(make_reply) -> None:
    msgs = [instruction(i + 1) for i in range(3)]
    rs = results(3)
    del rs[2].arrays["b"]
    replies = [make_reply(m, r) for m, r in zip(msgs, rs)]
    with pytest.raises(InconsistentMessageReplies) as flower:
        fedavg().aggregate_train(1, replies)
    with pytest.raises(InconsistentMessageReplies) as ours:
        combined_reply(replies, "num-examples", msgs[0])
    assert str(ours.value) == str(flower.value)
    rs = results(3)
    rs[1].metrics["extra"] = 1.0
    replies = [make_reply(m, r) for m, r in zip(msgs, rs)]
    with pytest.raises(InconsistentMessageReplies, match="MetricRecords must have the same keys"):
        combined_reply(replies, "num-examples", msgs[0])
    with pytest.raises(InconsistentMessageReplies, match="Missing required key `weight`"):
        combined_reply([make_reply(m, r) for m, r in zip(msgs, results(3))], "weight", msgs[0])


def test_only_fedavg_mean_strategies_take_a_combined_reply() -> None:
    class MyFedAvg(FedAvg):  # a subclass may override aggregation: per-client replies
        pass

    assert linear_weighting(fedavg()) == "num-examples"
    assert linear_weighting(FedAvg()) == "num-examples"  # Flower's own metric mean
    assert linear_weighting(FedProx()) == "num-examples"
    assert linear_weighting(FedAvg(weighted_by_key="unit-weight")) == "unit-weight"
    assert linear_weighting(MyFedAvg()) is None
    assert linear_weighting(FedAdam()) is None
    custom = FedAvg(train_metrics_aggr_fn=lambda records, key: None)
    assert linear_weighting(custom) is None


def test_result_reply_builds_train_replys_content_only_when_read() -> None:
    msg = instruction(4)
    [result] = results(1, seed=5)
    lazy, plain = result_reply(msg, result), train_reply(msg, result)
    assert lazy.plain_values() is not None and lazy.has_content() and not lazy.has_error()
    assert lazy.metadata.src_node_id == plain.metadata.src_node_id == 4
    assert lazy.metadata.reply_to_message_id == "m4"
    content = lazy.content
    assert lazy.plain_values() is None  # built: the records are the truth from now on
    assert list(content.keys()) == list(plain.content.keys())
    assert dict(content["metrics"]) == dict(plain.content["metrics"])
    for key in plain.content["arrays"].keys():
        np.testing.assert_array_equal(content["arrays"][key].numpy(), plain.content["arrays"][key].numpy())
    restored = pickle.loads(pickle.dumps(result_reply(msg, result)))
    assert type(restored) is Message and dict(restored.content["metrics"]) == dict(plain.content["metrics"])


def test_a_result_replys_metadata_is_what_flowers_reply_constructor_gives() -> None:
    """ResultReply builds its metadata directly (records.reply_metadata): every field Flower's
    ``Message(content, reply_to=...)`` sets, equal, the TTL limited to the instruction's expiry."""
    msg = instruction(6)
    msg.metadata.__dict__["_group_id"] = "round-3"
    before = time.time()
    lazy = result_reply(msg, results(1)[0])
    plain = Message(RecordDict(), reply_to=msg)
    assert set(lazy.__dict__) >= set(plain.__dict__)  # no attribute of Flower's Message is missing
    fast, flower = lazy.metadata.__dict__, plain.metadata.__dict__
    assert set(fast) == set(flower)
    timing = {"_created_at", "_ttl"}
    assert {k: v for k, v in fast.items() if k not in timing} == {k: v for k, v in flower.items() if k not in timing}
    assert before <= fast["_created_at"] <= flower["_created_at"]
    expiry = msg.metadata.created_at + msg.metadata.ttl
    assert fast["_created_at"] + fast["_ttl"] == pytest.approx(expiry) == flower["_created_at"] + flower["_ttl"]
    assert lazy.metadata.src_node_id == 6 and lazy.metadata.dst_node_id == msg.metadata.src_node_id
    assert lazy.metadata.group_id == "round-3" and lazy.metadata.message_type == MessageType.TRAIN


def test_result_reply_content_can_be_replaced() -> None:
    reply = result_reply(instruction(2), results(1)[0])
    reply.content = RecordDict()
    assert reply.plain_values() is None and len(reply.content) == 0


def test_result_reply_copies_arrays_the_learner_does_not_own() -> None:
    state = {"w": torch.zeros(3)}
    reply = result_reply(instruction(1), TrainResult(state, 3))
    state["w"].add_(1.0)  # the learner keeps training its live parameters
    np.testing.assert_array_equal(reply.plain_values()[0]["w"], np.zeros(3, dtype=np.float32))
    assert isinstance(reply, ResultReply)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 4, 8])
def test_a_finite_weighted_sum_proves_every_reply_finite(bad, where) -> None:
    """finite_only: a non-finite value in any reply (also one of weight 0) makes the sum non-finite."""
    msgs = [instruction(i + 1) for i in range(9)]
    rs = results(9)
    plain = combined_reply([result_reply(m, r) for m, r in zip(msgs, rs)], "num-examples", msgs[0])
    finite = combined_reply([result_reply(m, r) for m, r in zip(msgs, rs)], "num-examples", msgs[0], finite_only=True)
    assert finite is not None
    assert_same_aggregate(fedavg().aggregate_train(1, [finite]), fedavg().aggregate_train(1, [plain]))
    rs[where].arrays["w"][2, 1] = bad
    if where == 8:
        rs[where].num_examples = 0  # a weight of 0 does not hide it: 0 * inf and 0 * nan are nan
    replies = [result_reply(m, r) for m, r in zip(msgs, rs)]
    assert combined_reply(replies, "num-examples", msgs[0], finite_only=True) is None
    with np.errstate(invalid="ignore", over="ignore"):  # without the check: FedAvg's arithmetic, NaN and all
        assert combined_reply(replies, "num-examples", msgs[0]) is not None
