"""How a tracked run ends: FINISHED, FAILED (an exception) or KILLED (Ctrl-C or SIGTERM).

Shared by the federated runner and the centralised track, so both record the same status and a
SIGTERM (a cluster scheduler, ``kill``) ends the MLflow run as KILLED instead of leaving it RUNNING.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Terminated(BaseException):
    """SIGTERM arrived: the run ends as KILLED (a BaseException, so no client handler eats it)."""


class FinishableRun(Protocol):
    def finish(self, status: str) -> None: ...


@contextlib.contextmanager
def tracked_run(recorder: FinishableRun | None, on_end: Callable[[str], None] | None = None) -> Iterator[None]:
    """Run the block as one run's life and record how it ended.

    SIGTERM is turned into an interrupt for the block (main thread only). On leaving, the recorder
    is finished with the status and ``on_end(status)`` is called; an interrupt is re-raised as
    :class:`KeyboardInterrupt`, an exception as itself.
    """
    def on_term(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread (e.g. inside a Ray Tune trial)
        previous = None
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except (KeyboardInterrupt, Terminated):
        status = "KILLED"
        raise KeyboardInterrupt() from None
    finally:
        try:
            if recorder is not None:
                recorder.finish(status)
            if on_end is not None:
                on_end(status)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
