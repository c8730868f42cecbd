"""privacy.release: what a DP run releases without DP is declared in the run, and strict withholds it
(ledger keys only in replies, uniform weights, no setup sizes or label plots, no client-side eval)."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment
from privacy.release import reply_metrics, statement

DP = ["data.name=digits", "model.name=mlp", "data.partition.name=dirichlet", "data.partition.alpha=0.5",
      "client.local_steps=2", "privacy.enabled=true", "privacy.epsilon=3.0", "strategy.fraction_train=1.0"]


def cfg_of(*overrides: str) -> C.ExperimentConfig:
    cfg = C.load_config("fedavg", [*DP, *overrides], {"rounds": 2, "clients": 3})
    cfg.tracking.enabled = False
    return cfg


def test_reply_metrics_strict_keeps_ledger_keys_and_weight_one() -> None:
    metrics = {"train_loss": 0.7, "local_steps": 2.0, "privacy/steps": 2.0, "privacy/epsilon": 0.4}
    assert reply_metrics(cfg_of(), metrics, 120) == (metrics, 120)
    assert reply_metrics(cfg_of("privacy.release=strict"), metrics, 120) == (
        {"privacy/steps": 2.0, "privacy/epsilon": 0.4}, 1)


@pytest.mark.slow
@pytest.mark.parallel
def test_strict_run_withholds_and_says_so(tracking_uri) -> None:
    common = ["run", "fedavg", *DP, "--rounds", "2", "--clients", "3", "--tracking-uri", tracking_uri, "--quiet"]
    assert main([*common, "privacy.release=strict"]) == 0
    assert main(common) == 0
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    by_mode = {r.data.params["privacy.release"]: r for r in runs}
    strict, standard = by_mode["strict"], by_mode["standard"]
    assert "train/loss" in standard.data.metrics and "train/loss" not in strict.data.metrics
    assert any(k.startswith("data.size.") for k in standard.data.params)
    assert not any(k.startswith("data.size.") for k in strict.data.params)
    files = {r: {a.path for a in client.list_artifacts(r.info.run_id)} |
             {a.path for a in client.list_artifacts(r.info.run_id, "plots")} for r in (strict, standard)}
    assert "plots/label_histogram.png" in files[standard] and "plots/label_histogram.png" not in files[strict]
    assert "privacy_release.md" in files[strict] and "privacy_release.md" in files[standard]
    text = open(client.download_artifacts(strict.info.run_id, "privacy_release.md")).read()
    assert "privacy.release=strict" in text and "Withheld" in text
    # the ledger is the same (same plans and steps); uniform weights give another model than size weights
    assert strict.data.metrics["privacy/epsilon_max"] == standard.data.metrics["privacy/epsilon_max"] <= 3.0
    assert strict.data.metrics["eval/loss"] != standard.data.metrics["eval/loss"]


def test_strict_refuses_client_side_evaluation() -> None:
    with pytest.raises(ConfigError, match="strict withholds metrics on the clients' own data"):
        cfg_of("privacy.release=strict", "strategy.fraction_evaluate=0.5")


def test_release_must_be_known() -> None:
    with pytest.raises(ConfigError, match="privacy.release must be 'standard' or 'strict'"):
        cfg_of("privacy.release=open")


def test_removed_amplification_key_says_why(capsys) -> None:
    code = main(["run", "fedavg", *DP, "privacy.amplify_client_sampling=true", "--no-tracking"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "privacy.amplify_client_sampling was removed" in err[0] and "not a sound bound" in err[0]


def test_statement_lists_what_standard_releases() -> None:
    text = statement(cfg_of())
    assert "Released WITHOUT DP protection" in text and "training loss" in text and "label histogram" in text
    assert "sampling rate" in text  # the per-client rate and σ reveal sizes in every mode
