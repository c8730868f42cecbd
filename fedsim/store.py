"""The MLflow store, made safe to share: checked before a run starts, created once, raced safely.

* :func:`check_tracking_uri` fails fast, on one line, for a store that cannot work: an sqlite or
  file store in a missing or read-only directory, an http(s) server that does not answer a TCP
  connect within a few seconds (MLflow itself would retry for minutes).
* :func:`prepare_store` creates or migrates an sqlite store exactly once across processes, under an
  ``fcntl.flock`` on ``<db>.lock`` beside the database, before any other ``MlflowClient`` in this
  process touches it.  Concurrent ``fedsim run`` processes in one fresh directory used to race
  through MLflow's Alembic migrations and leave the database half-migrated for good.
* A store left half-migrated by such a race (a leftover ``_alembic_tmp_<table>`` next to its
  ``<table>``) is repaired under the lock: the leftover is only a partial copy of the table, so it
  is dropped and the migration is run again.  Any migration is done on a backup copy's watch: if it
  fails, the database is put back byte for byte and the user gets one line saying what to do.
* :func:`get_or_create_experiment` survives two processes creating the same experiment at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sqlite3
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedsim.errors import FedsimError

#: Seconds the http(s) reachability probe waits for a TCP connect.
PROBE_TIMEOUT_S = 3.0
#: Seconds a process waits for another one to finish creating or migrating the store.
LOCK_TIMEOUT_S = 300.0
_TMP_PREFIX = "_alembic_tmp_"
_prepared: set[str] = set()
_prepared_lock = threading.Lock()


# -- where a URI points ----------------------------------------------------------------------------
def sqlite_path(uri: str) -> Path | None:
    """The database file of an ``sqlite:///`` URI (None for other URIs and in-memory databases)."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):]
    if not rest.startswith("///"):
        return None
    path = rest[3:].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path).expanduser().resolve()


def file_store_path(uri: str) -> Path | None:
    """The root folder of a file store (``file:///...`` or a plain path); None for other URIs."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path)).expanduser().resolve()
    if parsed.scheme == "":
        return Path(uri).expanduser().resolve()
    return None


def redact(uri: str) -> str:
    """``uri`` without a password or token in its user-info part, for notices and errors."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.username is None and parsed.password is None:
        return uri
    host = parsed.hostname or ""
    netloc = f"***@{host}" + (f":{parsed.port}" if parsed.port else "")
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


