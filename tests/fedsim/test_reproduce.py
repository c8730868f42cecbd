"""Claim checks: a grid × seeds becomes one parent MLflow run with nested children and a table."""

from __future__ import annotations

import math
from pathlib import Path

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
    path.write_text("experiment: fedavg\ndescription: two learning rates\noverrides: [rounds=1, num_clients=2,"
                    " data.name=digits, model.name=mlp, data.partition.name=iid]\ngrid:\n  client.lr: [0.05, 0.2]\n"
                    "seeds: [0, 1]\nextra_metrics: [eval/loss, no/such_metric]\n")
    assert main(["reproduce", str(path), "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    assert "lr=0.05" in out and "lr=0.2" in out and "±" in out
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "claim-check"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 4
    assert parents[0].data.tags["mlflow.note.content"] == "two learning rates"  # the run's MLflow description
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert all(r.info.status == "FINISHED" for r in runs)
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"results.csv", "results.md", "plots"} <= arts
    # extra metrics: a column each, the mean over seeds of each child's final value; "–" where none logged
    table = (Path(client.download_artifacts(parents[0].info.run_id, "results.md"))).read_text()
    assert "eval/loss" in table.splitlines()[0] and "no/such_metric" in table.splitlines()[0]
    losses = {}
    for c in children:
        losses.setdefault(c.data.tags["mlflow.runName"].split(" | ")[0], []).append(c.data.metrics["eval/loss"])
    for label, values in losses.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert f"{sum(values) / len(values):.4f} ±" in row.split(" | ")[3] and row.rstrip(" |").endswith("–")


def test_an_interrupted_claim_check_resumes_where_it_stopped(tmp_path, tracking_uri, in_tmp) -> None:
    from fedsim.reproduce import run_claim
    from fedsim.runner import run_experiment

    path = tmp_path / "claim.yaml"
    path.write_text("experiment: fedavg\noverrides: [rounds=2, num_clients=2, data.name=digits, model.name=mlp,"
                    " data.partition.name=iid, engine.keep_checkpoint=true]\ngrid:\n  client.lr: [0.05, 0.2]\n"
                    "seeds: [0, 1]\nextra_metrics: [eval/loss]\n")
    spec = load_claim(str(path))
    full, _ = run_claim("c", spec, tracking_uri=tracking_uri)
    calls: list[str] = []

    def interrupted(cfg, **kw):
        calls.append(kw["run_name"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run_experiment(cfg, **kw)

    with pytest.raises(KeyboardInterrupt):
        run_claim("c", spec, tracking_uri=tracking_uri, run_one=interrupted)
    client = MlflowClient(tracking_uri)
    parent = [r for r in client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
              if r.data.tags.get("kind") == "claim-check" and r.info.status == "KILLED"][0]
    rerun: list[str] = []

    def counting(cfg, **kw):
        rerun.append(kw["run_name"])
        return run_experiment(cfg, **kw)

    resumed, parent_id = run_claim("c", spec, tracking_uri=tracking_uri, run_one=counting,
                                   resume_parent=parent.info.run_id)
    assert parent_id == parent.info.run_id and rerun == calls[2:] + ["lr=0.2 | seed 1"]
    assert [r.finals for r in resumed] == [r.finals for r in full]
    for r_resumed, r_full in zip(resumed, full):  # read back from MLflow (float32-rounded) or fresh
        assert r_resumed.extras["eval/loss"] == pytest.approx(r_full.extras["eval/loss"], rel=1e-6)
    assert client.get_run(parent_id).info.status == "FINISHED"
    with pytest.raises(ConfigError, match="that claim check ran with"):
        run_claim("c", load_claim(str(path), seeds=1), tracking_uri=tracking_uri, resume_parent=parent_id)
    # more seeds: a raise of the finished check, its runs read back and the raise disclosed
    raised: list[str] = []

    def counting_raise(cfg, **kw):
        raised.append(kw["run_name"])
        return run_experiment(cfg, **kw)

    more, _ = run_claim("c", load_claim(str(path), seeds=3), tracking_uri=tracking_uri, run_one=counting_raise,
                        resume_parent=parent_id)
    assert raised == ["lr=0.05 | seed 2", "lr=0.2 | seed 2"] and [r.finals[:2] for r in more] == [r.finals for r in full]
    assert client.get_run(parent_id).data.tags["fedsim.seeds_raised"] == "2 -> 3"
    table = Path(client.download_artifacts(parent_id, "results.md")).read_text()
    assert table.startswith("Seeds raised after a first result (post hoc, `--resume` with more seeds): 2 -> 3.")
    # a raise cut short (to 4, stopped, resumed with 3): the tag says so, not "2 -> 4"
    client.set_tag(parent_id, "fedsim.seeds_raised", "2 -> 3 -> 4")
    run_claim("c", load_claim(str(path), seeds=3), tracking_uri=tracking_uri, run_one=counting_raise,
              resume_parent=parent_id)
    assert client.get_run(parent_id).data.tags["fedsim.seeds_raised"] == "2 -> 3 -> 4 -> 3"


def test_client_failures_are_counted_live_and_when_read_back(tmp_path, tracking_uri) -> None:
    """A run that lost clients is flagged in the table: its data point is not a clean one."""
    from fedsim.reproduce import results_table_rows, run_claim

    path = tmp_path / "claim.yaml"
    path.write_text("experiment: fedavg\noverrides: [rounds=2, num_clients=3, data.name=digits, model.name=mlp,"
                    " data.partition.name=iid, strategy.min_train_results=1]\n"
                    "grid:\n  engine.faults.fail_partitions: [[], [1]]\nseeds: [0, 1]\n")
    spec = load_claim(str(path))
    live, parent_id = run_claim("c", spec, tracking_uri=tracking_uri)
    assert [r.client_failures for r in live] == [0, 2 * 2]  # partition 1 fails in both rounds of both seeds
    rows = results_table_rows(spec, live)
    assert "client failures" not in rows[0] and rows[1]["client failures"] == "4"
    read_back, _ = run_claim("c", spec, tracking_uri=tracking_uri, resume_parent=parent_id)
    assert [r.client_failures for r in read_back] == [0, 4]


def test_a_setting_error_every_child_would_hit_stops_the_claim_check_before_a_parent_exists(in_tmp, capsys):
    """A missing dataset root is one line and exit 2, not a recorded parent whose every child failed."""
    from fedsim.cli import main

    code = main(["reproduce", "fedphoenix", "--scale", "paper", "rounds=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("fedsim: error:") and "data.params.root" in err[0]
    assert not (in_tmp / "mlflow.db").exists() and not (in_tmp / "mlruns").exists()


def test_parent_metric_names_are_clean_key_value_pairs() -> None:
    """The sweep parent's ``final/...`` names read ``eps:3 alpha:0.3``, not ``eps:3_ alpha:0.3_``."""
    from fedsim.reproduce import _metric_name, label_of

    label = label_of({"eps": 3.0, "data.partition": {"name": "dirichlet", "alpha": 0.3}, "strategy.name": "fedavg"})
    name = _metric_name(label)
    assert name == "eps:3.0 partition:dirichlet alpha:0.3 strategy:fedavg"
    assert _metric_name(label_of({"eps": float("inf")})) == "eps:inf"
    from mlflow.utils.validation import _validate_metric_name

    _validate_metric_name(f"final/{name}")  # MLflow accepts it
