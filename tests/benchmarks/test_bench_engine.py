"""benchmarks/bench_engine.py: the smallest runs, checking the rows and that the systems do the same work."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.script_modules import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_engine.py", register=True)  # its functions go to Ray workers by value


@pytest.fixture
def tiny() -> str:
    """An 8-client tiny-MLP workload (the real ones take longer than a test should)."""
    return "mlp-8"


def test_in_process_systems_rows_and_same_work(bench, tiny, tmp_path) -> None:
    systems = ["raw", "local", "sequential", "vectorise"]
    report = bench.run_benchmark([tiny], systems, rounds=2)
    rows = {r.system: r for r in report.rows}
    assert list(rows) == systems
    assert report.rounds == 2 and report.cpu_count
    raw, local, seq = rows["raw"], rows["local"], rows["sequential"]
    for r in (raw, local, seq):
        assert r.available and r.total_s > 0 and 0 < r.rounds_s <= r.total_s and r.later_round_s > 0
        assert 0.0 <= r.accuracy <= 1.0
    # the raw loop does exactly fedsim's work: the same final global model, hence the same accuracy
    assert seq.max_weight_diff == 0.0 and seq.accuracy == raw.accuracy
    # as shipped (engine.vectorise=auto) a tiny MLP cohort is vectorised: the same model to float tolerance
    assert local.note == "auto: vectorised" and local.max_weight_diff < 1e-5
    assert local.fedsim_over_raw == pytest.approx(local.total_s / raw.total_s)
    assert local.flower_over_fedsim is None  # stock Flower not run
    vec = rows["vectorise"]  # measured once the vectorised path exists, n/a (with a reason) before
    assert vec.available or vec.note.startswith("n/a (")
    if vec.available:
        assert vec.max_weight_diff is not None and vec.max_weight_diff < 1e-5
    bench.print_report(report)
    out = tmp_path / "rows.csv"
    bench.write_csv(report, out)
    with open(out) as fh:
        written = list(csv.DictReader(fh))
    assert [w["system"] for w in written] == systems
    assert float(written[1]["fedsim_over_raw"]) == pytest.approx(local.fedsim_over_raw)


def test_a_failing_system_is_reported_not_raised(bench, tiny, monkeypatch) -> None:
    def broken(cfg):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "run_raw", broken)
    report = bench.run_benchmark([tiny], ["raw", "local"], rounds=1)
    raw, local = report.rows
    assert not raw.available and raw.note == "n/a (RuntimeError: boom)"
    assert local.available and local.fedsim_over_raw is None


def test_workload_names(bench) -> None:
    assert bench.get_workload("mlp-1000") == bench.WORKLOADS["mlp-1000"]
    assert bench.get_workload("cnn-7").num_clients == 7
    with pytest.raises(ValueError, match="unknown workload"):
        bench.get_workload("rnn-5")
    report = bench.run_benchmark(["cnn-9999"], ["raw", "local"], rounds=1)  # more clients than MNIST images
    assert [r.available for r in report.rows] == [False, False]
    assert all("num_clients=9999" in r.note for r in report.rows)


def test_targets(bench) -> None:
    rows = [bench.Row("mlp-100", "raw", 1.0),
            bench.Row("mlp-100", "local", 1.20, fedsim_over_raw=1.20, note="auto: sequential"),
            bench.Row("mlp-100", "sequential", 1.25, fedsim_over_raw=1.25),
            bench.Row("mlp-100", "vectorise", 0.5, fedsim_over_raw=0.5),
            bench.Row("mlp-100", "ray", 3.0, fedsim_over_raw=3.0),
            bench.Row("cnn-100", "raw", 1.0), bench.Row("cnn-100", "local", 1.05, fedsim_over_raw=1.05),
            bench.Row("mlp-1000", "local", 10.0, flower_over_fedsim=12.0),
            bench.Row("mlp-1000", "sequential", 10.0),
            bench.Row("mlp-1000", "vectorise", note="n/a (not built)")]
    got = {t[0]: (t[1], t[2]) for t in bench.targets(rows)}
    # the overhead target is the local engine's as shipped; what auto chose, the sequential ratio and the
    # best engine are named beside it
    assert got["mlp-100: fedsim local/raw <= 1.10"] == (
        "1.20 (1 run(s), no interval; auto: sequential; sequential 1.25; best: fedsim local+vectorise 0.50)",
        "NOT met")
    assert got["cnn-100: fedsim local/raw <= 1.10"] == ("1.05 (1 run(s), no interval)", "met")
    assert got["mlp-1000: flower/fedsim >= 10"] == ("12.0 (fedsim local)", "met")
    assert got["mlp-1000: vectorised >= 3x sequential"] == ("n/a", "not measured")
    # the sequential path (DP, CNN, LoRA and regime runs take it) has its own target at 100 and 1,000 clients
    assert got["mlp-100: fedsim local, sequential/raw <= 1.10"] == ("1.25 (1 run(s), no interval)", "NOT met")
    assert got["mlp-1000: fedsim local, sequential/raw <= 1.10"] == ("n/a", "not measured")
    assert "cnn-100: fedsim local, sequential/raw <= 1.10" not in got  # not measured in this report


def test_median_ci_is_the_order_statistic_interval(bench) -> None:
    assert bench.median_ci([1.0]) is None
    # n=5: too few for 95%, so the min-max range, covering 1 - 2/32
    assert bench.median_ci([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    # n=9: (x_2, x_8), coverage 1 - 2 * (1 + 9) / 512 = 0.961; k=3 would cover only 0.820
    low, high, cov = bench.median_ci([float(v) for v in range(9, 0, -1)])
    assert (low, high) == (2.0, 8.0) and cov == pytest.approx(1 - 20 / 512)
    low, high, cov = bench.median_ci([float(v) for v in range(20)])  # n=20: k=6, coverage 0.959
    assert (low, high) == (5.0, 14.0) and cov == pytest.approx(0.9586, abs=1e-4)


def test_in_process_systems_are_interleaved_and_paired(bench, monkeypatch) -> None:
    order: list[str] = []

    def fake(name: str, totals: list[float]):
        it = iter(totals)

        def run():
            order.append(name)
            return bench.Outcome(next(it), [0.0, 1.0], 0.5)
        return run

    got = bench.measure_interleaved({"raw": fake("raw", [1.0, 2.0, 1.0]), "seq": fake("seq", [1.1, 2.2, 1.1])}, 3)
    assert order == ["raw", "seq", "seq", "raw", "raw", "seq"]  # rotated each repeat
    assert [o.total_s for o in got["seq"]] == [1.1, 2.2, 1.1]
    raw = bench.Row("mlp-100", "raw", 1.0, runs=[1.0, 2.0, 1.0])
    seq = bench.Row("mlp-100", "sequential", 1.1, runs=[1.1, 2.2, 1.1])
    bench._fill_ratios({"raw": raw, "sequential": seq}, {})
    # paired: every repeat's ratio is 1.1 although the machine was twice as slow in repeat 2
    assert seq.fedsim_over_raw == pytest.approx(1.1) and seq.ratio_ci[:2] == pytest.approx((1.1, 1.1))


def test_a_ratio_target_is_met_only_outside_the_noise(bench) -> None:
    def row(ratio, ci, runs=5):
        return bench.Row("mlp-100", "sequential", 1.0, fedsim_over_raw=ratio, ratio_ci=ci, runs=[1.0] * runs)

    assert bench._ratio_target(row(1.05, (1.02, 1.08, 0.94)), 1.10) == (
        "1.05 (94% CI 1.02-1.08, 5 paired runs)", "met")
    assert bench._ratio_target(row(1.08, (1.04, 1.13, 0.94)), 1.10)[1] == "inside the noise"
    assert bench._ratio_target(row(1.15, (1.11, 1.19, 0.94)), 1.10)[1] == "NOT met"
    assert bench._ratio_target(row(1.05, None, runs=1), 1.10) == ("1.05 (1 run(s), no interval)", "met")
    assert bench._ratio_target(None, 1.10) == ("n/a", "not measured")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is visible")
@pytest.mark.parametrize("device, message", [
    ("cuda", "engine.device=cuda but the CPU build of torch sees no CUDA GPU"),
    ("gpu", "engine.device must be cpu, auto, cuda or cuda:N, got 'gpu'"),
])
def test_a_device_that_is_not_there_is_a_one_line_error(bench, device, message) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", device, "--quick"])
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_the_device_reaches_every_fedsim_system_and_the_raw_loop(bench, tiny) -> None:
    w = bench.get_workload(tiny)
    assert bench.workload_config(w, rounds=1, device="cuda:1").engine.device == "cuda:1"
    for system in ("local", "sequential", "vectorise"):
        assert bench.fedsim_config(w, system, 1, False, "cuda:1").engine.device == "cuda:1"
    assert bench.workload_config(w, rounds=1).engine.device == "cpu"
