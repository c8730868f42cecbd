"""A Grid wrapper that makes every engine behave the same and never fail silently.

``MonitoredGrid`` wraps whatever Grid the engine provides (Flower's simulation grid or the
in-process one) and

* orders node ids by partition id, so a seeded ``random.sample`` picks the same partitions in
  every engine (Flower's simulation assigns random node ids);
* sorts replies by partition id before the strategy sees them, so aggregation sums in one
  canonical order (bit-identical results across engines);
* applies the simulated system model (:mod:`fedsim.engine.system`): unavailable clients and
  stragglers past the deadline are removed from a training round before anything is computed;
* resends a failed client's message (an exception or a timeout) up to ``engine.retries`` times,
  with the attempt number in the round config (``fedsim-attempt``);
* counts a training reply with a non-finite loss or non-finite parameters as a failed client (with
  the reason) and keeps it from the strategy, whatever the engine;
* counts successful and failed replies per round, keeps each failure's reason, computes
  sample-size-weighted means of the reply metrics, and raises :class:`RunFailedError` when fewer
  training results than the strategy's minimum come back;
* hands a strategy that aggregates as Flower's FedAvg mean (``combine_key``) one combined training
  reply instead of one per client, with the same aggregate bit for bit (:mod:`fedsim.engine.cohort_reply`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedsim.engine.arrays import ndarray_of
from fedsim.engine.cohort_reply import combined_reply
from fedsim.engine.records import ResultReply, plain_values, reply_arrays
from fedsim.engine.runtime import ATTEMPT, NUM_EXAMPLES, PARTITION_ID, UNIT_WEIGHT
from fedsim.engine.system import SystemModel
from fedsim.errors import RunFailedError


@dataclass
class RoundTally:
    """Reply statistics of one round, filled by :class:`MonitoredGrid`."""

    started: float | None = None
    train_ok: int = 0
    train_failed: int = 0
    eval_ok: int = 0
    eval_failed: int = 0
    failures: list[str] = field(default_factory=list)
    train_metrics: dict[str, float] = field(default_factory=dict)
    client_train_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    dropped: int = 0  # unavailable this round (system model)
    stragglers: int = 0  # past the round deadline (system model)
    retried: int = 0  # messages resent after a failure
    sim_seconds: float | None = None  # simulated length of the round (None without a system model)


def weighted_means(replies: list[Message]) -> dict[str, float]:
    """Sample-size-weighted mean of each numeric metric in the replies' ``metrics`` record."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for msg in replies:
        values = plain_values(msg)
        for record in [values[1]] if values is not None else msg.content.metric_records.values():
            w = float(record.get(NUM_EXAMPLES, 1))
            for k, v in record.items():
                if k in (NUM_EXAMPLES, UNIT_WEIGHT) or not isinstance(v, (int, float)):
                    continue
                sums[k] = sums.get(k, 0.0) + w * float(v)
                weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


_inexact: dict[str, bool] = {}  # dtype name -> floating or complex (np.dtype parsing costs ~10 us)


def finite_array(array: Array) -> bool:
    """Whether a Flower ``Array`` holds no NaN or infinity (non-float arrays always do)."""
    inexact = _inexact.get(array.dtype)
    if inexact is None:
        inexact = _inexact[array.dtype] = bool(np.issubdtype(np.dtype(array.dtype), np.inexact))
    if not inexact:
        return True
    return bool(np.isfinite(ndarray_of(array)).all())


def metrics_of(msg: Message) -> Any:
    """A reply's ``metrics`` record (empty if it has none); a ResultReply's own values."""
    values = plain_values(msg)
    if values is not None:
        return values[1]
    return msg.content["metrics"] if "metrics" in msg.content else {}


def non_finite_loss(msg: Message) -> str | None:
    """Why a training reply's loss cannot be aggregated (it is not finite); None if it can."""
    loss = metrics_of(msg).get("train_loss")
    if isinstance(loss, (int, float)) and not math.isfinite(loss):
        return f"non-finite loss ({loss}): lower client.lr"
    return None


def non_finite_reason(msg: Message) -> str | None:
    """Why a training reply cannot be aggregated (a non-finite loss or parameter); None if it can."""
    why = non_finite_loss(msg)
    if why is not None:
        return why
    for key, array in reply_arrays(msg):
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            return f"non-finite parameters ({key}): lower client.lr"
    return None


