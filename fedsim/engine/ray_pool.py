"""The ``ray`` engine: fedsim's own pool of long-lived Ray actors behind a Flower ``Grid``.

:class:`RayActorGrid` is the Ray twin of the in-process grid: Flower's strategies and the shared
server loop (:func:`~fedsim.engine.server.run_server`) run unchanged on the driver, and every
message goes to a Ray actor that runs the run's ClientApp.

How it differs from Flower's simulation (``engine.name=flower``):

* **Long-lived actors.**  Each actor builds the ClientApp once and keeps the learner (model and
  data) resident between rounds; an actor is replaced only when it hangs or dies.
* **Contexts on the driver.**  Each node's ``Context`` lives in ``grid.contexts`` and travels with
  each call (the actor sends back the updated ``context.state``), so any actor can serve any
  client and the driver can checkpoint every node's state.
* **Least-loaded dispatch.**  A message goes to the pool actor with the fewest calls in flight
  (ties: the actor that served that node last, then the lowest index).  Calls to one actor queue.
* **Per-client resources.**  ``engine.ray.client_resources`` ({"3": {num_cpus: 2, num_gpus: 0.5}})
  serves those partitions by dedicated actors of that size (one per distinct size, started on
  first use); everyone else is served by the pool of ``engine.ray.num_actors`` actors of
  ``actor_num_cpus`` / ``actor_num_gpus`` each (None: as many as fit, at most one per client).
* **Deadlines.**  The clients of a simulated round conceptually run in parallel, so each call has a
  budget of its own, counted from when it reaches the head of its actor's queue (queueing is the
  pool's business, not the client's): ``min(engine.client_timeout_s, round_timeout_s)``
  (:func:`~fedsim.engine.runtime.client_call_limit`), capped by the ``timeout`` of
  ``send_and_receive``.  The actor enforces it itself (the ClientApp abandons an overrunning call's
  thread and answers ``"timeout: no reply within 5.0s"``), so a hang does not cost an actor restart;
  a call still unanswered ``KILL_GRACE_S`` later (a hang the actor cannot escape) becomes the same
  error reply, its actor is killed and replaced, and the calls queued behind it go to other actors
  and run.  Either way a hanging client costs its own slot only.  A dying actor is replaced the same
  way; its call becomes an error reply.  ``send_and_receive`` returns when every call is answered
  (each one is bounded); with a ``timeout`` <= 0 every call is answered with a timeout at once,
  without running.  Ray's actor-task cancellation, which can stall a queue, is never used.  Client
  exceptions become error replies (code 2), as in every engine.
* **Batches** (``engine.ray.calls_per_task`` > 1).  A round's calls assigned to one actor travel in
  Ray tasks of up to that many calls (``ClientActor.serve_batch``), which the actor runs back to
  back on one worker thread, each within the call's own budget from its own start
  (:func:`~fedsim.engine.runtime.call_all_with_deadline`: an overrun is a timeout reply and the rest
  go on), so a round pays a task round trip per batch, not per call.  The driver gives a batch the
  sum of its calls' budgets (plus ``KILL_GRACE_S``); when a batch's actor dies or overruns that,
  which call was to blame is not known, so each of its calls is sent again alone.
* **Signals and leftovers.**  ``ray.init`` runs with fedsim's signal handlers kept (Ray's own SIGTERM
  handler would end the run FAILED), waits on Ray last at most ``POLL_S``, and a local Ray is watched
  by :mod:`fedsim.engine.reaper`, so its agents do not outlive a driver killed with ``kill -9``.

A cluster: ``engine.ray.address=auto`` (or ``ray://host:port``, or ``$RAY_ADDRESS``) joins a running
Ray instead of starting a local one; every node needs the same Python environment (fedsim and the
dataset caches), since actors import fedsim and build their learner where they run.

Limits: the driver ships a round's global model once (``ray.put``), and replies come back per call or per batch; an
actor (or a replacement) builds its learner before its first call, and the client deadline starts
after that (the start itself may take ``max(round_timeout_s, 300s)``, then the run fails); calls
queued behind a replacement wait for its start; a local Ray is checked before it starts, a
cluster's free resources are not (an actor too big for it fails the run after that start limit).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID

from fedsim import config as C
from fedsim.engine import reaper
from fedsim.engine.driver import DriverGrid, call_client_app, error_reply, task_identity
from fedsim.engine.ray_address import check_cluster, cluster_address, joining
from fedsim.contracts.history import RoundObserver
from fedsim.engine.runtime import (ClientTimeout, RunSpec, build_client_app, call_all_with_deadline, client_call_limit,
                                   warm_learner)
from fedsim.run_lifecycle import signal_handlers_kept
from fedsim.engine.server import ServerResult, run_server
from fedsim.registry import ENGINES
from fedsim.errors import ConfigError, RunFailedError
from fedsim.logs import quiet_third_party

log = logging.getLogger("fedsim")

#: Least time an actor may take to start and build its learner (the round timeout when longer).
START_TIMEOUT_S = 300.0

#: (num_cpus, num_gpus) of an actor.
Size = tuple[float, float]

#: Longest single wait on Ray, so a signal or a deadline is noticed within it.
POLL_S = 1.0

#: Seconds past a call's deadline before the driver kills its actor (the actor's own timeout reply
#: normally comes first).
KILL_GRACE_S = 5.0


# -- scheduling (pure) ----------------------------------------------------------------------------
class LeastLoaded:
    """Least-loaded choice among ``size`` pool slots; load = calls in flight on the slot's actor."""

    def __init__(self, size: int) -> None:
        self.load = [0] * size
        self.last: dict[int, int] = {}  # node id -> slot that served it last

    def assign(self, node_id: int) -> int:
        """The slot for one call of ``node_id`` (ties: its last slot, then the lowest index)."""
        last = self.last.get(node_id)
        slot = min(range(len(self.load)), key=lambda i: (self.load[i], i != last, i))
        self.load[slot] += 1
        self.last[node_id] = slot
        return slot

    def release(self, slot: int) -> None:
        """A call on ``slot`` ended."""
        self.load[slot] = max(0, self.load[slot] - 1)

    def reset(self, slot: int, starting: bool = True) -> None:
        """The slot's actor was replaced; while the new one starts, that start counts as one call."""
        self.load[slot] = 1 if starting else 0


