"""``fedsim compare --experiment``: groups runs by the configuration the user changed, with short labels."""

from __future__ import annotations

import pytest

from fedsim.cli import main
from fedsim.compare import _short_keys, _short_value, from_experiment


def test_legend_keys_are_the_shortest_unambiguous_suffix() -> None:
    keys = ["client.lr", "data.partition.alpha", "strategy.params.alpha", "num_clients"]
    assert _short_keys(keys) == {"client.lr": "lr", "data.partition.alpha": "partition.alpha",
                                 "strategy.params.alpha": "params.alpha", "num_clients": "num_clients"}
    assert _short_value("x" * 100).endswith("…") and len(_short_value("x" * 100)) == 24


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(240)
def test_runs_are_grouped_by_what_the_user_set_not_by_derived_client_sizes(tracking_uri, in_tmp) -> None:
    base = ["run", "fedavg", "--rounds", "1", "data.name=digits", "model.name=mlp", "data.partition.name=iid",
            "--quiet", "--tracking-uri", tracking_uri]
    for clients in ("2", "3"):  # different client counts: every data.size.* param differs as well
        assert main([*base, "--clients", clients]) == 0
    cmp = from_experiment("fedavg", tracking_uri=tracking_uri)
    assert sorted(cmp.groups) == ["num_clients=2", "num_clients=3"]
    from mlflow import MlflowClient

    (run, *_) = MlflowClient(tracking_uri).search_runs(
        [MlflowClient(tracking_uri).get_experiment_by_name("fedsim").experiment_id])
    derived = run.data.tags["fedsim.derived_params"].split(",")
    assert derived and all(k in run.data.params for k in derived)
    assert any(len({r.data.params[k] for rs in cmp.groups.values() for r in rs}) > 1 for k in derived)
