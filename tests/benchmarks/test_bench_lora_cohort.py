"""benchmarks/bench_lora_cohort.py: the random-encoder setting runs without the MiniLM wheel and compares both paths."""

from __future__ import annotations

import pytest

from tests.script_modules import load_script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_lora_cohort.py", register=True)


@pytest.fixture
def registries():
    """The benchmark's model and dataset registrations are removed afterwards (other tests list every entry)."""
    from fedsim.registry import DATASETS, MODELS

    before = {r: dict(r._entries) for r in (MODELS, DATASETS)}
    yield
    for registry, entries in before.items():
        registry._entries.clear()
        registry._entries.update(entries)


@pytest.mark.parametrize("dp", [False, True])
def test_random_encoder_setting_times_both_paths_and_they_agree(bench, registries, dp) -> None:
    bench.register_random_setting()
    bench.register_random_setting()  # idempotent
    r = bench.measure(clients=2, steps=1, batch=4, max_len=8, device="cpu", threads=1, repeat=1, random_encoder=True,
                      dp=dp)  # repeat 1 runs each path twice (warm-up): fresh privacy contexts each time
    assert r["sequential_s"] > 0 and r["cohort_s"] > 0
    assert r["speedup"] == pytest.approx(r["sequential_s"] / r["cohort_s"])
    assert r["max_dw"] <= 1e-5  # the cohort is the sequential round (dropout masks included)


def test_bad_arguments_exit_with_one_line(bench) -> None:
    with pytest.raises(SystemExit, match="--clients needs sizes >= 2"):
        bench.main(["--clients", "1"])
    with pytest.raises(SystemExit, match="comma list of integers"):
        bench.main(["--clients", "two"])
