"""Claim checks: a grid × seeds becomes one parent MLflow run with nested children and a table."""

from __future__ import annotations

import math

import pytest
from mlflow import MlflowClient

from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.reproduce import best_moving_average, build_config, label_of, load_claim, settings


def test_spec_grid_and_eps_mapping(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("experiment: fedavg\ngrid:\n  strategy.fraction_train: [0.5, 1.0]\n  eps: [3, .inf]\nseeds: [0]\n")
    spec = load_claim(str(path))
    grid = settings(spec)
    assert len(grid) == 4
    cfg_inf = build_config(spec, {"strategy.fraction_train": 0.5, "eps": math.inf}, seed=2)
    cfg_3 = build_config(spec, {"strategy.fraction_train": 1.0, "eps": 3}, seed=2)
    assert not cfg_inf.privacy.enabled and cfg_inf.seed == 2 and cfg_inf.strategy.fraction_train == 0.5
    assert cfg_3.privacy.enabled and cfg_3.privacy.epsilon == 3.0
    with pytest.raises(ConfigError, match="no claim check named"):
        load_claim("nope")


def test_mapping_values_set_several_keys() -> None:
    spec = load_claim("fedphoenix")
    setting = {"strategy": {"name": "fedmut", "params": {"alpha": 2.0}},
               "data.partition": {"name": "dirichlet", "alpha": 0.6}, "eps": math.inf}
    cfg = build_config(spec, setting, seed=1)
    assert cfg.strategy.name == "fedmut" and cfg.strategy.params == {"alpha": 2.0}
    assert cfg.data.partition.name == "dirichlet" and cfg.data.partition.alpha == 0.6
    assert not cfg.privacy.enabled
    assert label_of(setting) == "strategy=fedmut(params.alpha=2.0), partition=dirichlet(alpha=0.6), ε=∞"


def test_best_moving_average() -> None:
    assert best_moving_average([0.1, 0.9, 0.2, 0.8, 0.7], 2) == pytest.approx(0.75)
    assert best_moving_average([0.1, 0.3], 5) == 0.3


def test_reproduce_logs_parent_with_children(tmp_path, tracking_uri, capsys) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text("experiment: fedavg\noverrides: [rounds=1, num_clients=2, data.name=digits, model.name=mlp,"
                    " data.partition.name=iid]\ngrid:\n  client.lr: [0.05, 0.2]\nseeds: [0, 1]\n")
    assert main(["reproduce", str(path), "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    assert "lr=0.05" in out and "lr=0.2" in out and "±" in out
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "claim-check"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 4
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert all(r.info.status == "FINISHED" for r in runs)
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"results.csv", "results.md", "plots"} <= arts
