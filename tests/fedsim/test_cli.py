"""The command line: one-line errors with exit 2, a recorded run, and honest MLflow statuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from fedsim.cli import main

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
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "Dirichlet" in out


def test_run_records_metrics_params_tags_and_artifacts(tracking_uri, capsys) -> None:
    assert main(["run", "fedavg", *FAST, "--rounds", "2", "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    assert "eval/accuracy" in out  # the summary table
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
