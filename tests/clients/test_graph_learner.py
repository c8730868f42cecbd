"""The ImGDA learner in the engine: seeds reproduce, node-local state makes rounds a mere cut of the epochs,
the federated variant shares prototypes exactly, the run report selects rounds, and a tracked run logs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from clients.graph_learner import PROTO_COUNT, PROTO_SUM, GraphDALearner
from fedsim import config as C
from fedsim.cli import main
from fedsim.contracts.history import History, RoundRecord
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

TINY = ["client.params.graph.num_features=8", "client.params.graph.source_nodes_per_class=40",
        "client.params.graph.target_nodes_per_class=25", "client.params.graph.source_p_in=0.15",
        "client.params.graph.target_p_in=0.12", "client.params.graph.source_p_out=0.01",
        "client.params.graph.target_p_out=0.02", "client.params.graph.num_classes=3", "client.params.hidden=8",
        "client.params.anchors=4", "client.params.walks=6", "client.params.epochs_per_round=2",
        "client.params.imbalance=4", "client.params.tail_classes=1"]


def cfg_of(*overrides: str, rounds: int = 2, clients: int = 1) -> C.ExperimentConfig:
    cfg = C.load_config("imgda", [*TINY, *overrides], {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


def test_same_seed_same_run_and_another_seed_differs() -> None:
    first = run_experiment(cfg_of("client.params.method=udagcn"))
    again = run_experiment(cfg_of("client.params.method=udagcn"))
    assert first.history.as_rows() == again.history.as_rows()
    assert all(torch.equal(first.final_arrays[k], again.final_arrays[k]) for k in first.final_arrays)
    other = run_experiment(cfg_of("client.params.method=udagcn", "seed=1"))
    assert other.history.as_rows() != first.history.as_rows()


@pytest.mark.parametrize("method", ["imgda", "dann"])
def test_rounds_only_cut_the_epochs_when_node_state_persists(method: str) -> None:
    """Without dropout, 2 rounds x 2 epochs = 1 round x 4 epochs exactly: the compensation vectors and
    Adam's moments persist in ctx.state and FedAvg over one node changes nothing."""
    two = run_experiment(cfg_of(f"client.params.method={method}", "client.params.dropout=0", rounds=2))
    one = run_experiment(cfg_of(f"client.params.method={method}", "client.params.dropout=0",
                                "client.params.epochs_per_round=4", rounds=1))
    assert all(torch.allclose(two.final_arrays[k], one.final_arrays[k], atol=1e-6) for k in one.final_arrays)
    # a fresh optimiser every round breaks it (so the check above can fail)
    fresh = run_experiment(cfg_of(f"client.params.method={method}", "client.params.dropout=0",
                                  "client.params.keep_optimizer_state=false", rounds=2))
    assert not all(torch.allclose(fresh.final_arrays[k], one.final_arrays[k], atol=1e-6) for k in one.final_arrays)


def test_federated_nodes_share_prototypes_and_the_target_trains_once_it_has_them() -> None:
    cfg = cfg_of("client.params.method=imgda", "strategy.fraction_evaluate=1.0", rounds=2, clients=3)
    summary = run_experiment(cfg)
    assert 0 <= summary.history.records[2].metrics["fed_eval/macro_f1"] <= 1  # each node scores its own graph
    learner: GraphDALearner = get_learner(RunSpec.from_config(cfg))
    task = learner.task
    assert len(task.sources) == 2 and task.sources[0].order != task.sources[1].order  # each its own class order
    r1, r2 = summary.history.records[1], summary.history.records[2]
    assert r1.client_metrics[2]["trained"] == 0.0 and r1.client_metrics[2]["holds_target"] == 1.0  # no prototypes yet
    assert r2.client_metrics[2]["trained"] == 1.0 and r2.client_metrics[2]["loss_cd"] > 0  # anchors = global prototypes
    assert all(r2.client_metrics[k]["loss_ce"] > 0 and r2.client_metrics[k]["loss_cd"] == 0 for k in (0, 1))
    # FedAvg of (sum / w, count / w) replies: counts add up to (source nodes) / (total weight)
    sources = sum(s.num_nodes for s in task.sources)
    target_weight = round(sources / 2)  # target_weight=1: one average source node
    counts = summary.final_arrays[PROTO_COUNT]
    assert float(counts.sum()) == pytest.approx(sources / (sources + target_weight), rel=1e-5)
    assert counts.tolist() == pytest.approx([n / (sources + target_weight) for n in task.pooled_sizes()], rel=1e-5)
    local, glob, classes = learner.global_prototypes(summary.final_arrays)
    assert classes.tolist() == [0, 1, 2] and local.shape == glob.shape == (3, 8)
    assert summary.final_arrays[PROTO_SUM].shape == (2, 3, 8)


