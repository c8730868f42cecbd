"""The ckarl learner in the engine: one federated node is the centralised loop exactly, seeds reproduce, the
server keeps theta_base and the pool global, and a tracked run logs the report and its plots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from algorithms.ckarl.config import build_method
from algorithms.ckarl.node import node_task, run_stream
from clients.rl_learner import RLLearner
from fedsim import config as C
from fedsim.cli import main
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment

TINY = ["client.params.tasks=[plain,swap,plain]", "client.params.ppo.num_steps=32", "client.params.ppo.update_epochs=2",
        "client.params.steps_per_task=512", "client.params.rounds_per_task=2", "client.params.ckarl.k_max=2",
        "client.params.eval_episodes=2"]


def cfg_of(*overrides: str, clients: int = 1, seed: int = 0, reference: bool = False) -> C.ExperimentConfig:
    cfg = C.load_config("ckarl", [*TINY, f"client.params.reference={str(reference).lower()}", *overrides],
                        {"rounds": 6, "clients": clients, "seed": seed})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    return cfg


@pytest.mark.parametrize("method", ["ckarl", "ftn"])
def test_one_federated_node_is_the_centralised_run(method: str) -> None:
    """Engine + ckarl strategy + node state in ctx.state == the plain centralised loop, bit for bit
    (CKA-RL's merge at the end of task 3 included: K_max = 2, three tasks)."""
    cfg = cfg_of(f"client.params.method={method}")
    summary = run_experiment(cfg)
    learner: RLLearner = get_learner(RunSpec.from_config(cfg))
    arrays, records = run_stream(learner.p, cfg.seed, threads=cfg.engine.threads_per_client)
    assert set(summary.final_arrays) == set(arrays)
    for key, value in arrays.items():
        assert torch.equal(summary.final_arrays[key], value), key
    engine_curves = [[r.client_metrics[0][f"curve/{i}"] for i in range(2)] for r in summary.history.records[1:]]
    np.testing.assert_array_equal(engine_curves, [[m[f"curve/{i}"] for i in range(2)] for m in records])
    if method == "ckarl":
        assert summary.history.final()["eval/pool_size"] == 2.0  # null + v1 + v2 merged back to K_max


def test_seeds_reproduce_and_differ() -> None:
    first = run_experiment(cfg_of())
    again = run_experiment(cfg_of())
    other = run_experiment(cfg_of(seed=1))
    assert first.history.as_rows() == again.history.as_rows()
    assert first.history.as_rows() != other.history.as_rows()


def test_federated_nodes_share_only_the_trained_keys() -> None:
    cfg = cfg_of(clients=3)
    summary = run_experiment(cfg)
    learner: RLLearner = get_learner(RunSpec.from_config(cfg))
    tasks = [node_task(learner.p, cfg.seed, 1, pid, 3) for pid in range(3)]
    assert len({tuple(t.physics.values()) for t in tasks}) == 3  # each node its own physics
    records = summary.history.records
    assert all(len(r.client_metrics) == 3 for r in records[1:])
    # theta_base is trained in task 1 (rounds 1-2) and then frozen on the server
    final, m = summary.final_arrays, build_method(learner.p, cfg.seed)
    assert not torch.equal(final["base"], m.init_arrays()["base"])
    rows = learner.matrices(summary.history)
    assert rows is not None and rows["R_ret"].shape == (3, 3) and np.isfinite(rows["R_ret"]).all()
    assert list(rows["pool"]) == [1.0, 2.0, 2.0] and list(rows["memory"])[1:] == [3 * m.actor_mlp.numel] * 2


def test_ft1_and_ftn_train_identically_scratch_restarts() -> None:
    ft1 = run_experiment(cfg_of("client.params.method=ft1"))
    ftn = run_experiment(cfg_of("client.params.method=ftn"))
    scratch = run_experiment(cfg_of("client.params.method=scratch"))
    curve = lambda s: [r.client_metrics[0]["ret"] for r in s.history.records[1:]]  # noqa: E731
    assert curve(ft1) == curve(ftn)  # FT-N is FT-1 plus a stored copy per task
    assert torch.equal(ft1.final_arrays["actor"], ftn.final_arrays["actor"])
    assert torch.equal(ftn.final_arrays["copies"][2], ftn.final_arrays["actor"])
    assert curve(scratch)[:2] == curve(ftn)[:2] and curve(scratch)[2:] != curve(ftn)[2:]  # same first task only
    # evaluation: FT-N keeps each task's copy, FT-1 only its latest actor
    fin1, finn = ft1.history.final(), ftn.history.final()
    assert fin1["eval/ret_t0"] == fin1["eval/latest_ret_t0"]
    assert finn["rl/memory_params"] == 3 * fin1["rl/memory_params"]


@pytest.mark.slow
@pytest.mark.parallel
def test_tracked_run_logs_the_report_and_plots(tracking_uri, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path / "cache"))
    assert main(["run", "ckarl", *TINY, "--rounds", "6", "--tracking-uri", tracking_uri, "--quiet"]) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    m = run.data.metrics
    for key in ("rl/perf", "rl/final_policy", "rl/perf_train", "rl/init_return", "rl/fwt_return",
                "rl/memory_params", "rl/pool_size", "eval/succ_t2", "rl/cl/forgetting", "rl/greedy_return_min",
                "rl/perf_return_min", "rl/task/2/final_return", "eval/greedy_ret_t2", "rl/fwt_conflict"):
        assert key in m, key
    assert "rl/fwt_similar" not in m  # plain, swap, plain: every later task conflicts with the one before it
    assert m["rl/greedy_return_min"] == min(m[f"eval/greedy_ret_t{j}"] for j in range(3))
    assert 0 <= m["rl/perf"] <= 1 and m["rl/pool_size"] == 2
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/rl_curves.png", "plots/rl_matrix_r.png", "plots/rl_matrix_l.png", "plots/rl_memory.png",
            "plots/rl_report.csv"} <= plots
    assert list((tmp_path / "cache" / "rl-reference").glob("*.pt"))  # the reference was cached
    # the learner owns its environment: the unused data/model sections are not logged as the run's setup
    assert "dataset" not in run.data.tags and not any(k.startswith(("data.", "model.")) for k in run.data.params)
    assert run.data.params["client.params.method"] == "ckarl"


@pytest.mark.parametrize("override,flags,message", [
    ("client.params.method=prognet", {}, "method must be one of"),
    ("client.params.steps_per_task=500", {}, "multiple of"),
    ("strategy.name=fedavg", {}, "strategy.name=ckarl"),
    ("client.params.tasks=[plain,mirror]", {}, "unknown conflict"),
    ("seed=0", {"rounds": 5}, "set rounds=6"),
])
def test_bad_settings_are_one_line_errors(override, flags, message) -> None:
    cfg = C.load_config("ckarl", [*TINY, override], {"rounds": 6, **flags})
    cfg.tracking.enabled = False
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg)
