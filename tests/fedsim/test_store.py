"""fedsim.store: an sqlite MLflow store is created once under a file lock, repaired or refused
safely when half-migrated, and experiment creation survives a race."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from fedsim.errors import FedsimError
from fedsim.store import get_or_create_experiment, prepare_store, store_lock

#: The MLflow revision just before the migration that rebuilds ``latest_metrics`` (the one concurrent
#: runs broke: ``table _alembic_tmp_latest_metrics already exists``).
BEFORE_LATEST_METRICS_REBUILD = "a8c4a736bde6"


def _tables(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _revision(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]


def _head() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def _prepare_and_create(uri: str, name: str) -> str:
    """In a forked process: prepare the store and get-or-create one experiment; returns its id."""
    from mlflow import MlflowClient

    prepare_store(uri)
    return get_or_create_experiment(MlflowClient(tracking_uri=uri), name)


def test_processes_initialising_a_fresh_store_at_once_all_succeed(tmp_path) -> None:
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'warm.db'}")  # MLflow's lazy imports done before the fork
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        ids = pool.starmap(_prepare_and_create, [(uri, "shared")] * 4, chunksize=1)
    assert len(set(ids)) == 1  # one experiment, whoever created it
    assert _revision(db) == [_head()]
    assert not any(t.startswith("_alembic_tmp_") for t in _tables(db))
    with sqlite3.connect(db) as conn:
        names = sorted(r[0] for r in conn.execute("SELECT name FROM experiments"))
    assert names == ["Default", "shared"]


def test_store_lock_excludes_another_holder(tmp_path) -> None:
    db = tmp_path / "mlflow.db"
    fd = os.open(tmp_path / "mlflow.db.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process's hold (flock: a separate open file excludes too)
    try:
        with pytest.raises(FedsimError, match="another process has been creating or migrating"):
            with store_lock(db, timeout=0.3):
                pass
    finally:
        os.close(fd)
    with store_lock(db, timeout=0.3):  # released: free again
        pass


def test_experiment_created_meanwhile_by_another_process_is_read_back() -> None:
    from mlflow.exceptions import MlflowException

    class Racing:
        """``get`` misses, then ``create`` loses the race: the experiment now exists."""

        def __init__(self) -> None:
            self.calls = 0

        def get_experiment_by_name(self, name: str):
            self.calls += 1
            return None if self.calls == 1 else type("E", (), {"experiment_id": "42",
                                                               "tags": {"mlflow.experimentKind": "x"}})()

        def create_experiment(self, name: str, tags=None) -> str:
            raise MlflowException("RESOURCE_ALREADY_EXISTS: experiment exists")

    assert get_or_create_experiment(Racing(), "x") == "42"


def test_experiments_are_ml_experiments_and_old_ones_are_tagged(tmp_path) -> None:
    """MLflow 3's UI opens an experiment tagged custom_model_development on its runs table."""
    from fedsim.store import EXPERIMENT_KIND_TAG, ML_EXPERIMENT_KIND
    from fedsim.tracking import mlflow_client

    client = mlflow_client(f"sqlite:///{tmp_path / 'm.db'}")
    new = get_or_create_experiment(client, "new")
    assert client.get_experiment(new).tags[EXPERIMENT_KIND_TAG] == ML_EXPERIMENT_KIND
    old = client.create_experiment("old")  # as an earlier fedsim created it
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    assert get_or_create_experiment(client, "old") == old
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == ML_EXPERIMENT_KIND


def _half_migrated_store(db: Path) -> None:
    """A store as a race left it: at the revision before the ``latest_metrics`` rebuild, with the
    rebuild's partial copy ``_alembic_tmp_latest_metrics`` left behind, and a user's run in it."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    uri = f"sqlite:///{db}"
    engine = sqlalchemy.create_engine(uri)
    InitialBase.metadata.create_all(engine)
    config = _get_alembic_config(uri)
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, BEFORE_LATEST_METRICS_REBUILD)
    engine.dispose()
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO experiments VALUES (7, 'mine', '/tmp/art', 'active')")
        conn.execute("INSERT INTO runs (run_uuid, name, user_id, status, start_time, lifecycle_stage, artifact_uri, "
                     "experiment_id, source_type) VALUES ('r1', 'old run', 'me', 'FINISHED', 1, 'active', '/tmp/art', 7, "
                     "'LOCAL')")
        conn.execute("INSERT INTO latest_metrics VALUES ('acc', 0.75, 1, 3, 0, 'r1')")
        conn.execute("INSERT INTO metrics VALUES ('acc', 0.75, 1, 'r1', 3, 0)")
        conn.execute("CREATE TABLE _alembic_tmp_latest_metrics AS SELECT * FROM latest_metrics")


def test_half_migrated_store_is_repaired_with_its_history(tmp_path) -> None:
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    _half_migrated_store(db)
    control = tmp_path / "control.db"
    shutil.copy(db, control)
    with pytest.raises(Exception, match="_alembic_tmp_latest_metrics already exists"):
        MlflowClient(tracking_uri=f"sqlite:///{control}")  # what every later run hit before the repair

    uri = f"sqlite:///{db}"
    prepare_store(uri)
    assert _revision(db) == [_head()]
    assert not any(t.startswith("_alembic_tmp_") for t in _tables(db))
    assert not (tmp_path / "mlflow.db.backup").exists()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run("r1")  # the user's history survived the repair
    assert run.info.run_name == "old run" and run.info.status == "FINISHED"
    assert run.data.metrics == {"acc": 0.75}
    assert [(m.step, m.value) for m in client.get_metric_history("r1", "acc")] == [(3, 0.75)]
    assert client.get_experiment_by_name("mine").experiment_id == "7"


def test_store_that_cannot_be_migrated_is_left_unchanged_with_one_line(tmp_path) -> None:
    db = tmp_path / "mlflow.db"
    _half_migrated_store(db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0badc0ffee00'")  # no such revision
    before = db.read_bytes()
    with pytest.raises(FedsimError) as err:
        prepare_store(f"sqlite:///{db}")
    message = str(err.value)
    assert "\n" not in message and "move it aside" in message and "unchanged" in message
    assert db.read_bytes() == before  # put back byte for byte, history intact
    assert (tmp_path / "mlflow.db.backup").read_bytes() == before


def test_a_file_that_is_not_a_database_gives_one_line_and_is_kept(tmp_path) -> None:
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a database, but someone's file" * 100)
    with pytest.raises(FedsimError, match="cannot open the MLflow store") as err:
        prepare_store(f"sqlite:///{db}")
    assert "\n" not in str(err.value)
    assert db.read_bytes() == b"not a database, but someone's file" * 100
