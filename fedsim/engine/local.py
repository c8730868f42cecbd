"""The ``local`` engine: a Flower ``Grid`` that delivers messages to the ClientApp in-process.

No SuperLink, no Ray, no serialisation: Flower's own strategies run unchanged against
:class:`InProcessGrid`, fedsim's own ClientApp is served by calling its learner directly (the same
replies, built after the round's calls; see :meth:`InProcessGrid._deliver`), the learner keeps its model
and data resident between rounds, and each
node keeps a persistent ``Context`` (so ``context.state`` survives across rounds, as in Flower's
simulation, and the server can checkpoint it).  Client exceptions become error replies, exactly as
Flower's runtimes report them.

Deadlines: the clients of a simulated round conceptually run in parallel, so each call gets a
budget of its own, counted from its own start: ``min(engine.client_timeout_s, round_timeout_s)``
(:func:`~fedsim.engine.runtime.client_call_limit`; the round timeout when unset), and a hanging
client costs its own slot only (the calls after it run normally).  A round's calls run back to back
on a long-lived daemon thread (:func:`~fedsim.engine.runtime.call_all_with_deadline`) while the
server thread sleeps until they end or the running call overruns; one that overruns is abandoned
with a timeout reply, the calls after it go to a fresh thread, and since the abandoned thread may
still be using the learner, the next call builds a fresh one.  The wall time of a sequential round
is therefore at most (calls × limit), its simulated length at most the limit.

With ``engine.vectorise`` a round's training messages are answered together by
:func:`clients.vectorised.train_cohort` (the sequential result to float tolerance): ``true`` wherever
that is exact (a refusal is logged as a warning), ``auto`` (the default) only where it is exact and
measured faster (:func:`clients.vectorised.auto_vectorise`; a refusal is logged at debug level).  The
per-call deadline does not split a batched cohort; the round deadline still bounds the round.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message, MessageType
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID

from fedsim.engine.driver import DriverGrid, call_client_app, error_reply, failure_reply, task_identity
from fedsim.contracts.history import RoundObserver
from fedsim.engine.runtime import (ClientTimeout, RunSpec, build_client_app, call_all_with_deadline, client_call_limit,
                                   evaluate_reply, get_learner, learner_call, query_reply, release_hangs, result_reply)
from fedsim.engine.server import ServerResult, run_server
from fedsim.registry import ENGINES
from fedsim.seeding import prime_seeds

log = logging.getLogger("fedsim")

#: Fewest training calls for which a round's seeds are derived in one pass (a pass costs about two cold seeds).
_PRIME_MIN = 2

#: Message types fedsim's own ClientApp answers directly (its learner's train / evaluate, the set-up query).
_DIRECT = (MessageType.TRAIN, MessageType.EVALUATE, MessageType.QUERY)


def _raise(exc: Exception) -> Any:
    raise exc


def _failure(msg: Message, exc: BaseException) -> Message:
    """A failed direct learner call's error reply; an interrupt (not an ``Exception``) is re-raised."""
    if not isinstance(exc, Exception):
        raise exc
    return failure_reply(msg, exc)


