"""DP-SGD end to end: the budget holds, the ledger matches the accountant, adapters stay finite."""

from __future__ import annotations

import csv

import pytest
import torch
from mlflow import MlflowClient

from fedsim import config as C
from fedsim.cli import main
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError
from fedsim.registry import LEARNERS
from fedsim.runner import run_experiment
from privacy.accounting import epsilon_for
from strategies.lora import A_SUFFIX, B_SUFFIX, BASE_SUFFIX

DIGITS = ["data.name=digits", "model.name=mlp", "data.partition.name=iid", "client.local_steps=3"]
TINY_TEXT = ["data.params.max_len=16", "data.params.per_class=30", "client.local_steps=2", "client.batch_size=8",
             "privacy.max_physical_batch_size=8", "engine.threads_per_client=1", "strategy.fraction_train=1.0"]


def cfg_of(name: str, *overrides: str, **flags) -> C.ExperimentConfig:
    cfg = C.load_config(name, list(overrides), flags)
    cfg.tracking.enabled = False
    return cfg


def test_fedavg_eps_run_logs_ledger_matching_accountant(tracking_uri, capsys) -> None:
    assert main(["run", "fedavg", *DIGITS, "--eps", "3", "--rounds", "2", "--clients", "3",
                 "--tracking-uri", tracking_uri, "--quiet"]) == 0
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.data.metrics["privacy/epsilon_max"] <= 3.0
    assert run.data.params["privacy.target_epsilon"] == "3.0" and float(run.data.params["privacy.noise_multiplier"]) > 0
    path = client.download_artifacts(run.info.run_id, "privacy_ledger.csv")
    rows = list(csv.DictReader(open(path)))
    assert [r["client"] for r in rows] == ["0", "1", "2"]
    for r in rows:
        eps = epsilon_for(float(r["noise_multiplier"]), float(r["sample_rate"]), int(r["steps"]), float(r["delta"]), "prv")
        assert float(r["epsilon"]) == pytest.approx(eps, rel=1e-12)
        assert int(r["rounds"]) == 2 and int(r["steps"]) == 6 and eps <= 3.0
    assert max(float(r["epsilon"]) for r in rows) == pytest.approx(run.data.metrics["privacy/epsilon_max"])


def test_dp_runs_are_reproducible_and_noisier_than_plain() -> None:
    a = run_experiment(cfg_of("fedavg", *DIGITS, "privacy.enabled=true", "privacy.epsilon=1.0", rounds=2, clients=3))
    b = run_experiment(cfg_of("fedavg", *DIGITS, "privacy.enabled=true", "privacy.epsilon=1.0", rounds=2, clients=3))
    plain = run_experiment(cfg_of("fedavg", *DIGITS, rounds=2, clients=3))
    assert a.history.as_rows() == b.history.as_rows()
    assert a.history.final()["eval/loss"] != plain.history.final()["eval/loss"]


def test_budget_exhausted_client_refuses_to_train() -> None:
    from flwr.app import MetricRecord, RecordDict

    from fedsim.contracts.learner import NodeContext
    from clients.supervised import DP_STATE, PrivacyBudgetExhausted

    cfg = cfg_of("fedavg", *DIGITS, "privacy.enabled=true", "privacy.epsilon=2.0", rounds=2, clients=2)
    learner = LEARNERS.get("supervised")(cfg, LEARNERS.params("supervised", {}, "client.params"))
    plan = learner.privacy_plan(0)
    state = RecordDict({DP_STATE: MetricRecord({"steps": plan.total_steps})})
    ctx = NodeContext(partition_id=0, num_partitions=2, server_round=3, root_seed=0, state=state)
    with pytest.raises(PrivacyBudgetExhausted, match="budget exhausted"):
        learner.train(learner.init_arrays(), ctx)


def test_delta_must_be_below_one_over_n() -> None:
    cfg = cfg_of("fedavg", *DIGITS, "privacy.enabled=true", "privacy.epsilon=3.0", "privacy.delta=0.01", rounds=1, clients=3)
    with pytest.raises(ConfigError, match=r"privacy.delta=0.01 is not below 1/n"):
        run_experiment(cfg)


def test_eps_rejected_for_learner_without_dp(capsys) -> None:
    from clients.supervised import SupervisedLearner

    @LEARNERS.register("no_dp_test_learner")
    class NoDP(SupervisedLearner):
        supports_dp = False

    code = main(["run", "fedavg", "client.learner=no_dp_test_learner", "--eps", "3", "--no-tracking"])
    assert code == 2
    assert "has no differential privacy" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parallel
