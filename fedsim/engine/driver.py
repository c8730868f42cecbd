"""What the in-process and Ray engines share: a driver-side Flower ``Grid`` and client-reply helpers.

Both engines keep every node's ``Context`` on the driver (so ``context.state`` survives across
rounds and can be checkpointed), create messages the way Flower's runtimes do, and turn a client
exception into an error reply exactly as Flower reports it, never raising it into the server.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine.runtime import ClientTimeout

#: Flower's error code for an exception raised inside a ClientApp.
CLIENT_APP_EXCEPTION = 2


@contextlib.contextmanager
def task_identity(run_id: int, node_id: int) -> Iterator[None]:
    """Set Flower's task identity (read by the Message constructor) for a block."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, node_id
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def error_reply(msg: Message, reason: str) -> Message:
    """The error reply Flower's runtimes give for a failed client call."""
    return Message(Error(code=CLIENT_APP_EXCEPTION, reason=reason), reply_to=msg)


def failure_reply(msg: Message, exc: Exception) -> Message:
    """The error reply of a client call that raised ``exc`` (a timeout is worded as every engine words it)."""
    if isinstance(exc, ClientTimeout):
        return error_reply(msg, str(exc))
    return error_reply(msg, "".join(traceback.format_exception_only(type(exc), exc)).strip())


def call_client_app(app: ClientApp, msg: Message, context: Context) -> Message:
    """Run the ClientApp on one message; an exception becomes an error reply (never raised)."""
    try:
        return app(msg, context)
    except Exception as exc:  # a failing client is reported, never raised into the server
        return failure_reply(msg, exc)


class DriverGrid(Grid):
    """A Grid whose nodes' Contexts live on the driver; subclasses deliver the messages."""

    def _init_nodes(self, run_id: int, num_nodes: int) -> None:
        self._run_id = run_id
        self.contexts: dict[int, Context] = {
            pid + 1: Context(run_id=run_id, node_id=pid + 1,
                             node_config={"partition-id": pid, "num-partitions": num_nodes},
                             state=RecordDict(), run_config={})
            for pid in range(num_nodes)
        }

    def set_run(self, run_id: int) -> None:
        self._run_id = run_id

    @property
    def run(self) -> Run:
        return Run.create_empty(self._run_id)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def partitions(self) -> dict[int, int]:
        """node id -> partition id: what fedsim's ClientApp answers to the set-up query, from the contexts."""
        return {node: int(ctx.node_config["partition-id"]) for node, ctx in self.contexts.items()}
