"""Test-wide environment: quiet Flower/Ray/MLflow, no telemetry, results in a temp dir."""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.pop("MLFLOW_TRACKING_URI", None)

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def tracking_uri(tmp_path) -> str:
    """A fresh sqlite MLflow store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test from an empty working directory (the default store goes there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module, restored afterwards (use with ``pytestmark``).

    Tiny batches gain nothing from intra-op threads, and on a busy 2-core box OpenMP barriers
    make a 2-thread step up to ~40x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items) -> None:
    """`make test` runs two pytest-xdist workers (``-n 2 --dist loadgroup``): the slow end-to-end
    tests (Ray, Flower, subprocesses, signals, deadlines) share one worker and run one at a time,
    so no two Ray clusters or timing-sensitive runs overlap; the other tests fill both workers.

    A slow test also marked ``parallel`` (long, but it starts no Ray cluster, subprocess, signal or
    deadline check) stays in the shared pool: the one-at-a-time group is the suite's critical path
    (~610 s of its ~1,120 s of test time before these moved out), so it holds only what needs it.
    """
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("parallel") is None:
            item.add_marker(pytest.mark.xdist_group("slow"))