class InProcessGrid(DriverGrid):
    """Synchronous in-process Grid: ``send_and_receive`` runs the ClientApp for each message.

    ``client_timeout`` limits each call (None: calls run inline, unlimited); the ``timeout`` of
    ``send_and_receive`` caps it further, per call, from that call's own start.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1,
                 client_timeout: float | None = None, spec: RunSpec | None = None, threads: int = 0) -> None:
        self.client_app = client_app
        self.threads = threads  # torch intra-op threads the client calls run with (engine.threads_per_client)
        self.client_timeout = client_timeout
        # set when client_app is fedsim's own (build_client_app(spec)): its train / evaluate messages call the
        # learner directly, and a round's cohort trains together where engine.vectorise allows
        self.spec = spec
        self._vectorise_refused: str | None = None
        self._call_timeout: float | None = None  # the timeout of the send_and_receive under way
        self._init_nodes(run_id, num_nodes)
        self._replies: dict[str, Message] = {}
        self._pids: dict[int, int] | None = None
        self._id_prefix, self._ids = uuid.uuid4().hex[:16], itertools.count()

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        for msg in messages:  # unique ids, as the SuperLink's uuid4 hex (a per-grid random prefix, then a counter)
            msg.metadata.__dict__["_message_id"] = f"{self._id_prefix}{next(self._ids):016x}"
        vectorise = self.spec is not None and self.spec.cfg.engine.vectorise is not False
        cohort = self._train_cohort(messages) if vectorise else {}
        self._replies.update(cohort)
        self._replies.update(self._deliver([m for m in messages if m.metadata.message_id not in cohort]))
        return [m.metadata.message_id for m in messages]

    def _train_cohort(self, messages: list[Message]) -> dict[str, Message]:
        """Train messages answered together by the learner's :meth:`~fedsim.contracts.learner.Learner.train_cohort`
        (``engine.vectorise``).

        Clients with an injected fault, and every client when the cohort cannot be vectorised
        exactly (the reason is logged once) or the batched call raises, go the sequential way.
        """
        from fedsim.engine.runtime import ATTEMPT, _decoded, get_learner, injected_fault, node_context, torch_threads

        spec = self.spec
        assert spec is not None
        cfg = spec.cfg
        msgs, ctxs = [], []
        for msg in messages:
            if msg.metadata.message_type != MessageType.TRAIN:
                continue
            ctx = node_context(msg, self.contexts[msg.metadata.dst_node_id], cfg)
            if injected_fault(cfg, ctx.partition_id, ctx.server_round, int(ctx.config.get(ATTEMPT, 0))) is None:
                msgs.append(msg)
                ctxs.append(ctx)
        if len(msgs) < 2:
            return {}
        learner = get_learner(spec)
        auto = cfg.engine.vectorise == "auto"
        reason = learner.cohort_refusal(ctxs, auto)
        if reason is not None:
            if reason != self._vectorise_refused:
                log.log(logging.DEBUG if auto else logging.WARNING,
                        "engine.vectorise: training clients one by one, because %s", reason)
                self._vectorise_refused = reason
            return {}
        try:
            with torch_threads(cfg.engine.threads_per_client):
                results = learner.train_cohort([_decoded(m.content["arrays"]) for m in msgs], ctxs,
                                               cfg.engine.vectorise_chunk)
        except Exception as exc:  # keep per-client failure semantics: redo them one by one
            log.warning("engine.vectorise: the batched round failed (%s); training clients one by one", exc)
            return {}
        return {m.metadata.message_id: result_reply(m, r, cfg) for m, r in zip(msgs, results)}

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        self._call_timeout = timeout
        try:
            return self.pull_messages(self.push_messages(messages))
        finally:
            self._call_timeout = None

    def call_limit(self) -> float | None:
        """This call's own budget: the client limit, capped by the current ``send_and_receive`` timeout."""
        limits = [x for x in (self.client_timeout, self._call_timeout) if x is not None]
        return min(limits) if self.client_timeout is not None and limits else None

    def _deliver(self, messages: list[Message]) -> dict[str, Message]:
        """The replies to ``messages`` (by message id), their calls run back to back.

        fedsim's own train / evaluate messages call the learner directly
        (:func:`~fedsim.engine.runtime.learner_call`, what its ClientApp runs) and get their replies built
        after the last call (a training reply as a :class:`~fedsim.engine.records.ResultReply`); its set-up
        query is answered as its ClientApp answers it; a foreign ClientApp's messages go through
        ``ClientApp.__call__``.  Same replies either way; the direct way keeps the framework's code out from
        between two clients' training (a 1,000-client round ran each client's training ~10% slower with
        Flower's message handling between them, its caches cold).
        """
        direct = [self.spec is not None and m.metadata.message_type in _DIRECT for m in messages]
        self._prime_seeds([m for m, d in zip(messages, direct) if d and m.metadata.message_type == MessageType.TRAIN])
        cfg = self.spec.cfg if self.spec is not None else None  # parsed once for the round's calls and replies
        configs: dict[int, tuple[Any, dict[str, Any]]] = {}  # round configs read so far (see node_context)
        calls = [self._learner_call(m, cfg, configs) if d else functools.partial(self._call, m)
                 for m, d in zip(messages, direct)]
        outcomes = call_all_with_deadline(calls, self.call_limit(), self.threads)
        replies = {}
        for msg, is_direct, (ok, value) in zip(messages, direct, outcomes):
            if is_direct:
                reply = self._learner_reply(msg, value, cfg) if ok else _failure(msg, value)
            elif ok:
                reply = value
            elif isinstance(value, ClientTimeout):  # abandoned (a learner it was inside is dropped for a fresh one)
                reply = error_reply(msg, str(value))
            else:
                raise value  # not a client's failure (those are error replies already): the engine's own
            replies[msg.metadata.message_id] = reply
        return replies

    def _prime_seeds(self, messages: list[Message]) -> None:
        """Derive the learner's per-client seeds of this round's training calls in one vectorised pass
        (:meth:`~fedsim.contracts.learner.Learner.seed_streams`); best effort, the calls derive any one missed."""
        if len(messages) < _PRIME_MIN or self.spec is None:
            return
        try:
            rounds = {int(m.content["config"]["server-round"]) for m in messages}
            if len(rounds) != 1:
                return
            [server_round] = rounds
            if self._pids is None:
                self._pids = self.partitions()  # node id -> partition id (fixed for the grid's life)
            pids = [self._pids[m.metadata.dst_node_id] for m in messages]
            cfg = self.spec.cfg
            for stream in get_learner(self.spec).seed_streams():
                prime_seeds(cfg.seed, stream, server_round, last=pids)
        except Exception:  # a malformed message: its own call reports it
            return

    def _learner_call(self, msg: Message, cfg: Any,
                      configs: dict[int, tuple[Any, dict[str, Any]]]) -> Callable[[], Any]:
        """The direct call answering ``msg``, prepared here, on the server thread, in one loop over the
        round's messages (its node context, its injected fault), so the worker runs little besides the
        learner; a preparation that fails is raised by the call, as inside the ClientApp."""
        assert self.spec is not None
        context = self.contexts[msg.metadata.dst_node_id]
        try:
            if msg.metadata.message_type == MessageType.QUERY:
                return functools.partial(query_reply, msg, context)
            return learner_call(self.spec, msg, context, msg.metadata.message_type, cfg, configs)
        except Exception as exc:
            return functools.partial(_raise, exc)

    def _learner_reply(self, msg: Message, result: Any, cfg: Any) -> Message:
        """The reply fedsim's ClientApp builds from the learner's result (an error reply if that fails)."""
        try:
            kind = msg.metadata.message_type
            if kind == MessageType.TRAIN:
                return result_reply(msg, result, cfg)
            return evaluate_reply(msg, result) if kind == MessageType.EVALUATE else result
        except Exception as exc:
            return failure_reply(msg, exc)

    def _call(self, msg: Message) -> Message:
        return call_client_app(self.client_app, msg, self.contexts[msg.metadata.dst_node_id])


def server_identity(run_id: int) -> contextlib.AbstractContextManager[None]:
    """Flower's Message constructor reads the task identity that its runtimes normally set."""
    return task_identity(run_id, SUPERLINK_NODE_ID)


@ENGINES.register("local", checkpointing=True,
                  summary="an in-process Flower Grid: no SuperLink, no Ray, no serialisation")
def run_local(spec: RunSpec, observers: list[RoundObserver], **server_kwargs) -> ServerResult:
    grid = InProcessGrid(build_client_app(spec), spec.cfg.num_clients, client_timeout=client_call_limit(spec.cfg),
                         spec=spec, threads=spec.cfg.engine.threads_per_client)
    try:
        with server_identity(run_id=1):
            return run_server(grid, spec, observers, **server_kwargs)
    finally:
        release_hangs()  # abandoned injected hangs end now instead of idling for hang_s