# -- sizing and the preflight check (pure) --------------------------------------------------------
def dedicated_sizes(rc: C.RayEngineConfig) -> dict[int, Size]:
    """Partition id -> size of its dedicated actor (``engine.ray.client_resources``)."""
    return {int(pid): (float(h.num_cpus), float(h.num_gpus)) for pid, h in rc.client_resources.items()}


def pool_size(rc: C.RayEngineConfig, num_clients: int, cpus: float, gpus: float) -> int:
    """Pool actors: ``num_actors``, else as many as fit beside the dedicated ones (<= pooled clients)."""
    if rc.num_actors is not None:
        return rc.num_actors
    dedicated = dedicated_sizes(rc)
    sizes = set(dedicated.values())
    fit = math.floor((cpus - sum(c for c, _ in sizes)) / rc.actor_num_cpus + 1e-9)
    if rc.actor_num_gpus > 0:
        fit = min(fit, math.floor((gpus - sum(g for _, g in sizes)) / rc.actor_num_gpus + 1e-9))
    return max(1, min(fit, num_clients - len(dedicated)))


def check_fit(rc: C.RayEngineConfig, cpus: float, gpus: float) -> None:
    """Raise ConfigError when a local Ray of ``cpus`` CPUs and ``gpus`` GPUs cannot host the actors."""
    pool = (rc.actor_num_cpus, rc.actor_num_gpus)
    actors: list[tuple[str, Size]] = [("engine.ray.actor_num_cpus/actor_num_gpus", pool)]
    actors += [(f"engine.ray.client_resources.{pid}", size) for pid, size in sorted(dedicated_sizes(rc).items())]
    for key, (c, g) in actors:
        if c > cpus:
            raise ConfigError(f"{key}: an actor of {c:g} CPUs exceeds the {cpus:g} CPUs Ray may use; "
                              f"lower it or raise engine.ray.ray_num_cpus")
        if g > 0 and gpus <= 0:
            raise ConfigError(f"{key}: an actor of {g:g} GPUs was requested but no CUDA GPU is visible; "
                              f"set num_gpus to 0")
        if g > gpus:
            raise ConfigError(f"{key}: an actor of {g:g} GPUs exceeds the {gpus:g} GPUs visible; lower it")
    if rc.num_actors is not None:
        sizes = set(dedicated_sizes(rc).values())
        need_c = rc.num_actors * rc.actor_num_cpus + sum(c for c, _ in sizes)
        need_g = rc.num_actors * rc.actor_num_gpus + sum(g for _, g in sizes)
        if need_c > cpus + 1e-9 or need_g > gpus + 1e-9:
            raise ConfigError(f"engine.ray.num_actors={rc.num_actors} actors (plus the dedicated ones) need "
                              f"{need_c:g} CPUs and {need_g:g} GPUs but Ray has {cpus:g} and {gpus:g}; "
                              f"lower engine.ray.num_actors")


