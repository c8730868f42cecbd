"""One training reply for a whole round, where the strategy is Flower's FedAvg mean.

Flower's ``FedAvg.aggregate_train`` validates every reply, then averages the replies' arrays and metrics
with weights ``n_i / sum(n)`` (``strategy_utils.aggregate_arrayrecords`` / ``aggregate_metricrecords``).
Read per reply, through Flower's typed record views, that is ~16 us per client: at 1,000 tiny clients
a few percent of a sequential round and much more of a vectorised one.

:func:`combined_reply` computes that same mean once, in the same order and with the same float
operations (``x_i * (n_i / N)`` accumulated with ``+=`` in partition order, on the replies' own NumPy
arrays, :class:`~fedsim.engine.arrays.ResidentArray`), and returns it as one reply weighing ``N``.  FedAvg
averaging that single reply multiplies each value by ``N / N = 1.0``, so the global model and the
aggregated metrics are bit for bit what FedAvg computes from the separate replies (the tests compare
them).  The replies are first checked exactly as FedAvg checks them
(``validate_message_reply_consistency``), so an inconsistent reply fails the round with Flower's own
error.

Only strategies whose class is Flower's ``FedAvg`` or ``FedProx`` (their aggregation is FedAvg's, not
overridden) with the default metric mean qualify (:func:`linear_weighting`); every other strategy
(FedSVD, FedPhoenix, the robust and adaptive stock strategies, a client-level DP wrapper, a user's
plugin) still receives one message per client.  What changes for a qualifying strategy is only what
Flower's INFO log counts ("Received 1 results").
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp.strategy import FedAvg, FedProx
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords, validate_message_reply_consistency

from fedsim.engine.arrays import array_record
from fedsim.engine.records import (ReplyRecordDict, aggregate_metric_records, mean_metric_values, metric_record,
                                   plain_values, reply_arrays, reply_metrics)

#: Strategy classes whose ``aggregate_train`` is Flower's FedAvg mean (exact classes: a subclass may override it).
LINEAR_STRATEGIES: tuple[type, ...] = (FedAvg, FedProx)


def linear_weighting(strategy: Any) -> str | None:
    """The weighting key (``num-examples``) when ``strategy`` aggregates training replies as Flower's
    FedAvg mean with the default metric mean, so one :func:`combined_reply` may stand for all; else None."""
    if type(strategy) not in LINEAR_STRATEGIES:
        return None
    if getattr(strategy, "train_metrics_aggr_fn", None) not in (aggregate_metric_records, aggregate_metricrecords):
        return None
    return str(strategy.weighted_by_key)


def check_consistent(replies: list[Message], weighting_key: str) -> None:
    """FedAvg's reply check (``validate_message_reply_consistency``), with its errors; on the plain values of
    :class:`~fedsim.engine.records.ResultReply` replies without building their records."""
    values = [plain_values(m) for m in replies]
    if any(v is None for v in values):
        validate_message_reply_consistency([m.content for m in replies], weighting_key, check_arrayrecord=True)
        return
    arrays0, metrics0 = values[0]  # type: ignore[misc]
    if any(a.keys() != arrays0.keys() for a, _ in values[1:]):  # type: ignore[misc]
        raise InconsistentMessageReplies(reason="All ArrayRecords must have the same keys for aggregation. "
                                                "This condition wasn't met. Skipping aggregation.")
    if any(m.keys() != metrics0.keys() for _, m in values[1:]):  # type: ignore[misc]
        raise InconsistentMessageReplies(reason="All MetricRecords must have the same keys for aggregation. "
                                                "This condition wasn't met. Skipping aggregation.")
    if weighting_key not in metrics0:
        raise InconsistentMessageReplies(reason=f"Missing required key `{weighting_key}` in the MetricRecord of "
                                                "reply messages. Cannot average ArrayRecords and MetricRecords. "
                                                "Skipping aggregation.")
    if any(isinstance(m[weighting_key], list) for _, m in values):  # type: ignore[misc]
        raise InconsistentMessageReplies(reason=f"Key `{weighting_key}` in the MetricRecord of reply messages "
                                                "must be a single value (int or float), but a list was found. "
                                                "Skipping aggregation.")


def combined_reply(replies: list[Message], weighting_key: str, reply_to: Message,
                   finite_only: bool = False) -> Message | None:
    """One reply whose FedAvg aggregate equals FedAvg's aggregate of ``replies`` (successful ones, in
    the order the strategy would see them), bit for bit; it answers ``reply_to``.

    ``finite_only``: None instead when a floating-point entry of the weighted sum is not finite.  A
    finite sum proves every reply's floating-point arrays finite (a NaN or infinity times a weight
    ``n_i / N >= 0`` is NaN or infinite, and so is any sum it enters), so the caller may skip checking
    the replies one by one; a non-finite sum means a reply is not finite or the sum overflowed.
    """
    check_consistent(replies, weighting_key)
    metric_values = [reply_metrics(m) for m in replies]
    total = sum(m[weighting_key] for m in metric_values)
    factors = [m[weighting_key] / total for m in metric_values]
    acc: dict[str, np.ndarray] = {}
    floating: set[str] = set()
    # a non-finite reply is expected under finite_only (it is then found and rejected): no NumPy warning for it
    with np.errstate(invalid="ignore", over="ignore") if finite_only else contextlib.nullcontext():
        for reply, factor in zip(replies, factors):
            for key, array in reply_arrays(reply):
                if array.dtype.kind in "fc":
                    floating.add(key)
                value = array * factor  # a new array: the reply's own is never written
                if key in acc:
                    acc[key] += value
                else:
                    acc[key] = value
    if finite_only and not all(np.isfinite(acc[key]).all() for key in floating):
        return None
    metrics = mean_metric_values(zip(metric_values, factors), weighting_key)
    metrics[weighting_key] = total
    return Message(ReplyRecordDict({"arrays": array_record(acc), "metrics": metric_record(metrics)}), reply_to=reply_to)
