"""How a tracked run ends: FINISHED, FAILED (an exception) or KILLED (Ctrl-C, SIGTERM or SIGHUP).

Shared by the federated runner and the centralised track, so both record the same status and a
SIGTERM (a cluster scheduler, ``kill``) ends the MLflow run as KILLED instead of leaving it RUNNING.

Two helpers keep that promise against third-party code: :func:`signal_handlers_kept` undoes the
SIGTERM handler that ``ray.init`` installs (it calls ``sys.exit``, which would end the run FAILED),
and :func:`exit_soon` ends an interrupted process after a grace period even if a thread that cannot
be stopped (a Flower worker waiting on a hung Ray actor) would block the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

#: Signals that end a run as KILLED (SIGINT arrives as KeyboardInterrupt).
TERMINATING_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)

#: Seconds an interrupted process may take to exit on its own before :func:`exit_soon` ends it.
EXIT_GRACE_S = 5.0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: the run ends as KILLED.

    A KeyboardInterrupt (so a BaseException, which no client handler eats), because native code
    that checks for signals (Ray's ``ray.wait`` / ``ray.get``) passes a KeyboardInterrupt on as an
    interrupt but turns any other exception into a ``SystemError`` (the run would end FAILED).
    """


class FinishableRun(Protocol):
    def finish(self, status: str) -> None: ...


def _install(handler: Any) -> dict[int, Any]:
    """Set ``handler`` for the terminating signals; return the previous handlers ({} off the main thread)."""
    previous: dict[int, Any] = {}
    try:
        for sig in TERMINATING_SIGNALS:
            if sig != signal.SIGTERM and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # e.g. SIGHUP under nohup: the user asked to survive it
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread (e.g. inside a Ray Tune trial)
        pass
    return previous


def _install_sigint(handler: Any) -> dict[int, Any]:
    """Set ``handler`` for Ctrl-C where Python's default (raise KeyboardInterrupt) is in force."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return {}  # ignored, or a caller's own handler: leave it
        return {signal.SIGINT: signal.signal(signal.SIGINT, handler)}
    except ValueError:  # not the main thread
        return {}


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Restore the SIGINT / SIGTERM / SIGHUP handlers after the block (e.g. around ``ray.init``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *TERMINATING_SIGNALS)}
    try:
        yield
    finally:
        _restore(saved)


def exit_soon(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """End the process with ``code`` after ``grace_s`` seconds unless it has exited by then.

    For an interrupted run: the normal exit joins every non-daemon thread, and one blocked on a hung
    client (in a third-party runtime) would keep the process alive for ever.
    """
    def force() -> None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(grace_s, force)
    timer.daemon = True
    timer.start()


def end_interrupted(code: int) -> None:
    """End an interrupted ``fedsim`` process whose run is already recorded: shut Ray down while the
    interpreter is whole, flush, and leave with ``os._exit`` (no interpreter finalisation).

    Finalising the interpreter while Ray's and gRPC's native threads are still unwinding an
    interrupted Flower simulation crashed it now and then (exit -11 after the run was recorded
    KILLED, seen under load in CI); :func:`exit_soon`'s timer still bounds a hanging shutdown.
    """
    ray = sys.modules.get("ray")
    with contextlib.suppress(Exception):
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


#: The interrupt (a :class:`Terminated` or a plain KeyboardInterrupt) that arrived on the main thread
#: inside :func:`interrupts_deferred` and is raised when the outermost such block ends.
_pending: list[BaseException] = []
_defer_depth = 0


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back Ctrl-C, SIGTERM and SIGHUP until the block ends (main thread, inside :func:`tracked_run`).

    For tracking-store writes: an interrupt raised in the middle of one (between SQLAlchemy's
    statement and its commit, or in a pool weakref callback where the interpreter swallows it) can
    leave an sqlite transaction open, and the run's own KILLED update then fails with "database is
    locked" after MLflow's 20 s busy timeout: the run stayed RUNNING (1 of 5 SIGTERMs in a stress
    loop).  Elsewhere (other threads, outside a tracked run) the block changes nothing.
    """
    global _defer_depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
    if _defer_depth == 0 and _pending:
        raise _pending.pop()


def _interrupt(exc: BaseException) -> None:
    """Raise ``exc`` now, or when the enclosing :func:`interrupts_deferred` block ends."""
    if _defer_depth > 0:
        _pending[:] = [exc]
        return
    raise exc


#: Set by the SIGTERM/SIGHUP handler.  The handler also raises, but a signal that lands inside a
#: weakref callback or ``__del__`` has its exception swallowed by the interpreter ("Exception ignored
#: in ..."), so the round loop (:func:`raise_if_terminated`) and the block's end check this flag too.
_terminated = threading.Event()


def raise_if_terminated() -> None:
    """Raise :class:`Terminated` if a SIGTERM/SIGHUP arrived whose exception was lost."""
    if _terminated.is_set():
        raise Terminated()


@contextlib.contextmanager
def swallowed_terminations_quiet() -> Iterator[None]:
    """Keep the interpreter from printing a :class:`Terminated` it swallowed ("Exception ignored in").

    The flag :data:`_terminated` already carries that signal to the round loop, so the printed
    traceback is noise a user would read as a crash; every other unraisable exception still reaches
    the previous ``sys.unraisablehook``.
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Terminated):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def tracked_run(recorder: FinishableRun | None, on_end: Callable[[str], None] | None = None) -> Iterator[None]:
    """Run the block as one run's life and record how it ended.

    SIGTERM and SIGHUP are turned into an interrupt for the block (main thread only). On leaving,
    the recorder is finished with the status and ``on_end(status)`` is called; an interrupt is
    re-raised as :class:`KeyboardInterrupt`, an exception as itself.
    """
    def on_term(signum: int, frame: Any) -> None:
        _terminated.set()
        _interrupt(Terminated())

    def on_int(signum: int, frame: Any) -> None:
        _interrupt(KeyboardInterrupt())

    previous = _install(on_term)
    previous.update(_install_sigint(on_int))
    status = "FAILED"
    with swallowed_terminations_quiet():
        try:
            yield
            raise_if_terminated()
            status = "FINISHED"
        except (KeyboardInterrupt, Terminated):
            status = "KILLED"
            _terminated.clear()
            _pending.clear()
            raise KeyboardInterrupt() from None
        finally:
            try:
                if recorder is not None:
                    recorder.finish(status)
                if on_end is not None:
                    on_end(status)
            finally:
                _restore(previous)
                _pending.clear()