def _ray_address(rc: C.RayEngineConfig) -> str | None:
    return cluster_address(rc.address)


def _local_resources(rc: C.RayEngineConfig) -> tuple[float, float]:
    import torch

    return float(rc.ray_num_cpus or os.cpu_count() or 1), float(torch.cuda.device_count())


def check_ray_resources(spec: RunSpec) -> None:
    """Preflight of the ``ray`` engine: hint keys name clients; a local Ray can host every actor."""
    cfg = spec.cfg
    rc = cfg.engine.ray
    bad = [pid for pid in dedicated_sizes(rc) if not 0 <= pid < cfg.num_clients]
    if bad:
        raise ConfigError(f"engine.ray.client_resources: partitions {bad} outside 0..{cfg.num_clients - 1}; drop them")
    if _ray_address(rc) is None:
        check_fit(rc, *_local_resources(rc))
    else:  # a cluster that does not answer: one line now, not minutes of Ray retrying
        check_cluster(rc.address, "engine.ray.address")


# -- the actor ------------------------------------------------------------------------------------
def deliver(app: ClientApp, msg: Message, context: Context) -> Message:
    """Run the ClientApp on one message as its node; an exception becomes an error reply (never raised)."""
    with task_identity(msg.metadata.run_id, msg.metadata.dst_node_id):
        return call_client_app(app, msg, context)


class ClientActor:
    """A long-lived process serving any node: the ClientApp and learner are built once.

    ``client_app`` (picklable) serves the calls instead of the run's learner (``fedsim run-app``:
    a user's Flower ClientApp); then there is no learner to warm up.
    """

    def __init__(self, spec: RunSpec, client_app: ClientApp | None = None) -> None:
        quiet_third_party(spec.cfg.engine.verbose)
        self.spec = spec
        self.own_app = client_app is not None
        self.app = (client_app if client_app is not None
                    else build_client_app(spec, deadline=client_call_limit(spec.cfg)))
        self.plain_app: ClientApp | None = None  # built on the first batch (serve_batch)

    def warm(self) -> int:
        """Build the learner and its data now (``setup_summary`` loads them), before the first call."""
        if not self.own_app:
            warm_learner(self.spec)
        return os.getpid()

    def serve(self, metadata: Any, content: RecordDict, context: Context) -> tuple[Message, RecordDict]:
        """One call: the reply and the node's updated ``context.state``."""
        reply = deliver(self.app, Message(content=content, metadata=metadata), context)
        return reply, context.state

    def serve_batch(self, items: list[tuple[Any, int, Context]], limit: float | None,
                    *contents: RecordDict) -> list[tuple[Message, RecordDict]]:
        """Several calls back to back (``engine.ray.calls_per_task``), each within ``limit`` seconds of
        its own start: ``items`` are (metadata, index into ``contents``, context); per call, the reply
        (a timeout error reply for an overrun, whose worker is abandoned) and the updated state."""
        if self.plain_app is None:  # the run's ClientApp without its per-call deadline: the batch has its own
            self.plain_app = self.app if self.own_app else build_client_app(self.spec)
        if not self.own_app:
            warm_learner(self.spec)
        msgs = [Message(content=contents[i], metadata=meta) for meta, i, _ in items]
        calls = [functools.partial(deliver, self.plain_app, m, ctx) for m, (_, _, ctx) in zip(msgs, items)]
        outcomes = call_all_with_deadline(calls, limit, self.spec.cfg.engine.threads_per_client)
        out = []
        for msg, (_, _, ctx), (ok, value) in zip(msgs, items, outcomes):
            if not ok and not isinstance(value, ClientTimeout):
                raise value  # not a client's failure (those are error replies already)
            if not ok:
                with task_identity(msg.metadata.run_id, msg.metadata.dst_node_id):
                    value = error_reply(msg, str(value))
            out.append((value, ctx.state))
        return out


