"""The semi-supervised LDL learner in the engine: seeded, centralised vs federated, no label leakage, reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from fedsim.contracts.learner import NodeContext
from clients.ldl_learner import LDLLearner
from fedsim import config as C
from fedsim.cli import main
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

TINY = ["client.params.dataset=b", "client.params.tabular.n_samples=300", "client.params.tabular.n_features=6",
        "client.params.tabular.n_labels=6", "client.params.tabular.n_clusters=3",
        "client.params.model_params={hidden: [16]}",
        "client.local_steps=3", "client.params.views=2"]


def cfg_of(*overrides: str, rounds: int = 2, clients: int = 1) -> C.ExperimentConfig:
    cfg = C.load_config("rankmatch", [*TINY, *overrides], {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


def test_same_seed_same_run_and_seeds_differ() -> None:
    first = run_experiment(cfg_of())
    again = run_experiment(cfg_of())
    assert first.history.as_rows() == again.history.as_rows()
    assert all(torch.equal(first.final_arrays[k], v) for k, v in again.final_arrays.items())
    other = run_experiment(cfg_of("seed=1"))
    assert other.history.final()["eval/kl"] != first.history.final()["eval/kl"]
    final = first.history.final()
    for k in ("eval/chebyshev", "eval/clark", "eval/canberra", "eval/kl", "eval/cosine", "eval/intersection",
              "eval/spearman", "eval/kendall", "eval/pseudo_spearman", "train/pseudo_spearman",
              "train/pseudo_kendall", "ldl/pseudo_spearman_mean"):
        assert np.isfinite(final[k]), k


def test_node_measures_the_pseudo_labels_it_starts_the_round_from() -> None:
    """pseudo_label's targets are the global model's clean predictions: the node's round-r measurement
    equals the server's round-(r-1) measurement of the same model on the same (centralised) pool."""
    summary = run_experiment(cfg_of("client.params.method=pseudo_label", rounds=3))
    recs = summary.history.records
    for r in (1, 2, 3):
        assert recs[r].metrics["train/pseudo_spearman"] == pytest.approx(recs[r - 1].metrics["eval/pseudo_spearman"],
                                                                         abs=1e-9)
        assert recs[r].metrics["train/pseudo_cosine"] == pytest.approx(recs[r - 1].metrics["eval/pseudo_cosine"],
                                                                       abs=1e-9)


def test_training_never_reads_the_unlabelled_truth() -> None:
    cfg = cfg_of()
    learner: LDLLearner = get_learner(RunSpec.from_config(cfg))
    learner.preflight()
    arrays = learner.init_arrays()
    ctx = NodeContext(partition_id=0, num_partitions=1, server_round=1, root_seed=0)
    first = learner.train(arrays, ctx)
    node = learner.node(0)
    node.d_u = torch.flip(node.d_u, dims=[1]).contiguous()  # wrong truth for every unlabelled row
    second = learner.train(arrays, ctx)
    assert all(torch.equal(first.arrays[k], second.arrays[k]) for k in first.arrays)
    assert first.metrics["loss"] == second.metrics["loss"]
    assert first.metrics["pseudo_spearman"] != second.metrics["pseudo_spearman"]  # only the measurement changed


def test_federated_labelled_rows_on_few_nodes_and_fedavg_weights() -> None:
    cfg = cfg_of("client.params.labelled_clients=2", "client.params.min_unlabelled=5", clients=4)
    summary = run_experiment(cfg)
    learner: LDLLearner = get_learner(RunSpec.from_config(cfg))
    per_node = summary.history.records[1].client_metrics
    assert sorted(per_node) == [0, 1, 2, 3]
    assert all(per_node[p]["sup_kl"] > 0 for p in (0, 1)) and all(per_node[p]["sup_kl"] == 0 for p in (2, 3))
    assert all(per_node[p]["unsup_kl"] > 0 for p in range(4))
    assert sum(len(learner.node(p).x_l) for p in range(4)) == len(learner.split.labelled)
    # centralised holds everything on one node
    central: LDLLearner = get_learner(RunSpec.from_config(cfg_of()))
    assert len(central.node(0).x_l) == len(central.split.labelled)
    assert len(central.node(0).x_u) == len(central.split.unlabelled)
    # supervised: unlabelled-only nodes do not train and weigh nothing
    sup = run_experiment(cfg_of("client.params.method=supervised", "client.params.min_unlabelled=5", clients=4))
    steps = {p: m["steps"] for p, m in sup.history.records[1].client_metrics.items()}
    assert steps == {0: 3.0, 1: 3.0, 2: 0.0, 3: 0.0}


