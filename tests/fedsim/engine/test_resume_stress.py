"""Kill a run anywhere, resume it, and the MLflow run holds exactly the uninterrupted run's history.

Every metric at every step is compared (wall-clock timings by step only), so a round logged twice,
a round missing, or a resumed round that trains differently all fail.  Kills are simulated in
process (an exception at a chosen point: between the checkpoint and the MLflow log, inside the
checkpoint write, during the next round) and done for real (SIGKILL of a ``fedsim run`` subprocess
at a random round, and ``os._exit`` inside the checkpoint write).  All runs share one MLflow store
(creating an sqlite store costs seconds).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fedsim import config as C
from fedsim.cli import main
from fedsim.engine import checkpoint as ckpt
from fedsim.engine import server
from fedsim.runner import run_experiment
from fedsim.tracking import MlflowRecorder

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDS = 4
BASE = ["num_clients=10", "strategy.fraction_train=0.5", "strategy.fraction_evaluate=0.3", "client.local_epochs=1"]
TIMINGS = {"round/seconds", "run/wall_seconds"}  # wall clock: compared by step only
History = dict[str, list]


class Kill(BaseException):
    """Stands for a kill at the point that raises it (no handler in the run catches a BaseException)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("stress")
    return f"sqlite:///{root / 'mlflow.db'}", root


def overrides(seed: int, checkpoints: Path, engine: str = "local") -> list[str]:
    ray = ["engine.ray.num_actors=2", "engine.ray.ray_num_cpus=2"] if engine == "ray" else []
    return [*BASE, f"seed={seed}", f"engine.name={engine}", *ray, f"engine.checkpoint_dir={checkpoints}"]


def load(seed: int, checkpoints: Path, engine: str = "local", *extra: str) -> C.ExperimentConfig:
    return C.load_config("fedavg_digits", [f"rounds={ROUNDS}", *overrides(seed, checkpoints, engine), *extra], {})


def metric_history(uri: str, run_id: str) -> History:
    """Every logged point of the run, by metric: (step, value), or the steps alone for timings."""
    client = MlflowClient(uri)
    out: History = {}
    for key in client.get_run(run_id).data.metrics:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        out[key] = [step for step, _ in points] if key in TIMINGS else points
    return out


_references: dict[tuple[int, bool], History] = {}


def reference(store: tuple[str, Path], seed: int, vectorise: bool = True) -> History:
    """The history of an uninterrupted local run of ``seed`` (one per seed and module).

    The ray engine trains client by client: it is bit-identical to the local engine without the
    vectorised (vmap) training, which differs in the last bits.
    """
    if (seed, vectorise) not in _references:
        uri, root = store
        checkpoints = root / f"ref-{seed}-{vectorise}"
        vectorised = f"engine.vectorise={'auto' if vectorise else 'false'}"
        summary = run_experiment(load(seed, checkpoints, "local", vectorised), tracking_uri=uri)
        _references[seed, vectorise] = metric_history(uri, summary.run_id)
        assert not checkpoints.exists()  # a finished run leaves no (empty) checkpoint root
    return _references[seed, vectorise]


