"""fedsim/ui_view.py: the saved view that `fedsim ui` opens, with the headline metrics and the params
that differ as the runs table's columns (the browser side is tests/fedsim/test_ui_browser.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fedsim.ui_view import TAG_PREFIX, VIEW_KEY, default_columns, differing_params, write_default_view


def run(params: dict[str, str], metrics: dict[str, float] | None = None) -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(params=params, metrics=metrics or {}))


def test_only_params_that_differ_among_the_runs_that_log_them_become_columns() -> None:
    runs = [run({"client.lr": "0.1", "num_clients": "2", "zeta": "a", "seed": "0", "data.size.client_train_min": "20"},
                {"eval/accuracy": 0.5}),
            run({"client.lr": "0.2", "num_clients": "2", "zeta": "b", "seed": "1", "data.size.client_train_min": "31"},
                {"privacy/epsilon_max": 2.9}),
            run({"spec": "claim.yaml"}, {"final/lr:0.1": 0.5})]  # a claim check's parent: none of their params
    # fedsim's usual knobs first, then by name; the data sizes differ with the seed but are not settings
    assert differing_params(runs) == ["client.lr", "seed", "zeta"]
    assert default_columns(runs) == ["metrics.`eval/accuracy`", "metrics.`privacy/epsilon_max`",
                                     "params.`client.lr`", "params.`seed`", "params.`zeta`"]
    many = [run({f"p{i}": str(j) for i in range(30)}) for j in range(2)]
    assert len(differing_params(many)) == 10


def test_the_view_is_an_experiment_tag_that_is_refreshed_and_keeps_its_creation_time(tmp_path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("fedsim")
    for lr in ("0.1", "0.2"):
        r = client.create_run(exp)
        client.log_param(r.info.run_id, "client.lr", lr)
        client.log_metric(r.info.run_id, "eval/accuracy", 0.5)
    assert write_default_view(client, exp) == ["metrics.`eval/accuracy`", "params.`client.lr`"]
    first = json.loads(client.get_experiment(exp).tags[TAG_PREFIX + VIEW_KEY])
    assert json.loads(first["state"]) == {"selectedColumns": ["metrics.`eval/accuracy`", "params.`client.lr`"]}
    r = client.create_run(exp)
    client.log_param(r.info.run_id, "client.lr", "0.3")
    client.log_metric(r.info.run_id, "eval/loss", 1.0)
    write_default_view(client, exp)
    second = json.loads(client.get_experiment(exp).tags[TAG_PREFIX + VIEW_KEY])
    assert json.loads(second["state"])["selectedColumns"] == ["metrics.`eval/accuracy`", "metrics.`eval/loss`",
                                                              "params.`client.lr`"]
    assert second["createdAt"] == first["createdAt"] and second["updatedAt"] >= first["updatedAt"]