@pytest.mark.slow  # MLflow's sqlite store set-up dominates
@pytest.mark.parallel
def test_tracked_run_logs_report_and_plots(tracking_uri) -> None:
    assert main(["run", "rankmatch", *TINY, "--rounds", "2", "--clients", "3", "--tracking-uri", tracking_uri,
                 "--quiet"]) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    m = run.data.metrics
    assert 0 < m["eval/intersection"] <= 1 and "ldl/pseudo_spearman_mean" in m and "train/pseudo_kendall" in m
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/ldl_measures.png", "plots/ldl_pseudo.png", "plots/ldl_rounds.csv", "plots/ldl_nodes.png"} <= plots


@pytest.mark.parametrize("override,message", [
    ("client.params.method=mixmatch", "unknown ldl method"),
    ("client.params.dataset=c", "dataset"),
    ("client.params.labelled_ratio=0", "labelled_ratio"),
    ("client.params.tabular.n_labels=1", "n_labels"),
    ("client.params.views=0", "views"),
])
def test_bad_settings_are_one_line_errors(override, message) -> None:
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg_of(override))


def test_supervised_with_client_sampling_is_refused(capsys) -> None:
    code = main(["run", "rankmatch", *TINY, "client.params.method=supervised", "strategy.fraction_train=0.5",
                 "--clients", "4", "--no-tracking"])
    err = capsys.readouterr().err
    assert code == 2 and "fraction_train=1" in err and "Traceback" not in err


def test_schedules_cosine_lr_and_unlabelled_ramp_up() -> None:
    learner: LDLLearner = get_learner(RunSpec.from_config(cfg_of("client.params.rampup_rounds=4", rounds=16)))
    factors = [learner.lr_factor(r) for r in range(1, 17)]
    assert factors[0] == 1.0 and all(a > b for a, b in zip(factors, factors[1:]))
    assert factors[-1] == pytest.approx(np.cos(7 * np.pi * 15 / (16 * 16)))  # FixMatch's cos(7πk/16K)
    ramp = [learner.params.weights_at(r).unsup_weight for r in (1, 2, 4, 9)]
    assert ramp == [0.25, 0.5, 1.0, 1.0]
    flat: LDLLearner = get_learner(RunSpec.from_config(cfg_of("client.params.lr_schedule=constant")))
    assert flat.lr_factor(2) == 1.0 and flat.params.weights_at(1).unsup_weight == 1.0


def test_validation_split_is_logged_as_val_and_leaves_test_rows_alone() -> None:
    """evaluation.validation_fraction: what `fedsim reproduce` tunes on; the test measures keep their rows."""
    from fedsim.registry import LEARNERS

    assert LEARNERS.get("ldl").validation_split
    final = run_experiment(cfg_of("evaluation.validation_fraction=0.2", rounds=1)).history.final()
    assert np.isfinite(final["val/spearman"]) and np.isfinite(final["eval/spearman"])
    assert final["val/kl"] != final["eval/kl"]
    with_val = get_learner(RunSpec.from_config(cfg_of("evaluation.validation_fraction=0.2"))).split
    plain = get_learner(RunSpec.from_config(cfg_of())).split
    np.testing.assert_array_equal(with_val.test, plain.test)
    assert len(with_val.val) > 0 and not set(with_val.val) & (set(with_val.labelled) | set(with_val.unlabelled))