def resume_and_compare(store: tuple[str, Path], seed: int, run_id: str, checkpoints: Path,
                       engine: str = "local") -> None:
    uri, _ = store
    args = ["run", "fedavg_digits", "--rounds", str(ROUNDS), *overrides(seed, checkpoints, engine),
            "--tracking-uri", uri, "--quiet", "--resume", run_id]
    assert main(args) == 0
    history = metric_history(uri, run_id)
    for key, points in history.items():
        steps = points if key in TIMINGS else [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{key} logged twice at a step: {steps}"
    assert history == reference(store, seed, vectorise=engine == "local")
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert not checkpoints.exists()


def killed_run(store: tuple[str, Path], seed: int, checkpoints: Path) -> str:
    """Start a run that a patched point kills; return its MLflow run id."""
    uri, _ = store
    with pytest.raises(Kill):
        run_experiment(load(seed, checkpoints), tracking_uri=uri)
    (run_dir,) = checkpoints.iterdir()
    return run_dir.name


# -- simulated kills, in process ------------------------------------------------------------------
KILL_AT = 2


def kill_before_logging(monkeypatch) -> None:
    """Round KILL_AT is checkpointed but never reaches MLflow."""
    on_round = MlflowRecorder.on_round

    def patched(self, record):
        if record.round == KILL_AT:
            raise Kill()
        on_round(self, record)

    monkeypatch.setattr(MlflowRecorder, "on_round", patched)


def kill_before_meta(monkeypatch) -> None:
    """Round KILL_AT's state file and records are written, its meta.json never replaces the old one."""
    replace = ckpt._replace_meta

    def patched(directory, meta):
        if meta["round"] == KILL_AT:
            raise Kill()
        replace(directory, meta)

    monkeypatch.setattr(ckpt, "_replace_meta", patched)


def kill_before_records(monkeypatch) -> None:
    """Round KILL_AT's state file is written, its records are not."""
    append = ckpt._append_records

    def patched(directory, records, committed):
        if records[-1].round == KILL_AT:
            raise Kill()
        return append(directory, records, committed)

    monkeypatch.setattr(ckpt, "_append_records", patched)


def kill_in_next_round(monkeypatch) -> None:
    """Round KILL_AT is checkpointed and logged; the kill comes while round KILL_AT + 1 trains."""
    play = server.play_round

    def patched(strategy, grid, server_round, *args):
        if server_round == KILL_AT + 1:
            raise Kill()
        return play(strategy, grid, server_round, *args)

    monkeypatch.setattr(server, "play_round", patched)


@pytest.mark.parametrize("kill", [kill_before_logging, kill_before_meta, kill_before_records, kill_in_next_round])
def test_a_kill_at_any_point_of_a_round_logs_every_step_exactly_once(store, tmp_path, monkeypatch, kill) -> None:
    with monkeypatch.context() as patch:
        kill(patch)
        run_id = killed_run(store, 0, tmp_path / "ckpt")
    saved = ckpt.load(tmp_path / "ckpt" / run_id)
    assert saved.round == (KILL_AT if kill in (kill_before_logging, kill_in_next_round) else KILL_AT - 1)
    logged = {m.step for m in MlflowClient(store[0]).get_metric_history(run_id, "eval/accuracy")}
    assert max(logged) == (KILL_AT if kill is kill_in_next_round else KILL_AT - 1)
    resume_and_compare(store, 0, run_id, tmp_path / "ckpt")


def test_resume_of_a_locked_run_is_one_line_and_touches_nothing(store, tmp_path, monkeypatch, capsys) -> None:
    """The lock is per open file: a holder in this process blocks the CLI's resume exactly like another process."""
    with monkeypatch.context() as patch:
        kill_in_next_round(patch)
        run_id = killed_run(store, 0, tmp_path / "ckpt")
    uri = store[0]
    before = metric_history(uri, run_id), MlflowClient(uri).get_run(run_id).info.status
    holder = ckpt.CheckpointDir(tmp_path / "ckpt" / run_id, run_id)
    holder.lock()
    try:
        args = ["run", "fedavg_digits", "--rounds", str(ROUNDS), *overrides(0, tmp_path / "ckpt"),
                "--tracking-uri", uri, "--quiet", "--resume", run_id]
        assert main(args) == 2
    finally:
        holder.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedsim: error: run {run_id} is still running (pid {os.getpid()}); stop it first"]
    assert (metric_history(uri, run_id), MlflowClient(uri).get_run(run_id).info.status) == before
    resume_and_compare(store, 0, run_id, tmp_path / "ckpt")  # once the holder is gone, it resumes


# -- real kills of a `fedsim run` process ---------------------------------------------------------
def committed_round(checkpoints: Path) -> tuple[int, Path | None]:
    metas = list(checkpoints.glob(f"*/{ckpt.META}"))
    if not metas:
        return -1, None
    return json.loads(metas[0].read_text())["round"], metas[0].parent


def start_run(store: tuple[str, Path], seed: int, checkpoints: Path, engine: str = "local",
              bootstrap: str | None = None) -> subprocess.Popen:
    uri, root = store
    args = ["run", "fedavg_digits", "--rounds", str(ROUNDS), *overrides(seed, checkpoints, engine),
            "--tracking-uri", uri, "--quiet"]
    command = [sys.executable, "-c", bootstrap, *args] if bootstrap else [sys.executable, "-m", "fedsim", *args]
    return subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def sigkill_at_round(proc: subprocess.Popen, checkpoints: Path, at: int, deadline_s: float = 300) -> str:
    """SIGKILL ``proc`` once its checkpoint reaches round ``at``; first check that it holds the run's lock."""
    deadline = time.monotonic() + deadline_s
    done, run_dir = -1, None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done, run_dir = committed_round(checkpoints)
            if done >= at:
                with pytest.raises(C.ConfigError, match=rf"still running \(pid {proc.pid}\)"):
                    ckpt.CheckpointDir(run_dir, run_dir.name).lock()
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        with_leftovers_killed(proc)
    assert proc.returncode == -signal.SIGKILL and done >= at, "the run ended before it was killed"
    assert done < ROUNDS and run_dir is not None
    return run_dir.name


def kill_round(seed: int) -> int:
    """A random round in 1..ROUNDS-1 drawn from ``seed`` (seeds 1, 2, 5 give rounds 1, 3, 2)."""
    return 1 + int(random.Random(seed).random() * (ROUNDS - 1))


def with_leftovers_killed(proc: subprocess.Popen) -> None:
    """Kill what the dead run left in its session (Ray's processes), so they do not load the machine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_random_round_then_resume_is_identical(store, tmp_path, seed) -> None:
    proc = start_run(store, seed, tmp_path / "ckpt")
    run_id = sigkill_at_round(proc, tmp_path / "ckpt", kill_round(seed))
    assert MlflowClient(store[0]).get_run(run_id).info.status == "RUNNING"  # kill -9: nobody closed it
    resume_and_compare(store, seed, run_id, tmp_path / "ckpt")


EXIT_IN_SAVE = """
import os, sys
from fedsim.engine import checkpoint as ckpt
replace = ckpt._replace_meta
def replace_or_die(directory, meta):
    if meta["round"] == int(os.environ["FEDSIM_TEST_DIE_AT"]):
        os._exit(137)  # after the state file and the records append, before the commit
    replace(directory, meta)
ckpt._replace_meta = replace_or_die
from fedsim.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_process_dying_inside_the_checkpoint_write_resumes_identically(store, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_TEST_DIE_AT", "3")
    proc = start_run(store, 0, tmp_path / "ckpt", bootstrap=EXIT_IN_SAVE)
    assert proc.wait(timeout=300) == 137
    done, run_dir = committed_round(tmp_path / "ckpt")
    assert done == 2
    lines = (run_dir / ckpt.RECORDS).read_bytes().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2, 3]  # round 3 appended, not committed
    resume_and_compare(store, 0, run_dir.name, tmp_path / "ckpt")


@pytest.mark.slow
def test_sigkill_of_a_ray_engine_run_then_resume_is_identical(store, tmp_path) -> None:
    """The ray engine is bit-identical to the local one, so the local reference holds for it too."""
    proc = start_run(store, 5, tmp_path / "ckpt", engine="ray")
    run_id = sigkill_at_round(proc, tmp_path / "ckpt", kill_round(5))
    resume_and_compare(store, 5, run_id, tmp_path / "ckpt", engine="ray")
