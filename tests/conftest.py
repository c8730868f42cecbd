"""Test-wide environment: quiet Flower/Ray/MLflow, no telemetry, results in a temp dir."""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.pop("MLFLOW_TRACKING_URI", None)

import pytest  # noqa: E402


@pytest.fixture
def tracking_uri(tmp_path) -> str:
    """A fresh sqlite MLflow store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test from an empty working directory (the default store goes there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