class MonitoredGrid(Grid):
    """Delegating Grid: canonical node/reply order, failure accounting, minimum-result check."""

    def __init__(self, inner: Grid, min_train_results: int, query_timeout: float = 120.0,
                 system: SystemModel | None = None, retries: int = 0) -> None:
        self.inner = inner
        self.min_train_results = min_train_results
        self.query_timeout = query_timeout
        self.system = system
        self.retries = retries
        self.partition_of: dict[int, int] = {}
        self.tally = RoundTally()
        #: set (to the weighting key) when the strategy aggregates as Flower's FedAvg mean: a training round's
        #: successful replies then reach it as one combined reply (:mod:`fedsim.engine.cohort_reply`)
        self.combine_key: str | None = None

    # -- plumbing ------------------------------------------------------------------------------
    def set_run(self, run_id: int) -> None:  # pragma: no cover - the engine sets the inner run
        self.inner.set_run(run_id)

    @property
    def run(self):  # type: ignore[override]
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def get_node_ids(self) -> list[int]:
        ids = list(self.inner.get_node_ids())
        return sorted(ids, key=lambda n: (self.partition_of.get(n, 1 << 62), n))

    # -- setup ---------------------------------------------------------------------------------
    def discover(self, num_nodes: int) -> dict[int, int]:
        """Wait for ``num_nodes`` nodes, ask each for its partition id, return node -> partition.

        A grid that keeps its nodes' contexts on the driver (the local and ray engines:
        :class:`~fedsim.engine.driver.DriverGrid`) reads them from there, as its nodes would answer."""
        deadline = time.monotonic() + self.query_timeout
        while len(ids := list(self.inner.get_node_ids())) < num_nodes:
            if time.monotonic() > deadline:
                raise RunFailedError(f"only {len(ids)} of {num_nodes} simulated clients came up within "
                                     f"{self.query_timeout:.0f}s; check engine.flower resources")
            time.sleep(0.05)
        known = getattr(self.inner, "partitions", None)  # a grid holding its nodes' contexts knows the answers
        if known is not None:
            self.partition_of = known()
            return self.partition_of
        msgs = [Message(RecordDict(), node_id, MessageType.QUERY) for node_id in ids]
        replies = list(self.inner.send_and_receive(msgs, timeout=self.query_timeout))
        bad = [r for r in replies if r.has_error()]
        if len(replies) != len(ids) or bad:
            reason = bad[0].error.reason if bad else "no reply"
            raise RunFailedError(f"{len(ids) - len(replies) + len(bad)} clients did not answer the setup query: {reason}")
        self.partition_of = {r.metadata.src_node_id: int(r.content["metrics"][PARTITION_ID]) for r in replies}
        return self.partition_of

    # -- the monitored round trip ---------------------------------------------------------------
    def begin_round(self) -> None:
        self.tally = RoundTally()

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages:
            return []
        if self.tally.started is None:
            self.tally.started = time.perf_counter()
        kind = messages[0].metadata.message_type.split(".")[0]
        if kind == MessageType.TRAIN and self.system is not None:
            messages = self._apply_system_model(messages)
        deadline = time.monotonic() + timeout if timeout is not None else None
        replies = self._send_with_retries(messages, deadline)
        replies.sort(key=lambda m: self.partition_of.get(m.metadata.src_node_id, 1 << 62))
        missing = len(messages) - len(replies)
        rejected: list[tuple[Message, str]] = []
        combined: Message | None = None
        if kind == MessageType.TRAIN:
            combined = self._combined_if_finite(messages, replies)
            if combined is None:  # check the replies one by one (a finite combined sum proves them all finite)
                replies, rejected = _reject_non_finite(replies)
        ok = [m for m in replies if not m.has_error()]
        failures = [f"partition {self.partition_of.get(m.metadata.src_node_id, '?')}: {self._reason(m)}"
                    for m in replies if m.has_error()]
        failures += [f"partition {self.partition_of.get(m.metadata.src_node_id, '?')}: {why}" for m, why in rejected]
        failures += [f"no reply within {timeout}s"] * missing
        self.tally.failures += [f"{kind}: {f}" for f in failures]
        if kind == MessageType.TRAIN:
            self.tally.train_ok += len(ok)
            self.tally.train_failed += len(failures)
            self.tally.train_metrics = weighted_means(ok)
            self.tally.client_train_metrics = {
                self.partition_of[m.metadata.src_node_id]: {k: float(v) for k, v in metrics_of(m).items()
                                                            if isinstance(v, (int, float))}
                for m in ok if isinstance(m, ResultReply) or "metrics" in m.content}
            if len(ok) < self.min_train_results:
                detail = failures[0] if failures else "no replies"
                lost = (f"; {self.tally.dropped} unavailable, {self.tally.stragglers} past the deadline"
                        if self.system is not None else "")
                raise RunFailedError(
                    f"round failed: {len(ok)} training results, the strategy needs at least "
                    f"{self.min_train_results} ({len(failures)} client failures; first: {detail}{lost})")
            if self.combine_key is not None and len(ok) > 1:
                if combined is None:
                    combined = combined_reply(ok, self.combine_key, self._reply_to(messages, ok[0]))
                return [combined] + [m for m in replies if m.has_error()]
        elif kind == MessageType.EVALUATE:
            self.tally.eval_ok += len(ok)
            self.tally.eval_failed += len(failures)
            self.tally.eval_metrics = weighted_means(ok)
        return replies

    def _combined_if_finite(self, messages: list[Message], replies: list[Message]) -> Message | None:
        """The round's combined training reply when the strategy takes one and every reply is finite; else
        None (the caller then checks replies one by one and combines the kept ones, as before).

        The weighted sum is computed anyway, and a finite one proves every reply's parameters finite
        (:func:`~fedsim.engine.cohort_reply.combined_reply`), which saves checking each reply's arrays.
        """
        if self.combine_key is None:
            return None
        ok = [m for m in replies if not m.has_error()]
        if len(ok) < max(2, self.min_train_results):
            return None
        if any(non_finite_loss(m) is not None for m in ok):
            return None
        try:
            return combined_reply(ok, self.combine_key, self._reply_to(messages, ok[0]), finite_only=True)
        except Exception:  # noqa: BLE001 - e.g. inconsistent replies: the per-reply path raises it after rejecting
            return None

    @staticmethod
    def _reply_to(messages: list[Message], reply: Message) -> Message:
        """The sent message ``reply`` answers (the combined reply answers the first successful client's)."""
        return next(m for m in messages if m.metadata.dst_node_id == reply.metadata.src_node_id)

    # -- system model and retries --------------------------------------------------------------
    def _apply_system_model(self, messages: list[Message]) -> list[Message]:
        """Keep the messages whose clients are available and make the deadline (this round)."""
        assert self.system is not None
        server_round = _round_of(messages[0])
        by_pid = {self.partition_of.get(m.metadata.dst_node_id, -1): m for m in messages}
        plan = self.system.plan(sorted(by_pid), server_round)
        self.tally.dropped += len(plan.dropped)
        self.tally.stragglers += len(plan.stragglers)
        self.tally.sim_seconds = max(self.tally.sim_seconds or 0.0, plan.sim_seconds)
        return [by_pid[p] for p in plan.in_time]

    def _send_with_retries(self, messages: list[Message], deadline: float | None) -> list[Message]:
        """Send, then resend the failed ones (errors or missing replies) while retries and time remain."""
        pending = {m.metadata.dst_node_id: m for m in messages}
        final: dict[int, Message] = {}
        for attempt in range(self.retries + 1):
            if not pending:
                break
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if attempt > 0:
                if left is not None and left <= 0:
                    break
                self.tally.retried += len(pending)
                pending = {node: _with_attempt(m, attempt) for node, m in pending.items()}
            replies = list(self.inner.send_and_receive(list(pending.values()), timeout=left))
            for reply in replies:
                final[reply.metadata.src_node_id] = reply
            pending = {node: m for node, m in pending.items() if node not in final or final[node].has_error()}
        return list(final.values())

    @staticmethod
    def _reason(msg: Message) -> str:
        reason = (msg.error.reason or "").strip()
        lines = [ln for ln in reason.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else f"error code {msg.error.code}"


def _reject_non_finite(replies: list[Message]) -> tuple[list[Message], list[tuple[Message, str]]]:
    """Split the replies into those the strategy may see and the non-finite ones with their reason."""
    kept, rejected = [], []
    for msg in replies:
        why = None if msg.has_error() else non_finite_reason(msg)
        if why is None:
            kept.append(msg)
        else:
            rejected.append((msg, why))
    return kept, rejected


def _round_of(msg: Message) -> int:
    config = msg.content["config"] if "config" in msg.content else {}
    return int(config.get("server-round", 0))


def _with_attempt(msg: Message, attempt: int) -> Message:
    """A fresh copy of ``msg`` (same content and destination) marked as retry number ``attempt``."""
    content = RecordDict(dict(msg.content.items()))
    config = dict(msg.content["config"]) if "config" in msg.content else {}
    content["config"] = ConfigRecord({**config, ATTEMPT: attempt})
    return Message(content, msg.metadata.dst_node_id, msg.metadata.message_type, group_id=msg.metadata.group_id)
