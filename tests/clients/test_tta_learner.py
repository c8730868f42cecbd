"""The test-time adaptation learner in the engine: one stream segment per round, node-local method state,
norm parameters shared, and a run report that merges every node's block counts exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from clients.tta import build_method, norm_state
from clients.tta_learner import TTALearner
from clients.tta_source import source_model
from fedsim import config as C
from fedsim.cli import main
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment
from fedsim.threads import torch_threads

DOMAINS = "client.params.domains=[gaussian_noise,contrast,fog]"


def cfg_of(*overrides: str, rounds: int = 6, clients: int = 1) -> C.ExperimentConfig:
    cfg = C.load_config("lcotta", [DOMAINS, "client.params.cycles=2", "client.params.analysis_every=0",
                                   *overrides], {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


def test_centralised_run_equals_the_method_run_directly_on_the_stream() -> None:
    """Saving/loading the node-local state between rounds must not change anything: the engine's
    per-round online accuracy equals one uninterrupted pass of the method over the same stream."""
    cfg = cfg_of("client.params.method=lcotta", "client.params.method_params={rank: 2, snapshot_every: 2}")
    summary = run_experiment(cfg)
    learner: TTALearner = get_learner(RunSpec.from_config(cfg))
    model, _ = source_model(learner.recipe)
    method = build_method("lcotta", model, 10, {"rank": 2, "snapshot_every": 2})
    stream = learner.stream(0)
    direct = []
    with torch_threads(cfg.engine.threads_per_client):  # as the engine runs a client: sums are thread-count dependent
        for k in range(stream.num_segments):
            correct = n = 0
            for b in stream.segment(k):
                correct += int((method.forward_and_adapt(torch.from_numpy(b.x)).argmax(1) == torch.from_numpy(b.y)).sum())
                n += len(b.y)
            direct.append(correct / n)
    engine = [r.client_metrics[0]["acc"] for r in summary.history.records[1:]]
    assert engine == pytest.approx(direct, abs=1e-12)
    assert summary.history.records[-1].client_metrics[0]["method/projected"] == 1.0  # the projection did run
    # only the norm-layer affine parameters travel, and they moved
    assert set(summary.final_arrays) == set(norm_state(method.model))
    assert all(torch.equal(summary.final_arrays[k], v) for k, v in norm_state(method.model).items())


def test_same_seed_same_metrics_and_the_source_method_changes_nothing() -> None:
    first = run_experiment(cfg_of("client.params.method=tent"))
    again = run_experiment(cfg_of("client.params.method=tent"))
    assert first.history.as_rows() == again.history.as_rows()
    source = run_experiment(cfg_of("client.params.method=source"))
    init = get_learner(RunSpec.from_config(cfg_of("client.params.method=source"))).init_arrays()
    assert all(torch.equal(source.final_arrays[k], v) for k, v in init.items())
    assert any(not torch.equal(first.final_arrays[k], v) for k, v in init.items())
    # the source predicts the same whatever the cycle: block accuracy repeats only up to fresh noise
    accs = [r.client_metrics[0]["acc"] for r in source.history.records[1:]]
    assert len(accs) == 6 and accs[:3] != accs[3:]


def test_federated_report_merges_every_nodes_blocks_exactly() -> None:
    # lcotta with analysis: nodes whose windows fill at different times still reply with one key set
    cfg = cfg_of("client.params.method=lcotta", "client.params.method_params={rank: 2, snapshot_every: 2}",
                 "client.params.analysis_every=2", clients=3)
    summary = run_experiment(cfg)
    learner: TTALearner = get_learner(RunSpec.from_config(cfg))
    orders = [learner.stream(pid).domain_order for pid in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # each node its own domain order
    final = summary.history.final()
    records = summary.history.records[1:]
    n_total = sum(m["block/n"] for r in records for m in r.client_metrics.values())
    correct = sum(m["block/correct"] for r in records for m in r.client_metrics.values())
    assert final["tta/n"] == n_total == 6 * 500  # every pool image once per segment, split over nodes
    assert final["tta/accuracy"] == pytest.approx(correct / n_total, abs=1e-12)
    # per-domain accuracy gathers each node's block of that domain, whatever round it came in
    fog = [(m["block/correct"], m["block/n"]) for r in records for pid, m in r.client_metrics.items()
           if learner.stream(pid).describe(r.round - 1)[1] == "fog"]
    assert len(fog) == 3 * 2 and final["tta/domain/fog/accuracy"] == pytest.approx(
        sum(c for c, _ in fog) / sum(n for _, n in fog), abs=1e-12)
    # the engine's per-round accuracy is the example-weighted mean over nodes
    r1 = records[0]
    assert r1.metrics["train/acc"] == pytest.approx(
        sum(m["acc"] * m["block/n"] for m in r1.client_metrics.values()) / sum(m["block/n"] for m in r1.client_metrics.values()))


def test_lcotta_window_is_node_state_that_persists_across_rounds() -> None:
    summary = run_experiment(cfg_of("client.params.method=lcotta", "client.params.method_params={snapshot_every: 2}"))
    windows = [r.client_metrics[0]["method/window"] for r in summary.history.records[1:]]
    assert windows == sorted(windows) and windows[-1] > windows[0] > 0
    final = summary.history.final()
    assert final["tta/method/window"] == pytest.approx(np.mean(windows))  # run means of the diagnostics
    assert 0 < final["tta/method/explained_var"] <= 1


def test_tracked_run_logs_report_and_plots(tracking_uri) -> None:
    assert main(["run", "lcotta", DOMAINS, "client.params.cycles=1", "client.params.analysis_every=1",
                 "--rounds", "3", "--tracking-uri", tracking_uri, "--quiet"]) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    m = run.data.metrics
    assert 0 < m["tta/accuracy"] <= 1 and "tta/cycle/0/accuracy" in m and "eval/clean_accuracy" in m
    assert "tta/analysis/coherence_truthful" in m
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/tta_cycles.png", "plots/tta_blocks.png", "plots/tta_blocks.csv"} <= plots


@pytest.mark.parametrize("override,message", [
    ("client.params.method=dropout", "unknown tta method"),
    ("client.params.method_params={rank: 0}", "rank"),
    ("client.params.domains=[fogg]", "fogg"),
])
def test_bad_settings_are_one_line_errors(override, message) -> None:
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg_of(override))


def test_more_rounds_than_segments_names_the_right_number(capsys) -> None:
    code = main(["run", "lcotta", DOMAINS, "client.params.cycles=2", "--rounds", "7", "--no-tracking"])
    err = capsys.readouterr().err
    assert code == 2 and "set rounds=6" in err and "Traceback" not in err
