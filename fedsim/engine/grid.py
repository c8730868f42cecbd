"""A Grid wrapper that makes every engine behave the same and never fail silently.

``MonitoredGrid`` wraps whatever Grid the engine provides (Flower's simulation grid or the
in-process one) and

* orders node ids by partition id, so a seeded ``random.sample`` picks the same partitions in
  every engine (Flower's simulation assigns random node ids);
* sorts replies by partition id before the strategy sees them, so aggregation sums in one
  canonical order (bit-identical results across engines);
* counts successful and failed replies per round, keeps each failure's reason, computes
  sample-size-weighted means of the reply metrics, and raises :class:`RunFailedError` when fewer
  training results than the strategy's minimum come back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedsim.engine.runtime import NUM_EXAMPLES, PARTITION_ID, UNIT_WEIGHT
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


def weighted_means(replies: list[Message]) -> dict[str, float]:
    """Sample-size-weighted mean of each numeric metric in the replies' ``metrics`` record."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for msg in replies:
        for record in msg.content.metric_records.values():
            w = float(record.get(NUM_EXAMPLES, 1))
            for k, v in record.items():
                if k in (NUM_EXAMPLES, UNIT_WEIGHT) or not isinstance(v, (int, float)):
                    continue
                sums[k] = sums.get(k, 0.0) + w * float(v)
                weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


class MonitoredGrid(Grid):
    """Delegating Grid: canonical node/reply order, failure accounting, minimum-result check."""

    def __init__(self, inner: Grid, min_train_results: int, query_timeout: float = 120.0) -> None:
        self.inner = inner
        self.min_train_results = min_train_results
        self.query_timeout = query_timeout
        self.partition_of: dict[int, int] = {}
        self.tally = RoundTally()

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
        """Wait for ``num_nodes`` nodes, ask each for its partition id, return node -> partition."""
        deadline = time.monotonic() + self.query_timeout
        while len(ids := list(self.inner.get_node_ids())) < num_nodes:
            if time.monotonic() > deadline:
                raise RunFailedError(f"only {len(ids)} of {num_nodes} simulated clients came up within "
                                     f"{self.query_timeout:.0f}s; check engine.flower resources")
            time.sleep(0.05)
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
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        replies.sort(key=lambda m: self.partition_of.get(m.metadata.src_node_id, 1 << 62))
        ok = [m for m in replies if not m.has_error()]
        missing = len(messages) - len(replies)
        failures = [f"partition {self.partition_of.get(m.metadata.src_node_id, '?')}: {self._reason(m)}"
                    for m in replies if m.has_error()]
        failures += [f"no reply within {timeout}s"] * missing
        self.tally.failures += [f"{kind}: {f}" for f in failures]
        if kind == MessageType.TRAIN:
            self.tally.train_ok += len(ok)
            self.tally.train_failed += len(failures)
            self.tally.train_metrics = weighted_means(ok)
            self.tally.client_train_metrics = {
                self.partition_of[m.metadata.src_node_id]: {k: float(v) for k, v in m.content["metrics"].items()
                                                            if isinstance(v, (int, float))}
                for m in ok if "metrics" in m.content}
            if len(ok) < self.min_train_results:
                detail = failures[0] if failures else "no replies"
                raise RunFailedError(
                    f"round failed: {len(ok)} training results, the strategy needs at least "
                    f"{self.min_train_results} ({len(failures)} client failures; first: {detail})")
        elif kind == MessageType.EVALUATE:
            self.tally.eval_ok += len(ok)
            self.tally.eval_failed += len(failures)
            self.tally.eval_metrics = weighted_means(ok)
        return replies

    @staticmethod
    def _reason(msg: Message) -> str:
        reason = (msg.error.reason or "").strip()
        lines = [ln for ln in reason.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else f"error code {msg.error.code}"
