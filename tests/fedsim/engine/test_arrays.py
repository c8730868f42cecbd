"""ResidentArray: the same bytes, ids and values as Flower's Array, without serialising in process."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedsim.engine.arrays import ResidentArray, resident_record


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(2, generator=g, dtype=torch.float64)}


def test_resident_record_is_indistinguishable_from_flowers(state) -> None:
    resident, plain = resident_record(state), ArrayRecord(state)
    assert list(resident) == list(plain)  # key order kept
    for key in state:
        a, b = resident[key], plain[key]
        assert (a.dtype, a.shape, a.stype) == (b.dtype, b.shape, b.stype)
        assert a.data == b.data and a.deflate() == b.deflate()  # Flower's wire format, class name included
    assert resident.object_id == plain.object_id
    got = resident.to_torch_state_dict()
    assert all(torch.equal(got[k], state[k]) and got[k].dtype == state[k].dtype for k in state)


def test_no_serialisation_until_the_bytes_are_needed(state) -> None:
    record = resident_record(state)
    assert all("data" not in record[k].__dict__ for k in state)
    record.to_torch_state_dict()
    assert all("data" not in record[k].__dict__ for k in state)  # numpy() does not need the bytes
    _ = record["w"].data
    assert "data" in record["w"].__dict__


def test_values_are_copies_owned_by_the_caller(state) -> None:
    record, before = resident_record(state), state["w"].clone()
    state["w"].add_(1.0)  # the learner's tensors keep changing after the reply
    first = record["w"].numpy()
    first += 100.0  # a strategy aggregating in place
    np.testing.assert_array_equal(record["w"].numpy(), before.numpy())


def test_pickles_without_bytes_and_round_trips(state) -> None:
    record = resident_record(state)
    back = pickle.loads(pickle.dumps(record))
    assert isinstance(back["w"], ResidentArray)
    assert all(torch.equal(back.to_torch_state_dict()[k], state[k]) for k in state)
    _ = record["b"].data
    record["b"].data = Array(np.zeros(5, dtype=np.int64)).data  # set explicitly: a plain Array from here on
    again = pickle.loads(pickle.dumps(record))
    assert type(again["b"]) is Array
    np.testing.assert_array_equal(again["b"].numpy(), np.zeros(5, dtype=np.int64))
    np.testing.assert_array_equal(record["b"].numpy(), np.zeros(5, dtype=np.int64))


def test_a_missing_attribute_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="nothing"):
        _ = ResidentArray(np.ones(2)).nothing


def test_owned_tensors_are_wrapped_without_a_second_copy(state) -> None:
    """``copy=False`` (a learner's ``TrainResult.owned``): the reply shares the tensors' memory and is still
    Flower's record byte for byte; a strategy's ``numpy()`` is still its own copy."""
    record = resident_record(state, copy=False)
    assert all(np.shares_memory(record[k].__dict__["_ndarray"], state[k].numpy()) for k in state)
    assert record.object_id == ArrayRecord(state).object_id
    mine = record["w"].numpy()
    mine += 100.0
    np.testing.assert_array_equal(record["w"].numpy(), state["w"].numpy())
    copied = resident_record(state)
    assert not any(np.shares_memory(copied[k].__dict__["_ndarray"], state[k].numpy()) for k in state)


def test_train_reply_copies_only_arrays_the_learner_does_not_own(state) -> None:
    from flwr.app import Message, MessageType, RecordDict

    from fedsim.contracts.learner import TrainResult
    from fedsim.engine.local import server_identity
    from fedsim.engine.runtime import train_reply

    with server_identity(run_id=1):
        msg = Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = "m"
    shared = train_reply(msg, TrainResult(state, 3, owned=True)).content["arrays"]
    live = train_reply(msg, TrainResult(state, 3)).content["arrays"]
    assert np.shares_memory(shared["w"].__dict__["_ndarray"], state["w"].numpy())
    before = state["w"].clone()
    state["w"].add_(1.0)  # a learner that returned its live parameters keeps training them
    np.testing.assert_array_equal(live["w"].numpy(), before.numpy())


def test_resident_arrays_parses_a_serialised_record_once_with_the_same_values() -> None:
    from flwr.app import Array, ArrayRecord

    from fedsim.engine.arrays import resident_arrays

    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([3], dtype=np.int64)}
    plain = ArrayRecord({k: Array(v) for k, v in values.items()})
    resident = resident_arrays(plain)
    assert list(resident.keys()) == ["w", "n"]
    for key, value in values.items():
        assert "_ndarray" in resident[key].__dict__  # parsed: reads no longer np.load the bytes
        np.testing.assert_array_equal(resident[key].numpy(), value)
        assert resident[key].numpy().dtype == value.dtype and resident[key].data == plain[key].data  # same bytes
    assert resident_arrays(resident) is resident
