"""Several `fedsim run` processes started at once in one fresh directory all record to its store.

Before the store was created under a file lock, they raced through MLflow's migrations: some runs
crashed unrecorded and the half-migrated ``mlflow.db`` failed every later run in that directory.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

RUNS = 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_runs_started_together_in_a_fresh_directory_are_all_recorded(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fedsim", "run", "fedavg", "--rounds", "1", "--clients", "2", "data.name=digits",
           "model.name=mlp", "data.partition.name=iid", "engine.checkpoint=false", "tracking.log_model=false",
           "--quiet"]
    procs = [subprocess.Popen([*cmd, "--seed", str(seed)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for seed in range(RUNS)]
    outputs = [p.communicate(timeout=540)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * RUNS, "\n".join(o[-2000:] for o in outputs)

    from mlflow import MlflowClient

    from fedsim.store import _at_head

    db = tmp_path / "mlflow.db"
    assert _at_head(db)  # fully migrated, no _alembic_tmp_* leftovers
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (exp,) = [e for e in client.search_experiments() if e.name == "fedsim"]
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["seed"] for r in runs) == [str(s) for s in range(RUNS)]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all("eval/accuracy" in r.data.metrics for r in runs)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM experiments WHERE name = 'fedsim'").fetchone() == (1,)