@cache
def _remote_actor_class() -> Any:
    import ray

    return ray.remote(max_restarts=0, max_concurrency=1)(ClientActor)


# -- the grid -------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Call:
    msg_id: str
    msg: Message
    content_ref: Any  # ObjectRef of msg.content (one per distinct content)
    limit: float  # this call's own budget, from when it reaches the head of its actor's queue
    actor: str = ""
    ref: Any = None  # ObjectRef of the (reply, state) pair, or of its task's list of them
    task: _Task | None = None  # the batch it travels in (engine.ray.calls_per_task > 1), None: alone


@dataclass(eq=False)
class _Task:
    """Calls sent to one actor in one Ray task (``serve_batch``), answered together."""

    calls: list[_Call]
    ref: Any = None

    @property
    def budget(self) -> float:
        """What the batch may take: each call's own budget, back to back."""
        return sum(c.limit for c in self.calls)


@dataclass(eq=False)
class _Actor:
    handle: Any
    size: Size
    warm_ref: Any  # None once the learner is built
    created: float
    replacement: bool = False  # started in place of a killed or lost actor
    queue: deque[_Call] = field(default_factory=deque)
    busy_since: float | None = None  # when the head of the queue started running


class RayActorGrid(DriverGrid):
    """A Grid whose messages are served by long-lived Ray actors (Ray must be initialised).

    ``client_app``: a picklable ClientApp the actors run instead of the run's learner (see :class:`ClientActor`).
    """

    def __init__(self, spec: RunSpec, num_nodes: int | None = None, run_id: int = 1,
                 num_actors: int | None = None, client_app: ClientApp | None = None) -> None:
        import ray

        cfg = spec.cfg
        rc = cfg.engine.ray
        num_nodes = cfg.num_clients if num_nodes is None else num_nodes
        self.spec = spec
        self.client_app = client_app
        self._init_nodes(run_id, num_nodes)
        self.client_limit = client_call_limit(cfg)
        self.start_limit = max(float(cfg.engine.round_timeout_s), START_TIMEOUT_S)
        self._dedicated = {pid + 1: size for pid, size in dedicated_sizes(rc).items()}
        if num_actors is None:
            avail = ray.available_resources()
            num_actors = pool_size(rc, num_nodes, avail.get("CPU", 1.0), avail.get("GPU", 0.0))
        self.pool_keys = [f"pool-{i}" for i in range(num_actors)]
        self.scheduler = LeastLoaded(num_actors)
        self.actors: dict[str, _Actor] = {}
        self.calls_served: dict[str, int] = {}  # actor key -> replies it gave the server (errors included)
        self.replaced = 0  # actors killed or lost, then replaced
        self.calls_per_task = rc.calls_per_task
        self.tasks_sent = 0  # Ray tasks that carried calls (one per call, or one per batch)
        self._pending: dict[str, _Call] = {}
        self._by_ref: dict[Any, _Call | _Task | str] = {}  # call refs -> call, task refs -> task; warm-up refs -> actor key
        self._replies: dict[str, Message] = {}
        try:
            for key in self.pool_keys:
                self._spawn(key, (rc.actor_num_cpus, rc.actor_num_gpus))
            self._await_started(self.pool_keys)
        except BaseException:
            self.close()
            raise

    # -- Grid interface -------------------------------------------------------------------------
    def push_messages(self, messages: Iterable[Message], limit: float | None = None) -> list[str]:
        """Queue the messages on actors; each call may run ``limit`` seconds (None: the client limit)."""
        import ray

        limit = self.client_limit if limit is None else min(limit, self.client_limit)
        shipped: dict[int, Any] = {}  # id(content) -> ObjectRef: a shared payload is put once
        ids = []
        by_actor: dict[str, list[_Call]] = {}  # each actor's calls, in order
        for msg in messages:
            msg_id = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = msg_id
            if id(msg.content) not in shipped:
                shipped[id(msg.content)] = ray.put(msg.content)
            call = _Call(msg_id, msg, shipped[id(msg.content)], limit)
            self._pending[msg_id] = call
            ids.append(msg_id)
            call.actor = self._actor_key(msg.metadata.dst_node_id)
            by_actor.setdefault(call.actor, []).append(call)
        for key, calls in by_actor.items():  # a batch of one is a plain call (calls_per_task=1: all of them)
            for start in range(0, len(calls), self.calls_per_task):
                self._submit_task(key, calls[start : start + self.calls_per_task])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        self._poll(0.0)
        self._expire_overdue(time.monotonic())
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Every reply; each call bounded by its own budget (the client limit, capped by ``timeout``)."""
        messages = list(messages)
        if timeout is not None and timeout <= 0:
            return [error_reply(m, "timeout: the round's deadline passed before this client ran") for m in messages]
        ids = self.push_messages(messages, timeout)
        self._wait_for(ids)
        return [self._replies.pop(i) for i in ids if i in self._replies]

    def close(self) -> None:
        """Kill every actor (idempotent)."""
        import ray

        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        self.actors.clear()
        self._by_ref.clear()

    # -- actors ---------------------------------------------------------------------------------
    def _spawn(self, key: str, size: Size, replacement: bool = False) -> _Actor:
        handle = _remote_actor_class().options(num_cpus=size[0], num_gpus=size[1]).remote(self.spec, self.client_app)
        actor = _Actor(handle, size, handle.warm.remote(), time.monotonic(), replacement)
        self._by_ref[actor.warm_ref] = key
        self.actors[key] = actor
        return actor

    def _await_started(self, keys: list[str]) -> None:
        import ray

        refs = [self.actors[k].warm_ref for k in keys]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.start_limit)
        for ref in ready:
            self._on_warm(ref)
        if len(ready) < len(refs):
            raise RunFailedError(f"only {len(ready)} of {len(refs)} Ray actors started within {self.start_limit:.0f}s; "
                                 f"check engine.ray.num_actors / actor_num_cpus / actor_num_gpus against the cluster")

    def _on_warm(self, ref: Any) -> None:
        import ray

        key = self._by_ref.pop(ref)
        assert isinstance(key, str)
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError:
            pass  # the learner failed to build: each call reports the error itself
        except Exception as exc:
            raise RunFailedError(f"a Ray actor died while starting ({type(exc).__name__}); see the Ray logs") from None
        actor = self.actors[key]
        actor.warm_ref = None
        actor.busy_since = time.monotonic() if actor.queue else None
        if key in self.pool_keys and actor.replacement:
            self.scheduler.release(self.pool_keys.index(key))  # its start-up no longer counts as load

    def _actor_key(self, node_id: int) -> str:
        size = self._dedicated.get(node_id)
        if size is None:
            return self.pool_keys[self.scheduler.assign(node_id)]
        key = f"dedicated-cpu{size[0]:g}-gpu{size[1]:g}"
        if key not in self.actors:
            log.info("ray engine: starting actor %s for partition %d", key, node_id - 1)
            self._spawn(key, size)
        return key

    def _submit(self, call: _Call, key: str | None = None) -> None:
        call.task = None
        call.actor = key if key is not None else self._actor_key(call.msg.metadata.dst_node_id)
        actor = self.actors[call.actor]
        context = self.contexts[call.msg.metadata.dst_node_id]
        call.ref = actor.handle.serve.remote(call.msg.metadata, call.content_ref, context)
        self.tasks_sent += 1
        self._by_ref[call.ref] = call
        if not actor.queue and actor.warm_ref is None:
            actor.busy_since = time.monotonic()
        actor.queue.append(call)

    def _submit_task(self, key: str, calls: list[_Call]) -> None:
        """Queue ``calls`` (already assigned to actor ``key``) on it as one Ray task (alone: as a call)."""
        if len(calls) == 1:
            self._submit(calls[0], key)
            return
        actor = self.actors[key]
        contents: list[Any] = []
        index: dict[int, int] = {}
        items = []
        for call in calls:
            i = index.setdefault(id(call.content_ref), len(contents))
            if i == len(contents):
                contents.append(call.content_ref)
            items.append((call.msg.metadata, i, self.contexts[call.msg.metadata.dst_node_id]))
        task = _Task(calls)
        task.ref = actor.handle.serve_batch.remote(items, calls[0].limit, *contents)
        self.tasks_sent += 1
        self._by_ref[task.ref] = task
        if not actor.queue and actor.warm_ref is None:
            actor.busy_since = time.monotonic()
        for call in calls:
            call.task, call.ref = task, task.ref
            actor.queue.append(call)

    def _replace(self, key: str) -> list[_Call]:
        """Kill ``key``'s actor and start a fresh one; return the calls that were on it."""
        import ray

        old = self.actors[key]
        with contextlib.suppress(Exception):
            ray.kill(old.handle, no_restart=True)
        for call in old.queue:
            self._by_ref.pop(call.ref, None)
        self._by_ref.pop(old.warm_ref, None)
        if key in self.pool_keys:
            self.scheduler.reset(self.pool_keys.index(key))
        self._spawn(key, old.size, replacement=True)
        self.replaced += 1
        log.info("ray engine: replaced actor %s", key)
        return list(old.queue)

    def _lose(self, key: str, reason: str) -> None:
        """The head call of ``key`` failed with ``reason``: reply, replace the actor, resubmit the rest.

        When the head travelled in a batch, which of its calls failed is not known: each call of the
        batch is sent again alone, so the one to blame fails on its own."""
        head, *rest = self._replace(key)
        if head.task is None:
            self._reply(head, error_reply(head.msg, reason))
        else:
            rest.insert(0, head)
        for call in rest:
            if call.msg_id in self._pending:
                self._submit(call)

    # -- replies --------------------------------------------------------------------------------
    def _reply(self, call: _Call, reply: Message) -> None:
        """Give the server its reply to ``call`` (once: a call answered by a timeout stays answered)."""
        if self._pending.pop(call.msg_id, None) is not None:
            self._replies[call.msg_id] = reply
            self.calls_served[call.actor] = self.calls_served.get(call.actor, 0) + 1

    def _dequeue(self, call: _Call) -> None:
        """``call`` left its actor (done or cancelled)."""
        self._by_ref.pop(call.ref, None)
        actor = self.actors[call.actor]
        if call not in actor.queue:
            return
        was_head = actor.queue[0] is call
        actor.queue.remove(call)
        if call.actor in self.pool_keys:
            self.scheduler.release(self.pool_keys.index(call.actor))
        if was_head:
            actor.busy_since = time.monotonic() if actor.queue and actor.warm_ref is None else None

    def _on_done(self, call: _Call) -> None:
        import ray

        try:
            reply, state = ray.get(call.ref)
        except ray.exceptions.RayTaskError as exc:  # e.g. an unpicklable reply
            self._reply(call, error_reply(call.msg, f"ray task failed: {str(exc).splitlines()[0]}"))
            self._dequeue(call)
            return
        except Exception as exc:  # the actor died (crash, OOM kill, lost node)
            self._lose(call.actor, f"actor died: {type(exc).__name__}")
            return
        if call.msg_id in self._pending:  # a late reply (already answered by a timeout) is dropped
            self.contexts[call.msg.metadata.dst_node_id].state = state
            self._reply(call, reply)
        self._dequeue(call)

    def _on_task_done(self, task: _Task) -> None:
        import ray

        try:
            results = ray.get(task.ref)
        except ray.exceptions.RayTaskError:  # e.g. one unpicklable reply: each call again alone, to find it
            for call in task.calls:
                self._dequeue(call)
                if call.msg_id in self._pending:
                    self._submit(call)
            return
        except Exception as exc:  # the actor died (crash, OOM kill, lost node)
            self._lose(task.calls[0].actor, f"actor died: {type(exc).__name__}")
            return
        for call, (reply, state) in zip(task.calls, results, strict=True):
            if call.msg_id in self._pending:
                self.contexts[call.msg.metadata.dst_node_id].state = state
                self._reply(call, reply)
            self._dequeue(call)

    def _poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` for any call or start-up to finish, then handle all that did."""
        import ray

        refs = list(self._by_ref)
        if not refs:
            return
        ready, rest = ray.wait(refs, num_returns=1, timeout=min(max(0.0, timeout), POLL_S))
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in [r for r in ready if isinstance(self._by_ref.get(r), str)]:
            self._on_warm(ref)
        for ref in ready:
            task = self._by_ref.get(ref)
            if isinstance(task, _Task):
                self._on_task_done(task)
        order = {msg_id: i for i, msg_id in enumerate(self._pending)}
        done = [(ref, call) for ref in ready if isinstance(call := self._by_ref.get(ref), _Call)]
        for ref, call in sorted(done, key=lambda rc: order.get(rc[1].msg_id, -1)):
            if ref in self._by_ref:  # not dropped meanwhile (its actor was lost, the call resubmitted)
                self._on_done(call)

    # -- deadlines ------------------------------------------------------------------------------
    def _next_wake(self, now: float) -> float:
        """Seconds until the next start limit or call deadline (a little past it)."""
        wakes = []
        for actor in self.actors.values():
            if actor.warm_ref is not None:
                wakes.append(actor.created + self.start_limit)
            elif actor.busy_since is not None and actor.queue:
                wakes.append(actor.busy_since + _head_budget(actor) + KILL_GRACE_S)
        return max(0.0, min(wakes, default=now + POLL_S) - now) + 0.01

    def _expire_overdue(self, now: float) -> None:
        """Time out each call past its limit (and grace): its actor is killed; fail on an actor that cannot start."""
        for key, actor in list(self.actors.items()):
            if actor.warm_ref is not None and now > actor.created + self.start_limit:
                raise RunFailedError(f"a Ray actor ({key}) did not start within {self.start_limit:.0f}s; "
                                     f"check engine.ray resources against the cluster")
            if not (actor.busy_since is not None and actor.queue):
                continue
            limit = _head_budget(actor)
            if now - actor.busy_since > limit + KILL_GRACE_S:
                self._lose(key, f"timeout: no reply within {limit:.1f}s")

    def _wait_for(self, ids: list[str]) -> None:
        """Until each call of ``ids`` is answered: by its actor, by its deadline, or by its actor's death."""
        while any(i in self._pending for i in ids):
            now = time.monotonic()
            self._expire_overdue(now)
            self._poll(self._next_wake(now))


def _head_budget(actor: _Actor) -> float:
    """What the head of ``actor``'s queue may take: its call's budget, or its batch's."""
    head = actor.queue[0]
    return head.limit if head.task is None else head.task.budget


# -- the engine -----------------------------------------------------------------------------------
def _init_ray(cfg: C.ExperimentConfig) -> bool:
    """Connect to or start Ray, quietly; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    quiet_third_party(cfg.engine.verbose)  # its environment must be set before Ray starts its workers
    rc = cfg.engine.ray
    args: dict[str, Any] = {"log_to_driver": cfg.engine.verbose, "include_dashboard": False,
                            "logging_level": logging.INFO if cfg.engine.verbose else logging.ERROR}
    address = _ray_address(rc)
    if address:
        args["address"] = address
    else:
        args["num_cpus"] = rc.ray_num_cpus or os.cpu_count() or 1
        reaper.ensure_started()  # the agents of a local Ray must not outlive a killed driver
    with signal_handlers_kept(), joining(rc.address, "engine.ray.address"):  # ray.init's own SIGTERM
        ray.init(**args)  # handler would end the run FAILED, not KILLED
    return True


@ENGINES.register("ray", checkpointing=True, preflight=check_ray_resources,
                  summary="fedsim's pool of long-lived Ray actors")
def run_ray(spec: RunSpec, observers: list[RoundObserver], **server_kwargs: Any) -> ServerResult:
    """Run the server loop over a :class:`RayActorGrid`; actors (and a Ray we started) end with it.

    ``server_kwargs`` (checkpoints, resume) go to :func:`~fedsim.engine.server.run_server`.
    """
    import ray

    cfg = spec.cfg
    quiet_third_party(cfg.engine.verbose)
    check_ray_resources(spec)
    started = _init_ray(cfg)
    grid: RayActorGrid | None = None
    try:
        grid = RayActorGrid(spec)
        with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
            return run_server(grid, spec, observers, **server_kwargs)
    finally:
        if grid is not None:
            grid.close()
        if started:
            with contextlib.suppress(Exception):
                ray.shutdown()
