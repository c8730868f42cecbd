"""The command line: one-line errors with exit 2, a recorded run, and honest MLflow statuses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from rich.cells import cell_len

from fedsim.cli import main
from fedsim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

FAST = ["--rounds", "1", "--clients", "3", "data.name=digits", "data.partition.name=iid", "model.name=mlp"]


def statuses(uri: str) -> list[str]:
    client = MlflowClient(tracking_uri=uri)
    exps = client.search_experiments()
    return [r.info.status for r in client.search_runs([e.experiment_id for e in exps])]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "nope"], "unknown experiment 'nope'"),
        (["run", "fedavg", "client.lrr=1"], "client.lrr"),
        (["run", "fedavg", "--rounds", "0"], "rounds must be in [1, 100000] (an integer)"),
        (["run", "fedavg", "--rounds", "x"], "expected an integer"),
        (["run", "fedavg", "--engine", "gpu"], "invalid choice"),
        (["run", "fedavg", "--eps", "0"], "privacy.epsilon must be in (0, 1000] (a finite number)"),
        (["run", "fedavg", "--eps", "-1"], "privacy.epsilon must be in (0, 1000] (a finite number)"),
        (["run", "fedavg", "--eps", "nan"], "privacy.epsilon must be in (0, 1000] (a finite number), got nan"),
        (["run", "fedavg", "--eps", "3", "privacy.delta=2"], "privacy.delta must be in (0, 1)"),
        (["run", "fedavg", "model.name=resnet"], "unknown model 'resnet'"),
        (["run", "fedavg", "model.params.hiden=3"], "model.params.hiden"),
        (["run", "fedavg", "data.partition.name=iid", "data.partition.name=zipf"], "unknown partitioner 'zipf'"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle, capsys, tracking_uri, in_tmp) -> None:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*argv, "--tracking-uri", tracking_uri] if argv[0] == "run" else argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (in_tmp / "mlflow.db").exists()  # nothing half-written


def test_bad_yaml_file_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "x.yaml"
    bad.write_text("rounds: 3\n  clients: 2\n")
    assert main(["run", str(bad)]) == 2
    assert "bad YAML" in capsys.readouterr().err


def test_print_config_and_list(capsys) -> None:
    assert main(["run", "fedavg", "--print-config", "--seed", "4", "client.lr=0.02"]) == 0
    out = capsys.readouterr().out
    assert "seed: 4" in out and "lr: 0.02" in out
    assert main(["list", "--long"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "Dirichlet" in out


# -- issue #27: the first ten minutes ----------------------------------------------------------------
@pytest.mark.parametrize(("override", "phrase"), [
    ("strategy.name=fedadamx", "unknown strategy 'fedadamx'; known strategies: "),
    ("model.name=resnet", "unknown model 'resnet'; known models: "),
    ("data.name=imagenet", "unknown dataset 'imagenet'; known datasets: "),
    ("data.partition.name=zipf", "unknown partitioner 'zipf'; known partitioners: "),
    ("client.learner=oracle", "unknown learner 'oracle'; known learners: "),
])
def test_unknown_name_error_says_a_proper_plural(override, phrase, capsys, in_tmp) -> None:
    assert main(["run", "fedavg_digits", override, "--no-tracking"]) == 2
    err = capsys.readouterr().err
    assert phrase in err, err
    assert "strategys" not in err and len(err.strip().splitlines()) == 1


def test_every_registry_has_a_real_plural() -> None:
    from fedsim.registry import REGISTRIES

    assert {r.kind: r.plural for r in REGISTRIES} == {
        "strategy": "strategies", "learner": "learners", "dataset": "datasets", "model": "models",
        "partitioner": "partitioners", "centralised method": "centralised methods", "engine": "engines"}
    for reg in REGISTRIES:
        with pytest.raises(ConfigError, match=rf"^unknown {reg.kind} 'nope'; known {reg.plural}: \w"):
            reg.require("nope")


def _experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("columns", [80, 40])
def test_list_is_one_line_per_experiment_within_the_width(columns, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == _experiments()  # exactly one line each, nothing else
    assert max(cell_len(line) for line in lines) <= columns
    assert any(line.endswith("…") for line in lines)  # long descriptions are cut, and say so
    assert main(["list", "--long"]) == 0
    long = capsys.readouterr().out
    assert len(long.splitlines()) > len(lines) and "fedsim experiments" in long  # the table, in full


def test_list_into_a_closed_pipe_is_quiet() -> None:
    """`fedsim list | head -1`: no BrokenPipeError traceback."""
    proc = subprocess.run(f"{sys.executable} -m fedsim list | head -1", shell=True, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert proc.stdout.split()[0] == _experiments()[0]
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_quiet_prints_only_the_run_id(tracking_uri, capfd, in_tmp) -> None:
    assert main(["run", "fedavg", *FAST, "--quiet", "--tracking-uri", tracking_uri]) == 0
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert capfd.readouterr().out == f"run {run.info.run_id}\n"
    assert main(["run", "fedavg", *FAST, "--quiet", "--no-tracking"]) == 0
    assert capfd.readouterr().out == ""  # no run, no id



def test_quiet_centralised_run_prints_only_the_run_id(monkeypatch, capfd, in_tmp) -> None:
    import types

    import fedsim.central_runner as central

    fake = types.SimpleNamespace(metrics={"acc": 1.0}, wall_seconds=0.1, run_id="f" * 32)
    monkeypatch.setattr(central, "run_central", lambda cfg, **kw: fake)  # the printing, not the method
    assert main(["run", "watermark", "--quiet"]) == 0
    assert capfd.readouterr().out == f"run {'f' * 32}\n"
    assert main(["run", "watermark"]) == 0
    out = capfd.readouterr().out
    assert "wall time (total)" in out and "f" * 32 in out


CHECKPOINTS = "fedsim-checkpoints"


@pytest.mark.parametrize("argv", [
    ["run", "fedavg", *FAST, "--no-tracking"],
    ["run", "fedavg", "--print-config"],
    ["run", "fedavg", "client.lrr=1"],
    ["run", "fedavg", "--rounds", "0"],
    ["list"],
], ids=["no-tracking", "print-config", "config-error", "bad-flag", "list"])
def test_no_checkpoint_dir_where_nothing_checkpoints(argv, in_tmp, capsys) -> None:
    try:
        main(argv)
    except SystemExit:  # argparse's errors
        pass
    assert not (in_tmp / CHECKPOINTS).exists()


def test_finished_and_failed_runs_leave_no_checkpoint_dir(tracking_uri, in_tmp, capsys) -> None:
    assert main(["run", "fedavg", *FAST, "--rounds", "2", "--tracking-uri", tracking_uri]) == 0
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.data.tags["fedsim.checkpoint"] == str(in_tmp / CHECKPOINTS / run.info.run_id)  # it did checkpoint
    assert not (in_tmp / CHECKPOINTS).exists()  # ... and a finished run removes it, root included
    code = main(["run", "fedavg", *FAST, "engine.faults.fail_partitions=[0]", "strategy.min_train_results=3",
                 "--tracking-uri", tracking_uri])
    assert code == 2  # failed in round 1, before any checkpoint: nothing to resume, so nothing left
    assert not (in_tmp / CHECKPOINTS).exists()


def test_a_kept_checkpoint_stays(tracking_uri, in_tmp, capsys) -> None:
    assert main(["run", "fedavg", *FAST, "engine.keep_checkpoint=true", "--tracking-uri", tracking_uri]) == 0
    assert list((in_tmp / CHECKPOINTS).glob("*/meta.json"))


def test_settle_removes_a_lock_only_checkpoint_dir(tmp_path) -> None:
    """A run that stopped after taking the lock but before its first save leaves no directory."""
    from fedsim import config as C
    from fedsim.engine.checkpoint import CheckpointDir
    from fedsim.runner import _settle_checkpoint

    cfg = C.load_config("fedavg_digits", [f"engine.checkpoint_dir={tmp_path / 'ck'}"], {})
    held = CheckpointDir(tmp_path / "ck" / ("a" * 32), "a" * 32)
    held.lock()
    assert (held.path / "lock").exists()
    _settle_checkpoint(cfg, held, "FAILED", "a" * 32)
    assert not (tmp_path / "ck").exists()


PHASE = re.compile(r"^\s*(\d+\.\d) s  (\S.*)$")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_phases_before_round_1_and_the_real_wall_time(tmp_path, tracking_uri) -> None:
    """The bar says what the ~30 s before round 1 are spent on; the summary's total is the command's."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedsim", "run", "fedavg_digits", "--rounds", "1", "--eps", "3",
         "--tracking-uri", tracking_uri], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    lines, seen_total = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if "wall time (total)" in line and seen_total is None:
            seen_total = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=60) == 0, err
    phases = [(float(m[1]), m[2]) for m in map(PHASE.match, lines) if m]
    assert [name for _, name in phases] == [
        "loading torch and Flower", "checking the config", "loading data, calibrating DP noise",
        "opening the MLflow run", "recording the config to MLflow", "starting the local engine"], lines
    assert [t for t, _ in phases] == sorted(t for t, _ in phases)
    (row,) = [line for line in lines if "wall time (total)" in line]
    total = float(re.search(r"([\d.]+) s", row)[1])
    assert seen_total is not None and total >= seen_total - 1.0, (total, seen_total)
    (engine_row,) = [line for line in lines if "wall time (engine + rounds)" in line]
    assert float(re.search(r"([\d.]+) s", engine_row)[1]) <= total