def test_federated_prototypes_are_the_exact_pooled_class_means() -> None:
    """The replies' (sum / w, count / w) averaged with weights w give sum / count over all source nodes."""
    cfg = cfg_of("client.params.method=imgda", rounds=1, clients=3)
    learner: GraphDALearner = get_learner(RunSpec.from_config(cfg))
    learner.preflight()
    arrays = learner.init_arrays()
    from fedsim.contracts.learner import NodeContext

    replies = [learner.train(arrays, NodeContext(pid, 3, 1, cfg.seed)) for pid in range(3)]
    assert replies[2].num_examples == 0 and float(replies[2].arrays[PROTO_COUNT].abs().sum()) == 0.0
    total = sum(r.num_examples for r in replies)
    avg = {k: sum(r.arrays[k] * r.num_examples for r in replies) / total for k in (PROTO_SUM, PROTO_COUNT)}
    pooled_sum = sum(r.arrays[PROTO_SUM] * r.num_examples for r in replies[:2])
    pooled_count = sum(r.arrays[PROTO_COUNT] * r.num_examples for r in replies[:2])
    local, glob, _ = learner.global_prototypes(avg)
    assert torch.allclose(local, pooled_sum[0] / pooled_count.unsqueeze(1), atol=1e-5)
    assert torch.allclose(glob, pooled_sum[1] / pooled_count.unsqueeze(1), atol=1e-5)
    assert pooled_count.tolist() == pytest.approx([float(n) for n in learner.task.pooled_sizes()])


def test_final_report_selects_by_source_val_and_by_target_test() -> None:
    cfg = cfg_of("client.params.method=source")
    learner: GraphDALearner = get_learner(RunSpec.from_config(cfg))
    keys = ["target_macro_f1", "target_micro_f1", "target_head_f1", "target_tail_f1", "source_val_macro_f1"]

    def record(r: int, val: float, micro: float, macro: float) -> RoundRecord:
        m = {f"eval/{k}": 0.1 * r for k in keys}
        m.update({"eval/source_val_macro_f1": val, "eval/target_micro_f1": micro, "eval/target_macro_f1": macro})
        return RoundRecord(r, m)

    history = History([RoundRecord(0, {"eval/target_macro_f1": 0.0, "eval/source_val_macro_f1": 1.0}),
                       record(1, 0.9, 0.2, 0.25), record(2, 0.95, 0.3, 0.35), record(3, 0.95, 0.6, 0.55),
                       record(4, 0.5, 0.4, 0.45)])
    metrics, files = learner.final_report(history, None)
    assert files == []
    assert metrics["gda/source_val/round"] == 2.0 and metrics["gda/source_val/target_macro_f1"] == 0.35  # first best
    assert metrics["gda/target_test/round"] == 3.0 and metrics["gda/target_test/target_macro_f1"] == 0.55
    assert metrics["gda/target_macro_f1"] == 0.35 and metrics["gda/target_tail_f1"] == pytest.approx(0.2)
    assert metrics["gda/last/target_macro_f1"] == 0.45
    assert metrics["gda/selection_optimism"] == pytest.approx(0.2)
    learner.params.selection = "target_test"
    try:
        assert learner.final_report(history, None)[0]["gda/target_macro_f1"] == 0.55
    finally:
        learner.params.selection = "source_val"


@pytest.mark.slow
@pytest.mark.parallel
def test_tracked_run_logs_report_and_plots(tracking_uri) -> None:
    assert main(["run", "imgda", *TINY, "--rounds", "2", "--clients", "2", "--tracking-uri", tracking_uri,
                 "--quiet"]) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    m = run.data.metrics
    assert 0 <= m["gda/target_macro_f1"] <= 1 and "gda/target_test/target_macro_f1" in m
    assert "eval/target_tail_f1" in m and "eval/source_val_macro_f1" in m and "eval/target_f1_c0" in m
    assert run.data.params["gda.source0.class_sizes"].count("/") == 2
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/gda_f1_rounds.png", "plots/gda_class_f1.png", "plots/gda_rounds.csv",
            "plots/gda_class_sizes.png"} <= plots


def test_the_authors_citation_files_run_through_the_learner() -> None:
    fixtures = Path(__file__).parent.parent / "envs" / "fixtures"
    cfg = cfg_of("client.params.dataset=citation", f"client.params.citation_root={fixtures}",
                 "client.params.citation_source=tiny", "client.params.citation_target=tiny", "client.params.imbalance=1",
                 "client.params.anchors=2", rounds=1)
    summary = run_experiment(cfg)
    final = summary.history.final()
    assert 0 <= final["gda/target_macro_f1"] <= 1 and final["gda/source_val/round"] == 1.0  # no val node: NaN, round 1
    assert get_learner(RunSpec.from_config(cfg)).task.target.num_nodes == 6


@pytest.mark.parametrize("override,message", [
    ("client.params.method=gat", "unknown imgda method"),
    ("client.params.selection=best", "selection"),
    ("client.params.infer=both", "infer"),
    ("client.params.imbalance=0.5", "imbalance"),
    ("client.params.tail_classes=3", "tail_classes"),
    ("client.params.dataset=citation", "citation_root"),
    ("client.params.graph.target_p_in=2", "target_p_in"),
])
def test_bad_settings_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        run_experiment(cfg_of(override))
    assert "\n" not in str(err.value)


def test_federated_variant_needs_every_node_each_round() -> None:
    with pytest.raises(ConfigError, match="fraction_train"):
        run_experiment(cfg_of("strategy.fraction_train=0.5", clients=3))
