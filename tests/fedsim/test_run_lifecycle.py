"""How a tracked run ends: the status the recorder gets, the on_end hook, and SIGTERM handling."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fedsim.run_lifecycle import tracked_run


class Recorder:
    def __init__(self) -> None:
        self.statuses: list[str] = []

    def finish(self, status: str) -> None:
        self.statuses.append(status)


def test_success_finishes_and_calls_on_end() -> None:
    rec, ended = Recorder(), []
    with tracked_run(rec, on_end=ended.append):
        pass
    assert rec.statuses == ["FINISHED"] and ended == ["FINISHED"]


def test_exception_fails_the_run_and_propagates() -> None:
    rec, ended = Recorder(), []
    with pytest.raises(ValueError, match="boom"), tracked_run(rec, on_end=ended.append):
        raise ValueError("boom")
    assert rec.statuses == ["FAILED"] and ended == ["FAILED"]


def test_sigterm_kills_the_run_as_an_interrupt_and_restores_the_handler() -> None:
    rec = Recorder()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), tracked_run(rec):
        assert signal.getsignal(signal.SIGTERM) is not before
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this at once
        raise AssertionError("SIGTERM did not interrupt the block")
    assert rec.statuses == ["KILLED"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_kills_the_run_without_a_recorder() -> None:
    ended: list[str] = []
    with pytest.raises(KeyboardInterrupt), tracked_run(None, on_end=ended.append):
        raise KeyboardInterrupt
    assert ended == ["KILLED"]


def test_sighup_kills_the_run_unless_it_is_ignored() -> None:
    rec = Recorder()
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the suite itself may run under nohup
    try:
        with pytest.raises(KeyboardInterrupt), tracked_run(rec):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler interrupts this at once
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert rec.statuses == ["KILLED"]
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with tracked_run(rec):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert rec.statuses == ["KILLED", "FINISHED"]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_swallowed_termination_still_ends_the_run_killed() -> None:
    """A SIGTERM whose exception was lost (raised inside a weakref callback) is honoured at the block's end."""
    from fedsim import run_lifecycle as L

    rec = Recorder()
    with pytest.raises(KeyboardInterrupt), tracked_run(rec):
        L._terminated.set()  # what the handler does before its raise is swallowed
    assert rec.statuses == ["KILLED"] and not L._terminated.is_set()
    with tracked_run(rec):
        pass
    assert rec.statuses == ["KILLED", "FINISHED"]


def test_a_swallowed_termination_prints_no_traceback_but_other_errors_still_reach_the_hook() -> None:
    """The interpreter's "Exception ignored in" report is dropped for Terminated only, and only inside a run."""
    import sys
    import weakref

    from fedsim.run_lifecycle import Terminated

    seen: list[type] = []
    outer = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(type(u.exc_value))
    try:
        class Box:
            pass

        def swallow(exc: BaseException) -> None:
            box = Box()
            ref = weakref.ref(box, lambda _r: (_ for _ in ()).throw(exc))
            del box  # the callback runs now; its exception is unraisable
            assert ref() is None

        rec = Recorder()
        with pytest.raises(KeyboardInterrupt), tracked_run(rec):
            from fedsim import run_lifecycle as L

            swallow(Terminated())
            swallow(ValueError("other"))
            L._terminated.set()
        assert seen == [ValueError]
        swallow(Terminated())  # outside a run the report is not hidden
        assert seen == [ValueError, Terminated]
    finally:
        sys.unraisablehook = outer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupt_inside_a_deferred_block_is_raised_when_the_block_ends(sig: int) -> None:
    from fedsim.run_lifecycle import interrupts_deferred

    rec, steps = Recorder(), []
    with pytest.raises(KeyboardInterrupt), tracked_run(rec):
        with interrupts_deferred():
            os.kill(os.getpid(), sig)
            time.sleep(0.2)  # the handler runs here, but holds the interrupt back
            steps.append("the write finished")
        steps.append("ran on after the block")
    assert steps == ["the write finished"] and rec.statuses == ["KILLED"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_in_the_middle_of_a_store_write_still_ends_the_run_killed(tmp_path) -> None:
    """Ctrl-C landing while sqlite inserts a metric batch (its ``executemany`` checks for signals between
    rows) left the store locked, so the run's KILLED update failed with "database is locked" after
    MLflow's 20 s busy timeout and the run stayed RUNNING (seen in CI)."""
    from mlflow import MlflowClient
    from sqlalchemy import event

    from fedsim.tracking import MlflowRecorder

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rec = MlflowRecorder(uri, "x", "r", {})
    engine = rec.client._tracking_client.store.engine
    batches = {"n": 0}

    def interrupt_the_second_batch_after_its_first_row(cursor, statement, parameters, context) -> bool:
        batches["n"] += 1
        if batches["n"] != 2:
            return False  # sqlite runs this batch itself

        def rows():
            for i, row in enumerate(parameters):
                if i == 1:
                    os.kill(os.getpid(), signal.SIGINT)  # handled inside executemany, as a real Ctrl-C is
                yield row

        cursor.executemany(statement, rows())
        return True

    event.listen(engine, "do_executemany", interrupt_the_second_batch_after_its_first_row)
    try:
        with pytest.raises(KeyboardInterrupt), tracked_run(rec):
            for step in range(5):
                rec.log_metrics({f"m{i}": float(step) for i in range(20)}, step)
    finally:
        event.remove(engine, "do_executemany", interrupt_the_second_batch_after_its_first_row)
    run = MlflowClient(tracking_uri=uri).get_run(rec.run_id)
    assert batches["n"] >= 2 and run.info.status == "KILLED"
    logged = {len(MlflowClient(tracking_uri=uri).get_metric_history(rec.run_id, f"m{i}")) for i in range(20)}
    assert logged == {1}  # the interrupted write finished whole, and nothing ran after it
