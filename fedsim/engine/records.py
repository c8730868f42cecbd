"""A Flower ``RecordDict`` whose typed views cost one pass instead of a re-validated copy.

Flower's ``RecordDict.array_records`` / ``.metric_records`` build a fresh ``_SyncedDict`` on every
access, inserting each record through the view's checked ``__setitem__``, which also writes it back
into the ``RecordDict`` through *its* checked ``__setitem__``.  Flower's FedAvg reads them four to six
times per reply (consistency check, weights, arrays, metrics), and fedsim's reply checks twice more:
at 1,000 clients that was a sixth of a sequential round (``benchmarks/bench_engine.py``, profiled).

:class:`ReplyRecordDict` builds the same view, filled directly with the records it already holds
(they were type-checked when they were set), so a view behaves exactly as Flower's: writing to it
still writes through to the ``RecordDict``.  Its ``__qualname__`` is ``"RecordDict"`` (Flower's object
headers name the class, and a receiver must inflate it as a plain one) and it pickles as itself.
The engines use it for the replies their ClientApps build (:func:`fedsim.engine.runtime.train_reply`).
A view is built once and kept until the ``RecordDict`` itself changes (every write, through a view or
not, goes through its ``__setitem__``/``__delitem__``, which drop the kept views).

:func:`aggregate_metric_records` is Flower's ``aggregate_metricrecords`` (FedAvg's default metric
aggregation) with the same arithmetic in the same order, accumulated in a plain dict and checked
once at the end instead of through ``MetricRecord``'s checked ``__setitem__`` per client and metric
(a tenth of a vectorised 1,000-client round); :func:`fedsim.engine.server.build_strategy` puts it
in place of Flower's where a strategy uses Flower's default.

Building a reply is cheap too: :class:`ReplyRecordDict` and :func:`metric_record` check their
contents with one ``isinstance`` pass and store them, where Flower's constructors run a checked
``__setitem__`` per item (~10 us per metric: a tenth of a tiny client's reply).  Contents of other
types go through Flower's own checks, so bad values raise Flower's own errors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.app.message.recorddict import _SyncedDict  # Flower's view type, so views behave as Flower's

from fedsim.engine.arrays import array_record, ndarray_of


_RECORD_TYPES = (ArrayRecord, MetricRecord, ConfigRecord)
_SCALARS = (int, float)  # exact types: Flower refuses bool, which subclasses int


def metric_record(values: dict[str, Any]) -> MetricRecord:
    """``MetricRecord(values)``, stored in one pass when every value is a plain int or float."""
    if all(type(k) is str and type(v) in _SCALARS for k, v in values.items()):
        record = MetricRecord()
        record.__dict__["_data"].update(values)
        return record
    return MetricRecord(values)


class ReplyRecordDict(RecordDict):
    """A ``RecordDict`` with cheap typed views (same contents, same write-through behaviour)."""

    __qualname__ = "RecordDict"

    def __init__(self, records: dict[str, Any] | None = None) -> None:  # noqa: D107
        if records and all(type(k) is str and isinstance(v, _RECORD_TYPES) for k, v in records.items()):
            super().__init__()
            self.__dict__["_data"].update(records)
        else:
            super().__init__(records)

    def _view(self, kind: type) -> Any:
        views = self.__dict__.setdefault("_views", {})  # kept until the RecordDict changes
        view = views.get(kind)
        if view is None:
            view = views[kind] = _SyncedDict[kind](self, kind)
            view.__dict__["_data"] = {k: v for k, v in self.__dict__["_data"].items() if isinstance(v, kind)}
        return view

    def __setitem__(self, key: str, value: Any) -> None:
        self.__dict__.pop("_views", None)  # a view written to writes through here: it is rebuilt next time
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.__dict__.pop("_views", None)
        super().__delitem__(key)

    @property
    def array_records(self) -> Any:
        return self._view(ArrayRecord)

    @property
    def metric_records(self) -> Any:
        return self._view(MetricRecord)

    @property
    def config_records(self) -> Any:
        return self._view(ConfigRecord)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # by function, not by class name (the class calls itself "RecordDict")
        return _reply_record_dict, (dict(self.__dict__["_data"]),)


def _reply_record_dict(records: dict[str, Any]) -> ReplyRecordDict:
    return ReplyRecordDict(records)


def aggregate_metric_records(records: list[RecordDict], weighting_metric_name: str) -> MetricRecord:
    """``flwr.serverapp.strategy.strategy_utils.aggregate_metricrecords``, bit for bit, in one pass."""
    metric_lists = [list(record.metric_records.values()) for record in records]
    weights = [items[0][weighting_metric_name] for items in metric_lists]
    total_weight = sum(weights)
    factors = [w / total_weight for w in weights]
    pairs = [(item, f) for items, f in zip(metric_lists, factors, strict=True) for item in items]
    return metric_record(mean_metric_values(pairs, weighting_metric_name))


def mean_metric_values(weighted: Iterable[tuple[Any, float]], weighting_metric_name: str) -> dict[str, Any]:
    """Flower's metric mean (``sum value * factor``, lists element-wise, in order) of ``(metrics, factor)``
    pairs, the weighting key left out."""
    acc: dict[str, Any] = {}
    for item, weight in weighted:
        for key, value in item.items():
            if key == weighting_metric_name:
                continue
            if key not in acc:
                acc[key] = [v * weight for v in value] if isinstance(value, list) else value * weight
            elif isinstance(value, list):
                acc[key] = [c + v * weight for c, v in zip(acc[key], value, strict=True)]
            else:
                acc[key] = acc[key] + value * weight
    return acc


class ResultReply(Message):
    """A successful training reply that keeps the learner's result as plain values until read.

    ``arrays`` (host NumPy arrays the reply owns) and ``metrics`` (the reply's metric values, weight keys
    included) are what :func:`fedsim.engine.runtime.train_reply` would put in its records; ``content``
    builds exactly those records on first access, so a strategy, a check or Flower's runtime sees a
    plain reply.  fedsim's own round code (:class:`~fedsim.engine.grid.MonitoredGrid`,
    :mod:`fedsim.engine.cohort_reply`) reads the values directly while the content has not been built
    (:func:`reply_metrics`, :func:`reply_arrays`): a reply of a round whose strategy takes one combined
    reply is never turned into Flower records at all (~20 us per client saved).  It pickles as a plain
    ``Message``.
    """

    __qualname__ = "Message"

    def __init__(self, reply_to: Message, arrays: dict[str, np.ndarray], metrics: dict[str, Any]) -> None:  # noqa: D107
        # what Message(content, reply_to=reply_to) sets, without re-checking its arguments (see reply_metadata)
        self.__dict__.update(_metadata=reply_metadata(reply_to, time.time()), _content=None, _error=None,
                             values=(arrays, metrics))

    @property  # type: ignore[override]
    def content(self) -> RecordDict:
        if self.__dict__["_content"] is None:
            arrays, metrics = self.__dict__["values"]
            self.__dict__["_content"] = ReplyRecordDict({"arrays": array_record(arrays), "metrics": metric_record(metrics)})
        return self.__dict__["_content"]

    @content.setter
    def content(self, value: RecordDict) -> None:
        _ = self.content  # built, so the plain values are never read again
        Message.content.fset(self, value)  # type: ignore[attr-defined]

    def has_content(self) -> bool:
        return True

    def plain_values(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """``(arrays, metrics)`` while the content has not been built (then nothing can have changed them)."""
        return self.__dict__["values"] if self.__dict__["_content"] is None else None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _plain_message, (self.metadata, self.content)


def reply_metadata(reply_to: Message, created_at: float) -> Metadata:
    """The metadata ``Message(content, reply_to=reply_to)`` gives a reply created at ``created_at`` (Unix time),
    built directly: the same fields Flower's constructor sets (the source and destination swapped, the TTL
    limited to the expiry of ``reply_to``) without its argument checks and clock reads (~4 us a reply, a
    twentieth of a tiny client's round on the server; ``tests/fedsim/engine/test_cohort_reply.py`` compares the two)."""
    md = reply_to.metadata
    metadata = Metadata(run_id=md.run_id, message_id="", src_node_id=md.dst_node_id, dst_node_id=md.src_node_id,
                        reply_to_message_id=md.message_id, group_id=md.group_id, created_at=created_at,
                        ttl=md.created_at + md.ttl - created_at, message_type=md.message_type,
                        src_task_id=md.dst_task_id, dst_task_id=md.src_task_id)
    metadata.delivered_at = ""
    return metadata


def _plain_message(metadata: Any, content: RecordDict) -> Message:
    return Message(metadata=metadata, content=content)


def plain_values(msg: Message) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """A :class:`ResultReply`'s ``(arrays, metrics)`` while its records are unbuilt; None for any other reply."""
    return msg.plain_values() if isinstance(msg, ResultReply) else None


def reply_metrics(msg: Message) -> Any:
    """The metric values FedAvg weighs a reply by: its first MetricRecord (a ``ResultReply``'s own dict)."""
    values = plain_values(msg)
    return values[1] if values is not None else next(iter(msg.content.metric_records.values()))


def reply_arrays(msg: Message) -> list[tuple[str, Any]]:
    """``(key, NumPy array)`` of every array a reply carries, without copies (read only)."""
    values = plain_values(msg)
    if values is not None:
        return list(values[0].items())
    return [(key, ndarray_of(array)) for record in msg.content.array_records.values() for key, array in record.items()]
