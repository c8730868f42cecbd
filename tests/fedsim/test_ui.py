"""`fedsim ui` serves the MLflow UI on 127.0.0.1 over the same store as `fedsim run`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from fedsim.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ui_serves_the_runs_of_the_same_store(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "fedavg", "--rounds", "1", "--clients", "2", "data.name=digits", "model.name=mlp",
                 "data.partition.name=iid", "--quiet"]) == 0  # default store: ./mlflow.db
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedsim", "ui", "--port", str(port)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "MLflow UI did not come up"
            time.sleep(0.5)
        req = urllib.request.Request(f"{base}/api/2.0/mlflow/experiments/search", method="POST",
                                     data=json.dumps({"max_results": 10}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            experiments = {e["name"]: e for e in json.load(r)["experiments"]}
        assert "fedsim" in experiments
        exp = experiments["fedsim"]
        tags = {t["key"]: t["value"] for t in exp.get("tags", [])}
        assert tags.get("mlflow.experimentKind") == "custom_model_development"  # the UI opens the runs table
        first_line = proc.stdout.readline().decode()
        assert (f"{base}/#/experiments/{exp['experiment_id']}/runs?workflowType=machine_learning"
                "&viewStateShareKey=fedsim-default") in first_line
        # the saved view that address opens: the headline metrics the run logged (one run: no param differs)
        view = json.loads(tags["mlflow.sharedViewState.fedsim-default"])
        assert view["name"].startswith("fedsim")
        assert json.loads(view["state"])["selectedColumns"] == ["metrics.`eval/accuracy`", "metrics.`eval/loss`"]
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
        url = f"{base}/get-artifact?path=plots/learning_curve.png&run_uuid={run.info.run_id}"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read(8) == b"\x89PNG\r\n\x1a\n"  # the plot is served to the UI
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
