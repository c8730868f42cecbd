"""Calibration and the ledger agree with Opacus' own accountants."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from fedsim.contracts.history import RoundRecord
from fedsim.errors import ConfigError
from privacy.accounting import calibrate_noise, epsilon_for, poisson_sample_rate
from privacy.ledger import NOISE, SAMPLE_RATE, STEPS, PrivacyLedger


def test_sample_rate_is_opacus_loader_rate() -> None:
    assert poisson_sample_rate(1000, 128) == 1 / 8
    assert poisson_sample_rate(100, 128) == 1.0
    assert poisson_sample_rate(256, 128) == 0.5


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_calibrated_sigma_meets_target_tightly(accountant: str) -> None:
    q, steps, delta = 1 / 8, 100, 1e-5
    sigma = calibrate_noise(3.0, delta, q, steps, accountant)
    eps = epsilon_for(sigma, q, steps, delta, accountant)
    assert eps <= 3.0
    assert eps > 2.8  # not wastefully noisy
    assert epsilon_for(sigma * 0.9, q, steps, delta, accountant) > 3.0


def test_epsilon_equals_opacus_accountant() -> None:
    for cls, name in ((RDPAccountant, "rdp"), (PRVAccountant, "prv")):
        acc = cls()
        acc.history = [(1.1, 0.05, 200)]
        assert epsilon_for(1.1, 0.05, 200, 1e-5, name) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)


def test_unreachable_budget_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot reach"):
        calibrate_noise(1e-6, 1e-5, 1.0, 10_000, "rdp")


def test_ledger_accumulates_and_reports_max_and_mean() -> None:
    ledger = PrivacyLedger(num_clients=3, delta=1e-5, accountant="rdp")
    for rnd, clients in ((1, (0, 1)), (2, (0,))):
        rec = RoundRecord(rnd, client_metrics={c: {STEPS: 10, SAMPLE_RATE: 0.1, NOISE: 1.0} for c in clients})
        ledger.on_round(rec)
    e0, e1, e2 = (ledger.entries[k] for k in range(3))
    assert (e0.rounds, e0.steps, e1.rounds, e1.steps, e2.steps) == (2, 20, 1, 10, 0)
    acc = RDPAccountant()
    acc.history = [(1.0, 0.1, 20)]
    assert e0.epsilon == pytest.approx(acc.get_epsilon(delta=1e-5))
    assert rec.metrics["privacy/epsilon_max"] == e0.epsilon
    assert rec.metrics["privacy/epsilon_mean"] == pytest.approx((e0.epsilon + e1.epsilon) / 3)
    assert e2.epsilon == 0.0 and not math.isnan(e1.epsilon)


def test_ledger_csv_columns(tmp_path) -> None:
    ledger = PrivacyLedger(2, 1e-5, "rdp")
    ledger.record(1, 5, 0.2, 1.5)
    text = ledger.write_csv(tmp_path / "privacy_ledger.csv").read_text().splitlines()
    assert text[0] == "client,rounds,steps,sample_rate,noise_multiplier,delta,epsilon"
    assert text[2].startswith("1,1,5,0.2,1.5,1e-05,")


def test_calibrated_sigma_is_cached_on_disk_and_checked(tmp_path, monkeypatch) -> None:
    """A second process reuses the σ found by the search; a cached σ too small for the target is not used."""
    import json

    from privacy import accounting as A

    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path))
    args = (2.0, 1e-5, 0.05, 40, "rdp")
    A.calibrate_noise.cache_clear()
    sigma = A.calibrate_noise(*args)
    (entry,) = (tmp_path / "dp-sigma").glob("*.json")
    assert json.loads(entry.read_text()) == {"sigma": sigma}
    entry.write_text(json.dumps({"sigma": sigma * 1.5}))  # a different, still valid, cached value is used as is
    A.calibrate_noise.cache_clear()
    assert A.calibrate_noise(*args) == sigma * 1.5
    entry.write_text(json.dumps({"sigma": sigma / 3}))  # too little noise for the target: searched again
    A.calibrate_noise.cache_clear()
    assert A.calibrate_noise(*args) == sigma
    entry.write_text("not json")
    A.calibrate_noise.cache_clear()
    assert A.calibrate_noise(*args) == sigma
    A.calibrate_noise.cache_clear()