def test_dirichlet_too_small_client_is_one_line(tracking_uri, in_tmp, capsys) -> None:
    """Issue #27: the README's old example (Dirichlet α = 0.1 over 20 clients) left a client too small."""
    argv = ["run", "fedavg_digits", "data.partition.name=dirichlet", "data.partition.alpha=0.1", "--eps", "3",
            "--tracking-uri", tracking_uri]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fedsim: error: data.partition.min_partition_size"), err
    assert not (in_tmp / CHECKPOINTS).exists()
    import fedsim

    with pytest.raises(ConfigError, match="min_partition_size"):  # from Python: the same error, raised
        fedsim.run("fedavg_digits", {"data.partition.name": "dirichlet", "data.partition.alpha": 0.1}, eps=3)


def test_run_records_metrics_params_tags_and_artifacts(tracking_uri, capsys) -> None:
    start = time.perf_counter()
    assert main(["run", "fedavg", *FAST, "--rounds", "2", "--tracking-uri", tracking_uri]) == 0
    took = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "eval/accuracy" in out  # the summary table
    total = float(re.search(r"wall time \(total\)\s*│\s*([\d.]+) s", out)[1])
    assert took - 0.5 <= total <= took + 0.1  # the command's whole time, not only the rounds
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "eval/accuracy", "eval/loss", "round/seconds", "round/clients_ok",
                "round/clients_failed"):
        assert key in run.data.metrics, key
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")]
    assert steps == [0, 1, 2]
    assert run.data.params["data.name"] == "digits" and run.data.params["rounds"] == "2"
    assert {"experiment", "strategy", "engine", "seed", "git_commit"} <= set(run.data.tags)
    assert run.data.tags["engine"] == "local" and run.data.tags["strategy"] == "fedavg"
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "plots", "model"} <= files
    plots = {f.path for f in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/learning_curve.png", "plots/label_histogram.png"} <= plots


def test_failed_run_ends_failed(tracking_uri, capsys) -> None:
    code = main(["run", "fedavg", *FAST, "engine.faults.fail_partitions=[0]", "strategy.min_train_results=3",
                 "--tracking-uri", tracking_uri])
    assert code == 2
    assert "round failed" in capsys.readouterr().err
    assert statuses(tracking_uri) == ["FAILED"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interrupted_run_ends_killed(tmp_path, tracking_uri) -> None:
    statuses(tracking_uri)  # create the store first, so two processes never migrate it at once
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedsim", "run", "fedavg_digits", "--rounds", "500", "--quiet",
         "--tracking-uri", tracking_uri], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    deadline = time.time() + 150
    while time.time() < deadline and "RUNNING" not in statuses(tracking_uri):
        time.sleep(0.5)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=400)  # a hang guard: a loaded machine tears Ray/MLflow down slowly
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert statuses(tracking_uri) == ["KILLED"]


def test_runs_are_named_by_experiment_strategy_engine_overrides_and_seed(tracking_uri, capsys) -> None:
    from mlflow import MlflowClient

    assert main(["run", "fedavg_digits", "--rounds", "1", "--clients", "10", "client.lr=0.05", "--seed", "3",
                 "--tracking-uri", tracking_uri, "--quiet"]) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.info.run_name == "fedavg_digits-fedavg-local-client.lr=0.05,rounds=1,clients=10-seed3"


def test_default_run_name_cuts_long_overrides() -> None:
    from fedsim import config as C
    from fedsim.runner import default_run_name

    cfg = C.load_config("fedavg_digits", [], {})
    assert default_run_name(cfg) == "fedavg_digits-fedavg-local-seed0"
    name = default_run_name(cfg, [f"strategy.params.x{i}=1" for i in range(40)], limit=50)
    assert name.endswith("…-seed0") and len(name) == len("fedavg_digits-fedavg-local--seed0") + 50
