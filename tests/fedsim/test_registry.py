"""The registry: lookup errors list known names; params validated against dataclasses."""

from __future__ import annotations

import pytest

from fedsim.errors import ConfigError
from fedsim.registry import DATASETS, LEARNERS, MODELS, PARTITIONERS, STRATEGIES


def test_builtins_registered() -> None:
    assert {"mnist", "digits", "synthetic"} <= set(DATASETS.names())
    assert {"iid", "dirichlet", "pathological", "shard"} <= set(PARTITIONERS.names())
    assert {"mlp", "cnn"} <= set(MODELS.names())
    assert "supervised" in LEARNERS.names() and "fedavg" in STRATEGIES.names()


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ConfigError, match="unknown model .resnet.*cnn.*mlp"):
        MODELS.get("resnet")


def test_params_validated_by_key() -> None:
    assert MODELS.params("mlp", {"hidden": [32, 16]}, "model.params").hidden == [32, 16]
    with pytest.raises(ConfigError, match=r"model.params.hiden.*accepts: hidden"):
        MODELS.params("mlp", {"hiden": [3]}, "model.params")
    with pytest.raises(ConfigError, match="model.params.dropout"):
        MODELS.params("mlp", {"dropout": "lots"}, "model.params")
    with pytest.raises(ConfigError, match="takes no params"):
        STRATEGIES.params("fedavg", {"x": 1}, "strategy.params")