# -- the fast check before anything starts ---------------------------------------------------------
def check_tracking_uri(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise a one-line :class:`FedsimError` if the store at ``uri`` cannot be written or reached."""
    db = sqlite_path(uri)
    if db is not None:
        _check_sqlite(db, uri)
        return
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("http", "https"):
        _probe_http(uri, timeout)
        return
    root = file_store_path(uri)
    if root is not None:
        _check_file_store(root, uri)


_FIX = "pick a writable place with --tracking-uri or $MLFLOW_TRACKING_URI"


def _check_sqlite(db: Path, uri: str) -> None:
    """The database's folder exists and takes new files (sqlite's journal, the lock); the file is writable."""
    if not db.parent.is_dir():
        raise FedsimError(f"tracking store {uri}: the folder {db.parent} does not exist; create it or {_FIX}")
    if not _can_create_in(db.parent):
        raise FedsimError(f"tracking store {uri}: the folder {db.parent} is not writable; {_FIX}")
    if db.exists():
        try:
            with open(db, "r+b"):
                pass
        except OSError:
            raise FedsimError(f"tracking store {uri}: {db} is not a readable and writable file; {_FIX}") from None


def _check_file_store(root: Path, uri: str) -> None:
    """A file store's folder is writable, or can be created."""
    if root.exists():
        if not root.is_dir() or not _can_create_in(root):
            raise FedsimError(f"tracking store {uri}: {root} is not a writable folder; {_FIX}")
        return
    parent = next((p for p in root.parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not _can_create_in(parent):
        raise FedsimError(f"tracking store {uri}: cannot create {root} (no writable folder above it); {_FIX}")


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (tried for real: modes, ACLs and read-only mounts)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".fedsim-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _probe_http(uri: str, timeout: float) -> None:
    """One TCP connect to the server (or to the proxy that requests would use), nothing sent."""
    parsed = urllib.parse.urlsplit(uri)
    host = parsed.hostname
    if not host:
        raise FedsimError(f"tracking URI {redact(uri)} has no host; give e.g. http://127.0.0.1:5000")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise FedsimError(f"tracking URI {redact(uri)} has an invalid port") from None
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(parsed.scheme)
    if proxy:
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or host, p.port or 80
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        via = f" (via proxy {host}:{port})" if proxy else ""
        raise FedsimError(f"tracking server {redact(uri)} is not reachable{via}: {reason}; start it, or pick "
                          f"another store with --tracking-uri or $MLFLOW_TRACKING_URI") from None


# -- one-time creation / migration under a file lock -----------------------------------------------
@contextlib.contextmanager
def store_lock(db: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive inter-process lock on ``<db>.lock`` (threads of one process exclude each other too)."""
    import time

    path = db.with_name(db.name + ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise FedsimError(f"cannot create the store lock {path} ({exc.strerror or exc}); {_FIX}") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FedsimError(f"another process has been creating or migrating the MLflow store {db} for "
                                      f"over {timeout:.0f} s (it holds {path}); wait for it to finish, or "
                                      f"pass --tracking-uri") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def prepare_store(uri: str) -> None:
    """Make the store at ``uri`` ready (created, migrated) exactly once across processes.

    A no-op for non-sqlite stores and for stores this process already prepared.  Must run before
    the first ``MlflowClient`` of this process opens an sqlite store (MLflow migrates on open).
    """
    db = sqlite_path(uri)
    if db is None:
        return
    with _prepared_lock:
        if uri in _prepared:
            return
        with store_lock(db):
            _prepare_locked(db, uri)
        _prepared.add(uri)


def _prepare_locked(db: Path, uri: str) -> None:
    """Under the lock: repair a race's leftovers, then let MLflow create/migrate, with a backup."""
    from mlflow import MlflowClient

    backup, fresh = None, False
    try:
        fresh = not _has_tables(db)
        if not fresh and not _at_head(db):
            backup = db.with_name(db.name + ".backup")
            _copy_db(db, backup)
        _drop_partial_copies(db)
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # opens (creates, migrates) the store
    except Exception as exc:  # noqa: BLE001 - any failure is reported on one line, the store put back
        _dispose_engine(uri)
        if backup is not None:
            _restore_db(backup, db)
        elif fresh and not _has_runs(db):
            db.unlink(missing_ok=True)  # a store we were creating, still empty: the next run starts it afresh
        kept = f"; it is unchanged (a copy is in {backup})" if backup is not None else ""
        raise FedsimError(f"cannot open the MLflow store {db}: {_first_line(exc)}{kept}; move it aside "
                          f"(mv {db} {db}.old) to start a new store, or pass --tracking-uri") from None
    if backup is not None:
        backup.unlink(missing_ok=True)


def _has_tables(db: Path) -> bool:
    if not db.exists() or db.stat().st_size == 0:
        return False
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        return bool(conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' LIMIT 1").fetchall())


def _has_runs(db: Path) -> bool:
    """Whether ``db`` holds any run (True when that cannot be read: then it is not ours to delete)."""
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
            return bool(conn.execute("SELECT 1 FROM runs LIMIT 1").fetchall())
    except sqlite3.OperationalError as exc:
        return "no such table" not in str(exc)
    except sqlite3.Error:
        return True


def _at_head(db: Path) -> bool:
    """Whether the store is at this MLflow's schema head with no migration leftovers."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "alembic_version" not in tables or any(t.startswith(_TMP_PREFIX) for t in tables):
            return False
        revs = [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]
    return revs == [_get_latest_schema_revision()]


def _drop_partial_copies(db: Path) -> list[str]:
    """Drop ``_alembic_tmp_<t>`` tables whose ``<t>`` still exists (Alembic drops ``<t>`` only after
    the copy is complete, so while ``<t>`` exists the leftover holds nothing that ``<t>`` lacks)."""
    if not db.exists():
        return []
    dropped = []
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for tmp in sorted(t for t in tables if t.startswith(_TMP_PREFIX)):
            if tmp[len(_TMP_PREFIX):] in tables:
                conn.execute(f'DROP TABLE "{tmp}"')
                dropped.append(tmp)
        conn.commit()
    return dropped


def _copy_db(src: Path, dst: Path) -> None:
    """A byte-exact copy of an sqlite database, taken under a read transaction so no writer commits meanwhile."""
    with contextlib.closing(sqlite3.connect(src, timeout=30, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()  # holds sqlite's SHARED lock
        shutil.copyfile(src, dst)
        conn.execute("ROLLBACK")


def _restore_db(backup: Path, db: Path) -> None:
    """Put ``db`` back as ``backup`` (in place), dropping the failed attempt's rollback journal."""
    shutil.copyfile(backup, db)
    db.with_name(db.name + "-journal").unlink(missing_ok=True)


def _dispose_engine(uri: str) -> None:
    """Close MLflow's cached connections to ``uri`` before its file is replaced."""
    with contextlib.suppress(Exception):
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        engine = SqlAlchemyStore._engine_map.pop(uri, None)
        if engine is not None:
            engine.dispose()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# -- race-safe experiment creation -----------------------------------------------------------------
#: The experiment tag MLflow 3's UI reads to choose its view: "custom_model_development" opens the
#: runs table (the ML view), where an untagged experiment may open on the GenAI "Traces" view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
ML_EXPERIMENT_KIND = "custom_model_development"


def get_or_create_experiment(client: Any, name: str) -> str:
    """The id of experiment ``name``, created if missing (as an ML experiment, see
    :data:`EXPERIMENT_KIND_TAG`); safe when another process creates it too.  An experiment of an
    older store that lacks the kind tag gets it."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: ML_EXPERIMENT_KIND})
        except MlflowException:
            exp = client.get_experiment_by_name(name)  # created by another process meanwhile
            if exp is None:
                raise
    if EXPERIMENT_KIND_TAG not in (exp.tags or {}):
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, ML_EXPERIMENT_KIND)
    return exp.experiment_id


__all__ = ["check_tracking_uri", "prepare_store", "store_lock", "get_or_create_experiment", "sqlite_path",
           "redact"]
