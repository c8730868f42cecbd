"""Which store a run records to, the fast check of that store, and no temp-dir litter.

Precedence: ``--tracking-uri`` > ``$MLFLOW_TRACKING_URI`` > the experiment file's ``tracking.uri``
> ``sqlite:///mlflow.db`` in the cwd, with a notice when a file's URI is overridden or a file's
server URI is used.  An unwritable or unreachable store fails in seconds with one line, before any
run exists.  Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.config import EXPERIMENTS_DIR
from fedsim.errors import FedsimError
from fedsim.store import check_tracking_uri, redact
from fedsim.tracking import resolve_tracking_uri

#: The cheapest real federated run: 2 clients, 1 round, an MLP on sklearn digits.
TINY = ["fedavg", "--rounds", "1", "--clients", "2", "data.name=digits", "model.name=mlp",
        "data.partition.name=iid", "--quiet"]


def closed_port() -> int:
    """A 127.0.0.1 port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").touch()
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A folder this user cannot create files in (root ignores modes: then sysfs, which refuses root)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    found = next((d for d in (ro, Path("/sys")) if d.is_dir() and not _writable(d)), None)
    try:
        if found is None:
            pytest.skip("no read-only folder available to this user")
        yield found
    finally:
        ro.chmod(0o755)


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch) -> None:
    """Notices are printed once per process: start each test with none printed yet."""
    import fedsim.tracking

    monkeypatch.setattr(fedsim.tracking, "_noticed", set())


