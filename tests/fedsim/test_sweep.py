"""Sweeps: grid parsing, spec errors, and a 2×2 grid on a local Ray runtime with a failing trial and resume."""

from __future__ import annotations

import math

import pytest
from mlflow import MlflowClient

from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.sweep import load_sweep, parse_grid, trial_config


def test_grid_values_are_typed_and_section_names_expand() -> None:
    grid = parse_grid(["eps=1,3,.inf", "strategy=fedsvd,ffa_lora", "client.lr=0.01,0.1", "rounds=2,4",
                       "data.partition.name=iid"], "fedsvd")
    assert grid == {"eps": [1, 3, math.inf], "strategy.name": ["fedsvd", "ffa_lora"], "client.lr": [0.01, 0.1],
                    "rounds": [2, 4], "data.partition.name": ["iid"]}
    for bad in (["eps"], ["=1,2"], ["lr="]):
        with pytest.raises(ConfigError, match="KEY=V1,V2"):
            parse_grid(bad, "fedavg")


def test_sweep_specs_and_their_errors() -> None:
    name, spec = load_sweep("fedsvd")  # experiments/sweeps/fedsvd.yaml
    assert name == "fedsvd" and spec.grid == {"eps": [1, 3, 6], "strategy.name": ["fedsvd", "ffa_lora"]}
    assert spec.seeds == [0, 1, 2] and spec.cpus_per_trial == 1
    name, spec = load_sweep("fedavg_digits", grid=["client.lr=0.1,0.2"], seeds=2, overrides=["rounds=1"],
                            cpus_per_trial=2, max_concurrent=1)
    assert (spec.experiment, spec.seeds, spec.overrides, spec.cpus_per_trial, spec.max_concurrent) == \
        ("fedavg_digits", [0, 1], ["rounds=1"], 2, 1)
    cfg = trial_config(spec, {"client.lr": 0.2}, seed=1)
    assert cfg.engine.name == "local" and cfg.engine.threads_per_client == 2 and cfg.client.lr == 0.2
    with pytest.raises(ConfigError, match="give a grid"):
        load_sweep("fedavg_digits")
    with pytest.raises(ConfigError, match="unknown experiment"):
        load_sweep("no_such_experiment", grid=["rounds=1,2"])
    with pytest.raises(ConfigError, match="cpus_per_trial must be > 0"):
        load_sweep("fedavg_digits", grid=["rounds=1,2"], cpus_per_trial=0)
    with pytest.raises(ConfigError, match="centralised-track"):
        load_sweep("paretoq", grid=["params.steps=1,2"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_2x2_sweep_reports_a_failed_trial_runs_the_others_and_resumes(tmp_path, tracking_uri, capsys,
                                                                        monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps at 80 columns otherwise
    # pathological partitioning with 2 clients fails at data build: 2 of the 4 trials fail
    args = ["sweep", "fedavg_digits", "rounds=1", "num_clients=2", "--grid", "client.lr=0.05,0.2",
            "data.partition.name=iid,pathological", "--seeds", "1", "--tracking-uri", tracking_uri,
            "--max-concurrent", "2"]
    assert main(args) == 1  # some trials failed
    out = capsys.readouterr().out
    assert "trials: 2 done, 0 running, 2 failed, 0 pending" in out and "trial failed:" in out
    assert "leaves some of the 10 classes to no client" in out  # the trial's own one-line error
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("kind") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED"
    assert sorted(c.info.run_name for c in children if c.info.status == "FINISHED") == \
        ["lr=0.05, partition=iid | seed 0", "lr=0.2, partition=iid | seed 0"]
    accuracy = {c.info.run_name: c.data.metrics["eval/accuracy"] for c in children if c.info.status == "FINISHED"}
    assert "results.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    # resume: the finished trials are read back, not rerun; the failed ones run again (and fail again)
    assert main([*args, "--resume", parent.info.run_id]) == 1
    out = capsys.readouterr().out
    assert "trials: 2 done, 0 running, 2 failed, 0 pending (2 read back)" in out
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    finished = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.info.status == "FINISHED"]
    assert {r.info.run_name: r.data.metrics["eval/accuracy"] for r in finished} == accuracy
    # compare: the same table from MLflow, plots logged to the parent
    assert main(["compare", parent.info.run_id, "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    assert f"{accuracy['lr=0.2, partition=iid | seed 0']:.4f} ± 0.0000" in out
    assert {"compare/eval_accuracy/curves.png", "compare/comparison.md"} <= {
        a.path for d in client.list_artifacts(parent.info.run_id, "compare")
        for a in ([d] if not d.is_dir else client.list_artifacts(parent.info.run_id, d.path))}
