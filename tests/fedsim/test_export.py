"""`fedsim export NAME DIR`: a Flower app that the real `flwr run` executes (issue #27).

The slow test runs the exported app with Flower 1.42's own CLI, `flwr run DIR --stream` (it runs
offline here: it starts a local `flower-superlink --simulation` in the background, on ports of its
own, with `$FLWR_HOME` under tmp_path and runtime dependency installation off, and the test stops
that SuperLink by its PID), and checks the run's rounds and metrics against `fedsim run` of the
same config (seeded; the engines agree round for round).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from fedsim import config as C
from fedsim.cli import main

OVERRIDES = ["data.partition.num_classes_per_partition=8"]  # 3 clients must cover digits' 10 classes


def _export(tmp_path: Path, *extra: str) -> Path:
    dest = tmp_path / "app"
    assert main(["export", "fedavg_digits", str(dest), "--rounds", "3", "--clients", "3", *OVERRIDES, *extra]) == 0
    return dest


def test_export_writes_a_valid_flower_app(tmp_path, capsys):
    dest = _export(tmp_path)
    assert "fedavg_digits_app/" in capsys.readouterr().out
    pyproject = tomllib.loads((dest / "pyproject.toml").read_text())
    app = pyproject["tool"]["flwr"]["app"]
    assert app["publisher"] == "fedsim"
    assert app["components"] == {"serverapp": "fedavg_digits_app.server_app:app",
                                 "clientapp": "fedavg_digits_app.client_app:app"}
    assert app["config"]["num-server-rounds"] == 3 and app["config"]["fedsim-config"] == "config.yaml"
    feds = pyproject["tool"]["flwr"]["federations"]
    assert feds["default"] == "local-simulation"
    assert feds["local-simulation"]["options"]["num-supernodes"] == 3
    assert any(d.startswith("fedsim") for d in pyproject["project"]["dependencies"])
    assert "fedsim must be installed" in (dest / "README.md").read_text()

    from flwr.common.config import validate_config

    ok, errors, _ = validate_config(pyproject, check_module=True, project_dir=dest)  # imports the components
    assert ok, errors
    cfg = C.load_config(str(dest / "fedavg_digits_app" / "config.yaml"))
    assert (cfg.rounds, cfg.num_clients, cfg.engine.name, cfg.strategy.name) == (3, 3, "flower", "fedavg")

    from fedsim.export import app_config

    pkg = dest / "fedavg_digits_app"
    assert app_config(pkg, {}).rounds == 3
    over = app_config(pkg, {"num-server-rounds": 2, "seed": 5, "fedsim-overrides": "client.lr=0.05"})
    assert (over.rounds, over.seed, over.client.lr) == (2, 5, 0.05)


@pytest.mark.parametrize("args, message", [
    (["nope_not_an_experiment"], "unknown experiment 'nope_not_an_experiment'"),
    (["lasq"], "is a centralised method"),
    (["fedavg_digits", "engine.vectorise=true"], "engine.vectorise=true (the local engine's vectorised cohort) is a "
                                                 "feature of fedsim's own engines"),
    (["fedavg_digits", "strategy.name=nope"], "nope"),
])
def test_export_errors_are_one_line(tmp_path, capsys, args, message):
    assert main(["export", args[0], str(tmp_path / "app"), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("fedsim: error: ")
    assert not (tmp_path / "app").exists()


def test_export_refuses_a_non_empty_dir_unless_forced(tmp_path, capsys):
    dest = tmp_path / "app"
    dest.mkdir()
    (dest / "keep.txt").write_text("x")
    assert main(["export", "fedavg_digits", str(dest), *OVERRIDES, "--clients", "3"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "--force" in err and err.count("\n") == 1
    assert not (dest / "pyproject.toml").exists()
    assert main(["export", "fedavg_digits", str(dest), *OVERRIDES, "--clients", "3", "--force"]) == 0
    assert (dest / "pyproject.toml").is_file() and (dest / "keep.txt").is_file()
    old = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    # another experiment over it: the previous export's package goes, the user's file stays
    assert main(["export", "fedavg", str(dest), "--clients", "3", "--force"]) == 0
    new = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    old_pkg = {n.split("/")[0] for n in old if n.endswith("/server_app.py")}
    new_pkg = {n.split("/")[0] for n in new if n.endswith("/server_app.py")}
    assert old_pkg != new_pkg and not (old_pkg & {n.split("/")[0] for n in new}), new
    assert "keep.txt" in new
    assert set((dest / ".fedsim-export").read_text().splitlines()) == new - {"keep.txt", ".fedsim-export"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_mentioning(text: str) -> list[int]:
    """PIDs of the processes whose command line contains ``text`` (the SuperLink this test started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(proc.name) != os.getpid():
                pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flwr_run_executes_the_exported_app_like_fedsim_run(tmp_path):
    flwr = Path(sys.executable).parent / "flwr"
    if not flwr.is_file():
        pytest.skip("the flwr CLI is not installed beside this Python")
    dest = _export(tmp_path)  # exported with 3 rounds; the run config below asks for 2
    home = tmp_path / "flwr-home"
    results = tmp_path / "results.json"
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.perf_counter()
    try:
        proc = subprocess.run([str(flwr), "run", str(dest), "--stream", "--run-config",
                               f'num-server-rounds=2 results-file="{results}"'],
                              env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    finally:
        for pid in _pids_mentioning(str(home)):  # the detached SuperLink (its SuperExec exits with it)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    seconds = time.perf_counter() - started
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert results.is_file(), f"the ServerApp wrote no results (flwr run exits 0 on a failed run):\n{log}"
    exported = json.loads(results.read_text())
    assert exported["rounds"] == 2 and [r["round"] for r in exported["records"]] == [0, 1, 2]
    assert "[fedsim] round 1: " in proc.stdout + proc.stderr, log  # the ServerApp's round log, streamed
    assert all(r["clients_ok"] >= 1 and r["clients_failed"] == 0 for r in exported["records"][1:])

    from fedsim.runner import run_experiment

    # The reference is the local engine, sequential: every engine gives identical per-round metrics for a
    # seed (docs/engines.md, tested), and the flower engine would add ~30 s of Ray start-up on 2 cores
    # (checked by hand: flwr run, --engine flower and --engine local agree to the last digit here).
    cfg = C.load_config("fedavg_digits", [*OVERRIDES, "engine.vectorise=false"],
                        {"rounds": 2, "clients": 3, "engine": "local"})
    cfg.tracking.enabled = False
    reference = run_experiment(cfg).history.records
    for ours, theirs in zip(exported["records"], reference, strict=True):
        for key in ("eval/loss", "eval/accuracy", "train/loss", "fed_eval/accuracy"):
            if key in theirs.metrics:
                assert ours["metrics"][key] == pytest.approx(theirs.metrics[key], rel=1e-6, abs=1e-9), (key, ours)
    print(f"flwr run of the exported app: {seconds:.1f} s")