def test_fedphoenix_under_dp_spends_what_fedavg_spends() -> None:
    """The reset is data-independent: the same plan, steps and ε as FedAvg under DP."""
    common = ["data.name=digits", "client.local_steps=2", "strategy.fraction_train=0.5", "model.params.channels=[64,64]",
              "privacy.enabled=true", "privacy.epsilon=3.0", "privacy.accountant=rdp"]
    phx = run_experiment(cfg_of("fedphoenix", *common, rounds=2, clients=4))
    avg = run_experiment(cfg_of("fedphoenix", *common, "strategy.name=fedavg", rounds=2, clients=4))
    assert phx.history.final()["privacy/epsilon_max"] == avg.history.final()["privacy/epsilon_max"] <= 3.0
    assert any(r.metrics != avg.history.records[i].metrics for i, r in enumerate(phx.history.records[1:], 1))


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_fedsvd_dp_adapter_is_finite_changes_and_keeps_base() -> None:
    cfg = cfg_of("fedsvd", *TINY_TEXT, rounds=2, clients=2)
    summary = run_experiment(cfg)
    init = get_learner(RunSpec.from_config(cfg)).init_arrays()
    final = summary.final_arrays
    assert all(torch.isfinite(v).all() for v in final.values())
    b_keys = [k for k in final if k.endswith(B_SUFFIX)]
    assert b_keys and all(final[k].abs().sum() > 0 for k in b_keys)  # B left zero-init
    for k in final:
        if k.endswith(BASE_SUFFIX):
            assert torch.equal(final[k], init[k]), k  # FedSVD never touches W
        if k.endswith(A_SUFFIX):
            a = final[k].double()
            torch.testing.assert_close(a @ a.T, torch.eye(a.shape[0], dtype=torch.float64), atol=1e-4, rtol=0)
    acc = [v for _, v in summary.history.series("eval/accuracy")]
    assert acc[-1] != acc[0]
    assert summary.history.final()["privacy/epsilon_max"] <= 3.0


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(300)
def test_fedsvd_without_refactor_and_dp_equals_ffa_lora() -> None:
    base = [*TINY_TEXT, "privacy.enabled=false"]
    svd_off = run_experiment(cfg_of("fedsvd", *base, "strategy.params.svd_period=0", rounds=2, clients=2))
    ffa = run_experiment(cfg_of("fedsvd", *base, "strategy.name=ffa_lora", "strategy.params={}", rounds=2, clients=2))
    assert svd_off.history.as_rows() == ffa.history.as_rows()
    assert all(torch.equal(v, ffa.final_arrays[k]) for k, v in svd_off.final_arrays.items())


def test_batchnorm_becomes_groupnorm_under_dp_and_is_logged(caplog) -> None:
    from torch import nn

    cfg = cfg_of("fedavg", "data.name=digits", "data.partition.name=iid", "model.params.norm=batch",
                 "client.local_steps=2", "privacy.enabled=true", "privacy.epsilon=5.0", rounds=1, clients=2)
    with caplog.at_level("WARNING", logger="fedsim"):
        summary = run_experiment(cfg)
    assert any("BatchNorm2d" in m and "GroupNorm" in m for m in caplog.messages)
    assert not any(k.endswith("running_mean") for k in summary.final_arrays)  # no BatchNorm left
    assert summary.history.final()["privacy/epsilon_max"] <= 5.0
    plain = get_learner(RunSpec.from_config(cfg_of("fedavg", "data.name=digits", "model.params.norm=batch")))
    assert any(isinstance(m, nn.BatchNorm2d) for m in plain.model.modules())  # without DP it stays BatchNorm


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fedsvd_dp_on_flower_engine_matches_local() -> None:
    """The main job's stack (MiniLM + LoRA, Opacus, FedSVD) on Flower's Ray runtime, bit-identical."""
    over = [*TINY_TEXT, "engine.flower.ray_num_cpus=2"]
    local = run_experiment(cfg_of("fedsvd", *over, "engine.vectorise=false", rounds=1, clients=2))  # one by one
    flower = run_experiment(cfg_of("fedsvd", *over, rounds=1, clients=2, engine="flower"))
    assert flower.history.as_rows() == local.history.as_rows()
    assert flower.history.final()["privacy/epsilon_max"] <= 3.0


def test_client_level_dp_through_flower_wrapper() -> None:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from fedsim.engine.server import build_strategy

    over = ["data.name=digits", "model.name=mlp", "data.partition.name=iid", "client.local_steps=2",
            "privacy.enabled=true", "privacy.level=client", "privacy.epsilon=4.0", "privacy.delta=0.01"]
    cfg = cfg_of("fedavg", *over, rounds=3, clients=20)
    assert isinstance(build_strategy(RunSpec.from_config(cfg)), DifferentialPrivacyServerSideFixedClipping)
    a = run_experiment(cfg)
    b = run_experiment(cfg_of("fedavg", *over, rounds=3, clients=20))
    assert a.history.as_rows() == b.history.as_rows()  # server noise is seeded
    eps = [v for _, v in a.history.series("privacy/epsilon_max")]
    assert eps == sorted(eps) and 0 < eps[-1] <= 4.0
    assert eps[-1] == pytest.approx(a.history.final()["privacy/epsilon_mean"])  # every client charged alike
    assert all(torch.isfinite(v).all() for v in a.final_arrays.values())
    with pytest.raises(ConfigError, match="privacy.level=client needs"):
        run_experiment(cfg_of("fedsvd", *TINY_TEXT, "privacy.level=client", "privacy.delta=0.01", rounds=1, clients=2))


def test_dp_cohorts_on_the_local_engine_match_one_by_one_opacus(caplog) -> None:
    """engine.vectorise=true trains a DP round's cohort together (clients/vectorised.py): the same run
    as Opacus client by client, to float tolerance, with exactly the same privacy ledger."""
    dp = [*DIGITS, "data.partition.name=dirichlet", "data.partition.alpha=1.0", "data.partition.min_partition_size=5",
          "privacy.enabled=true", "privacy.epsilon=3.0", "strategy.fraction_train=1.0"]
    one_by_one = run_experiment(cfg_of("fedavg", *dp, "engine.vectorise=false", rounds=2, clients=5))
    with caplog.at_level("WARNING", logger="fedsim"):
        together = run_experiment(cfg_of("fedavg", *dp, "engine.vectorise=true", rounds=2, clients=5))
    assert "one by one" not in caplog.text  # the cohort was vectorised, not refused
    a, b = one_by_one.history.as_rows(), together.history.as_rows()
    assert [r.keys() for r in a] == [r.keys() for r in b]
    for ra, rb in zip(a, b):
        for k in ra:
            if k.startswith("privacy/"):
                assert rb[k] == ra[k], k
            else:
                assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), k
    assert a[-1]["privacy/epsilon_max"] <= 3.0
