"""The ``local`` engine: a Flower ``Grid`` that delivers messages to the ClientApp in-process.

No SuperLink, no Ray, no serialisation: Flower's own strategies run unchanged against
:class:`InProcessGrid`, the learner keeps its model and data resident between rounds, and each
node keeps a persistent ``Context`` (so ``context.state`` survives across rounds, as in Flower's
simulation).  Client exceptions become error replies, exactly as Flower's runtimes report them.
"""

from __future__ import annotations

import contextlib
import traceback
import uuid
from collections.abc import Iterable, Iterator

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine.history import RoundObserver
from fedsim.engine.runtime import RunSpec, build_client_app
from fedsim.engine.server import ServerResult, run_server

#: Error code of a ClientApp exception (Flower uses 2 for "ClientApp exception" too).
CLIENT_APP_EXCEPTION = 2


class InProcessGrid(Grid):
    """Synchronous in-process Grid: ``send_and_receive`` runs the ClientApp for each message."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1) -> None:
        self.client_app = client_app
        self._run_id = run_id
        self.contexts: dict[int, Context] = {
            pid + 1: Context(run_id=run_id, node_id=pid + 1,
                             node_config={"partition-id": pid, "num-partitions": num_nodes},
                             state=RecordDict(), run_config={})
            for pid in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}

    def set_run(self, run_id: int) -> None:
        self._run_id = run_id

    @property
    def run(self) -> Run:
        return Run.create_empty(self._run_id)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg_id = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = msg_id
            self._replies[msg_id] = self._deliver(msg)
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _deliver(self, msg: Message) -> Message:
        context = self.contexts[msg.metadata.dst_node_id]
        try:
            return self.client_app(msg, context)
        except Exception as exc:  # a failing client is reported, never raised into the server
            reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            return Message(Error(code=CLIENT_APP_EXCEPTION, reason=reason), reply_to=msg)


@contextlib.contextmanager
def server_identity(run_id: int) -> Iterator[None]:
    """Flower's Message constructor reads the task identity that its runtimes normally set."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def run_local(spec: RunSpec, observers: list[RoundObserver]) -> ServerResult:
    grid = InProcessGrid(build_client_app(spec), spec.cfg.num_clients)
    with server_identity(run_id=1):
        return run_server(grid, spec, observers)