# -- precedence ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, env, config, expected", [
    ("sqlite:////f/flag.db", "sqlite:////e/env.db", "sqlite:////c/file.db", "sqlite:////f/flag.db"),
    (None, "sqlite:////e/env.db", "http://127.0.0.1:1", "sqlite:////e/env.db"),
    (None, None, "sqlite:////c/file.db", "sqlite:////c/file.db"),
    (None, None, None, "cwd"),
])
def test_flag_beats_environment_beats_file_beats_default(flag, env, config, expected, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    if env:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
    want = f"sqlite:///{tmp_path / 'mlflow.db'}" if expected == "cwd" else expected
    assert resolve_tracking_uri(flag, config) == want


def test_a_files_uri_overridden_by_the_environment_is_noticed_without_its_secret(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/mine.db")
    assert resolve_tracking_uri(None, "https://user:s3cret-token@127.0.0.1:8443/") == "sqlite:////tmp/mine.db"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: note: ")
    assert "overridden by $MLFLOW_TRACKING_URI" in err and "sqlite:////tmp/mine.db" in err
    assert "s3cret-token" not in err and "***@127.0.0.1:8443" in err
    resolve_tracking_uri(None, "https://user:s3cret-token@127.0.0.1:8443/")  # e.g. the next child of a claim check
    assert capsys.readouterr().err == ""  # said once per process


def test_a_files_server_uri_that_is_used_is_noticed(capsys) -> None:
    assert resolve_tracking_uri(None, "http://127.0.0.1:5999") == "http://127.0.0.1:5999"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recording to http://127.0.0.1:5999" in err and "tracking.uri" in err


def test_no_notice_for_a_files_local_store_or_for_no_file_uri(capsys, tmp_path) -> None:
    resolve_tracking_uri(None, f"sqlite:///{tmp_path / 'a.db'}")
    resolve_tracking_uri(f"sqlite:///{tmp_path / 'b.db'}", None)
    resolve_tracking_uri(None, None)
    assert capsys.readouterr().err == ""


def test_a_bare_db_path_is_an_sqlite_store(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri("runs.db") == f"sqlite:///{tmp_path / 'runs.db'}"


def test_redact_hides_user_info_only() -> None:
    assert redact("https://u:p@127.0.0.1:5000/x") == "https://***@127.0.0.1:5000/x"
    assert redact("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


# -- the fast check --------------------------------------------------------------------------------
def test_closed_port_fails_fast_with_one_line() -> None:
    start = time.monotonic()
    with pytest.raises(FedsimError, match="not reachable") as err:
        check_tracking_uri(f"http://127.0.0.1:{closed_port()}")
    assert time.monotonic() - start < 5 and "\n" not in str(err.value)


def test_a_listening_server_passes_the_check() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        check_tracking_uri(f"http://127.0.0.1:{server.getsockname()[1]}")


def test_sqlite_store_in_a_missing_or_read_only_folder_is_refused(tmp_path, read_only_dir) -> None:
    with pytest.raises(FedsimError, match="does not exist"):
        check_tracking_uri(f"sqlite:///{tmp_path / 'nope' / 'mlflow.db'}")
    with pytest.raises(FedsimError, match="not writable"):
        check_tracking_uri(f"sqlite:///{read_only_dir / 'mlflow.db'}")
    with pytest.raises(FedsimError, match="not a writable folder"):
        check_tracking_uri(f"file://{read_only_dir}")
    check_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # a writable folder passes
    assert sorted(os.listdir(tmp_path)) == ["ro"]  # and the check leaves nothing behind


@pytest.mark.parametrize("argv", [
    ["run", *TINY],
    ["reproduce", "fedphoenix_quick", "--seeds", "1"],
    ["sweep", "fedavg", "--grid", "seed=1,2", "--seeds", "1"],
    ["compare", "0123456789abcdef0123456789abcdef"],
], ids=["run", "reproduce", "sweep", "compare"])
def test_unreachable_tracking_server_is_one_line_exit_2_and_nothing_recorded(argv, in_tmp, capsys) -> None:
    start = time.monotonic()
    assert main([*argv, "--tracking-uri", f"http://127.0.0.1:{closed_port()}"]) == 2
    assert time.monotonic() - start < 20  # MLflow's own retries took > 150 s
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: error: tracking server http://127.0.0.1:")
    assert sorted(os.listdir(in_tmp)) == []  # no store, no checkpoint folder, no sweep folder


def test_a_files_unreachable_server_is_one_line_exit_2_without_the_notice(in_tmp, capsys) -> None:
    exp = in_tmp / "downloaded.yaml"
    exp.write_text((EXPERIMENTS_DIR / "fedavg_digits.yaml").read_text()
                   + f"tracking:\n  uri: http://127.0.0.1:{closed_port()}\n")
    assert main(["run", str(exp), "--rounds", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: error: tracking server http://127.0.0.1:")
    assert sorted(os.listdir(in_tmp)) == ["downloaded.yaml"]


def test_read_only_store_folder_is_one_line_exit_2(in_tmp, read_only_dir, capsys) -> None:
    assert main(["run", *TINY, "--tracking-uri", f"sqlite:///{read_only_dir / 'mlflow.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not writable" in err and "Traceback" not in err
    assert [p for p in os.listdir(in_tmp) if p != "ro"] == []  # no store, no checkpoint folder


# -- end to end: precedence and temp-dir litter -----------------------------------------------------
@pytest.fixture
def fresh_tmpdir(tmp_path, monkeypatch) -> Path:
    """Point the temp dir at an empty folder, to see what runs leave there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def _fedsim_litter(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("fedsim-"))


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_environment_wins_over_the_files_uri_and_a_run_leaves_no_temp_files(tmp_path, monkeypatch, capsys,
                                                                            fresh_tmpdir) -> None:
    from mlflow import MlflowClient

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    mine = f"sqlite:///{tmp_path / 'mine.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mine)
    exp = work / "downloaded.yaml"  # its tracking.uri would send the run elsewhere (here: a closed local port)
    exp.write_text((EXPERIMENTS_DIR / "fedavg_digits.yaml").read_text()
                   + f"tracking:\n  uri: http://127.0.0.1:{closed_port()}\n  log_model: true\n")
    argv = ["run", str(exp), "--rounds", "1", "--clients", "2", "data.partition.name=iid", "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "fedsim: note: the experiment's tracking.uri (http://127.0.0.1:" in err
    assert "overridden by $MLFLOW_TRACKING_URI" in err
    client = MlflowClient(tracking_uri=mine)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "model")} == {"model/global_model.pt"}
    assert _fedsim_litter(fresh_tmpdir) == []
    assert not (work / "mlflow.db").exists()


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_a_failing_tracked_run_leaves_no_temp_files(in_tmp, fresh_tmpdir, tracking_uri) -> None:
    from mlflow import MlflowClient

    from fedsim import config as C
    from fedsim.runner import run_experiment

    cfg = C.load_config("fedavg", TINY[5:8] + ["engine.faults.fail_partitions=[0,1]", "engine.checkpoint=false"],
                        {"rounds": 1, "clients": 2, "seed": None, "engine": None})
    with pytest.raises(FedsimError):
        run_experiment(cfg, tracking_uri=tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.info.status == "FAILED"
    assert _fedsim_litter(fresh_tmpdir) == []


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])
def test_a_centralised_run_leaves_no_temp_files(tracked, in_tmp, fresh_tmpdir, tracking_uri) -> None:
    from fedsim.central_runner import run_central
    from fedsim import config as C

    _register_table_method()
    path = in_tmp / "tables.yaml"
    path.write_text("method: _tables_to_log\ndescription: writes a table\nseed: 0\n")
    cfg = C.load_central_config(str(path))
    cfg.tracking.enabled = tracked
    summary = run_central(cfg, tracking_uri=tracking_uri)
    assert summary.tables["t"] == [{"x": 1}]  # the method did write its files to the artifact folder
    assert _fedsim_litter(fresh_tmpdir) == []


def _register_table_method() -> None:
    from fedsim.contracts.central import CentralContext
    from fedsim.registry import CENTRAL

    if "_tables_to_log" in CENTRAL.names():
        return

    @CENTRAL.register("_tables_to_log", summary="test method: one table")
    def run(ctx: CentralContext) -> dict[str, float]:
        ctx.log_table([{"x": 1}], "t")
        return {"x": 1.0}
