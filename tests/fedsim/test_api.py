"""The Python API: fedsim.run with dotted overrides, keyword shortcuts, ε, and the returned history and ledger."""

from __future__ import annotations

import pytest

import fedsim
from fedsim.api import _overrides
from fedsim.errors import ConfigError


def test_overrides_become_a_dotlist() -> None:
    assert _overrides({"client.lr": 0.1, "client.params.domains": ["fog", "snow"], "x": None,
                       "client.params.method_params": {"lr": 0.05, "rank": 2}}) == \
        ["client.lr=0.1", "client.params.domains=[fog,snow]", "x=null",
         "client.params.method_params.lr=0.05", "client.params.method_params.rank=2"]


def test_run_returns_the_history_and_the_privacy_ledger() -> None:
    cfg = fedsim.experiment_config("fedavg_digits", {"data.partition.name": "iid", "num_clients": 2}, eps=3)
    assert cfg.privacy.enabled and cfg.privacy.epsilon == 3.0 and cfg.num_clients == 2
    summary = fedsim.run("fedavg_digits", {"data.partition.name": "iid", "strategy.fraction_train": 1.0}, rounds=1,
                         num_clients=2, eps=3)
    rounds, acc = fedsim.curve(summary)
    assert rounds == [0, 1] and fedsim.final(summary) == acc[-1] and summary.run_id is None  # tracking off
    entries = summary.privacy_ledger.entries
    assert sorted(entries) == [0, 1] and all(e.rounds == 1 and 0 < e.epsilon <= 3.0 for e in entries.values())
    assert fedsim.final(summary, "privacy/epsilon_max") == max(e.epsilon for e in entries.values())
    with pytest.raises(KeyError, match="logged no"):
        fedsim.final(summary, "no/such_metric")
    with pytest.raises(ConfigError, match="no config key"):
        fedsim.run("fedavg_digits", {"client.no_such_key": 1})
