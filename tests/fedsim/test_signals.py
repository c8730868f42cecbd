"""Every signal ends ``fedsim run`` promptly with the MLflow run KILLED and a non-zero exit.

Each test starts a real ``fedsim run`` whose clients keep hanging (a 1e6 s injected hang, cut by a
2 s client deadline), waits until round 1 is recorded, signals it while it is (most likely) waiting
on a hanging client, and checks the exit code, the time to exit and the run's status in the store.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

FEDSIM = str(Path(sys.executable).with_name("fedsim"))
#: Seconds from the signal to the process's exit (cleanup: finishing the MLflow run, stopping Ray).
EXIT_BOUND_S = 30.0

pytestmark = pytest.mark.slow


def _round_logged(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT 1 FROM metrics WHERE key = 'round/clients_ok' AND step >= 1").fetchone() is not None
    except sqlite3.Error:  # the store is still being created
        return False


def _statuses(db: Path) -> list[str]:
    with sqlite3.connect(db) as con:
        return [row[0] for row in con.execute("SELECT status FROM runs")]


def _stderr(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text(errors="replace")


def _start(tmp_path: Path, engine: str) -> subprocess.Popen:
    cmd = [FEDSIM, "run", "fedavg_digits", "--rounds", "1000", "--quiet", "--engine", engine,
           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "engine.faults.hang_fraction=0.3",
           "engine.faults.hang_s=1e6", "engine.client_timeout_s=2", "engine.flower.ray_num_cpus=2",
           "engine.ray.num_actors=2"]
    # stderr to a file (a pipe nobody reads fills up and blocks the run); SIGINT restored to the
    # default, so the child installs Python's KeyboardInterrupt handler even when the test runner
    # itself was started with SIGINT ignored (a background job)
    with open(tmp_path / "stderr.txt", "w") as err:
        return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _signal_after_round_one(tmp_path: Path, engine: str, sig: int, start_limit_s: float) -> tuple[int, float, str]:
    proc = _start(tmp_path, engine)
    try:
        deadline = time.monotonic() + start_limit_s
        while not _round_logged(tmp_path / "mlflow.db"):
            assert proc.poll() is None, f"the run ended early: {_stderr(tmp_path)}"
            assert time.monotonic() < deadline, "round 1 was not recorded in time"
            time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=EXIT_BOUND_S + 30)
        return proc.returncode, time.monotonic() - sent, _stderr(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(300)
def test_ctrl_c_kills_a_local_run(tmp_path: Path) -> None:
    """SIGINT on the local engine (SIGTERM there goes the same way: tests/fedsim/test_run_lifecycle.py)."""
    code, seconds, stderr = _signal_after_round_one(tmp_path, "local", signal.SIGINT, start_limit_s=150)
    assert code == 130, stderr[-3000:]
    assert seconds < EXIT_BOUND_S
    assert "recorded as KILLED" in stderr and "Traceback" not in stderr
    assert _statuses(tmp_path / "mlflow.db") == ["KILLED"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("engine", ["ray", "flower"])
def test_sigterm_kills_a_ray_or_flower_run(tmp_path: Path, engine: str) -> None:
    """Ray's own SIGTERM handler (installed by ray.init) ended these runs FAILED, a SIGTERM inside
    ``ray.wait`` became a SystemError, and Flower's runtime outlived the run (a worker blocked on a
    hung actor)."""
    code, seconds, stderr = _signal_after_round_one(tmp_path, engine, signal.SIGTERM, start_limit_s=240)
    assert code == 130, stderr[-3000:]
    assert seconds < EXIT_BOUND_S
    assert _statuses(tmp_path / "mlflow.db") == ["KILLED"]
