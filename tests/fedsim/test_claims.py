"""The claim protocol: verdicts from paired seeds (hand-made numbers), spec checks, tuning and --plan."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from fedsim import claims as V
from fedsim.cli import main
from fedsim.contracts.history import History, RoundRecord
from fedsim.errors import ConfigError, RunFailedError
from tests.script_modules import load_script


# -- the verdict module -------------------------------------------------------------------------
def test_superiority_holds_fails_and_undecided() -> None:
    holds = V.decide(np.array([0.05, 0.06, 0.055, 0.052]), 0.01)
    assert holds.verdict == V.HOLDS and holds.interval.lo > 0.01 and holds.decide_text() == ""
    fails = V.decide(np.array([-0.05, -0.04, -0.045]), 0.01)
    assert fails.verdict == V.FAILS and fails.interval.hi < 0.01
    # a clear gain that is still below the margin fails: the interval lies under it
    assert V.decide(np.array([0.004, 0.005, 0.006]), 0.01).verdict == V.FAILS
    undecided = V.decide(np.array([0.03, -0.01, 0.04]), 0.01)
    assert undecided.verdict == V.UNDECIDED and undecided.interval.lo < 0.01 < undecided.interval.hi
    assert undecided.seeds_needed is not None and not undecided.seeds_more_than
    assert undecided.decide_text() == f"about {undecided.seeds_needed} seeds"


def test_a_failed_control_makes_the_claim_invalid() -> None:
    v = V.decide(np.array([0.05, 0.06, 0.055]), 0.01, controls_passed=False)
    assert v.verdict == V.INVALID and v.interval.lo > 0.01  # the interval is still reported


def test_equivalence_verdicts() -> None:
    assert V.decide(np.array([0.001, -0.002, 0.0015, 0.0]), 0.02, kind=V.EQUIVALENCE).verdict == V.HOLDS
    assert V.decide(np.array([0.10, 0.11, 0.12]), 0.02, kind=V.EQUIVALENCE).verdict == V.FAILS
    assert V.decide(np.array([-0.10, -0.11, -0.12]), 0.02, kind=V.EQUIVALENCE).verdict == V.FAILS
    assert V.decide(np.array([0.0, 0.03, 0.01]), 0.02, kind=V.EQUIVALENCE).verdict == V.UNDECIDED


def test_t_interval_is_the_paired_t_interval() -> None:
    d = np.array([0.02, 0.05, -0.01, 0.03])
    iv = V.mean_interval(d, 0.9, "t")
    lo, hi = stats.t.interval(0.9, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    assert (iv.lo, iv.hi) == pytest.approx((lo, hi)) and iv.method == "t" and iv.n == 4


def test_a_difference_equal_on_every_seed_is_labelled_exact_not_a_zero_width_interval() -> None:
    exact = V.mean_interval(np.full(4, 0.25))
    assert (exact.lo, exact.hi, exact.sd) == (0.25, 0.25, 0.0)
    assert exact.text() == "+0.2500 (exact: the same on all 4 seeds)"
    assert V.mean_interval(np.array([0.25, 0.26, 0.24])).text().startswith("+0.2500 [")


def test_seeds_estimate_is_the_first_n_whose_t_interval_clears_the_margin() -> None:
    d = np.array([0.03, -0.01, 0.04])
    mean, sd, margin = float(d.mean()), float(d.std(ddof=1)), 0.01
    n, more = V.seeds_to_decide(mean, sd, margin)

    def half(k: int) -> float:
        return float(stats.t.ppf(0.975, k - 1)) * sd / math.sqrt(k)

    assert not more and n > len(d) and half(n) < mean - margin <= half(n - 1)
    # the mean on the margin: no number of seeds decides it
    on, more = V.seeds_to_decide(0.01, 0.02, 0.01)
    assert more and on == V.MAX_SEEDS
    assert V.decide(np.array([0.0, 0.02]), 0.01).decide_text() == f"more than {V.MAX_SEEDS} seeds"
    # one seed: no sd, so no estimate and no decision
    single = V.decide(np.array([0.3]), 0.01)
    assert single.verdict == V.UNDECIDED and single.decide_text() == "needs at least 2 seeds to estimate"


def test_pairing_by_seed_and_direction() -> None:
    seeds, d = V.paired_differences({0: 0.5, 1: 0.7}, {1: 0.6, 0: 0.2})
    assert seeds == [0, 1] and d.tolist() == pytest.approx([0.3, 0.1])
    _, d_low = V.paired_differences({0: 0.5}, {0: 0.2}, higher_is_better=False)
    assert d_low.tolist() == pytest.approx([-0.3])
    with pytest.raises(ConfigError, match=r"seeds \[2\] are on one side only"):
        V.paired_differences({0: 0.5, 1: 0.7, 2: 0.1}, {0: 0.2, 1: 0.6})


def test_bootstrap_is_seeded_and_deterministic() -> None:
    d = np.array([0.02, 0.05, -0.01, 0.03, 0.04])
    a = V.mean_interval(d, method="bootstrap", seed=0)
    b = V.mean_interval(d, method="bootstrap", seed=0)
    c = V.mean_interval(d, method="bootstrap", seed=1)
    assert (a.lo, a.hi) == (b.lo, b.hi) and (a.lo, a.hi) != (c.lo, c.hi)
    assert a.method == "bootstrap" and d.min() <= a.lo < d.mean() < a.hi <= d.max()
    with pytest.raises(ConfigError, match="interval must be one of"):
        V.mean_interval(d, method="wald")


# -- the spec -----------------------------------------------------------------------------------
BASE = ("experiment: fedavg\noverrides: [rounds=2, num_clients=2, data.name=digits, model.name=mlp,"
        " data.partition.name=iid, evaluation.validation_fraction=0.2]\n"
        "grid:\n  strategy.name: [fedavg, fedprox, fedmut]\n  client.local_epochs: [1, 2]\nseeds: [0, 1, 2]\n")
PROTOCOL = """claim:
  better: {strategy.name: fedprox}
  worse: {strategy.name: fedavg}
  at: {client.local_epochs: 1}
  margin: 0.01
controls:
  positive:
    better: {strategy.name: fedmut}
    worse: {strategy.name: fedavg}
    at: {client.local_epochs: 2}
  floor: {value: 0.1, source: chance (10 classes)}
  ceiling: {overrides: [client.lr=0.3]}
tune:
  by: strategy.name
  grid: {client.lr: [0.1, 0.5]}
  at: {client.local_epochs: 1}
minutes_per_run: 0.5
"""


def _spec_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "claim.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("protocol, message", [
    ("claim: {better: {strategy.name: fedprox}, worse: {strategy.name: fedavg}}", "matches 2 configurations"),
    ("claim: {better: {strategy.name: fedprox}, worse: {strategy.name: fedprox}, at: {client.local_epochs: 1}}",
     "pick the same configuration"),
    ("claim: {better: {eps: 3}, worse: {strategy.name: fedavg}}", "'eps' is not a grid key"),
    ("claim: {kind: equivalence, better: {strategy.name: fedprox, client.local_epochs: 1},"
     " worse: {strategy.name: fedavg, client.local_epochs: 1}}", "needs a margin > 0"),
    ("claim: {at: {strategy.name: fedprox, client.local_epochs: 1}, better_metric: eval/loss,"
     " worse_metric: eval/loss}", "pick the same configuration and the same metric"),
    ("claim: {better_metric: eval/loss, worse_metric: eval/accuracy}", "matches 6 configurations"),
    ("claim: {better: {strategy.name: fedprox, client.local_epochs: 1}, worse: {strategy.name: fedavg},"
     " worse_value: 0.5}", "drop `worse`"),
    ("claim: {better: {strategy.name: fedprox, client.local_epochs: 1}, worse_value: .nan}", "finite number"),
    ("tune: {grid: {client.lr: [0.1]}, metric: eval/accuracy}", "must be a validation metric"),
    ("tune: {grid: {client.local_epochs: [1]}}", "is a claim grid key"),
    ("controls: {floor: {value: 0.1}}", "needs its source"),
    ("interval: wald", "interval must be one of"),
    ("exclude: [{strategy.nme: fedmut}]", "not a grid key"),
    ("exclude: [{strategy.name: fedmutt}]", "matches no grid combination"),
    ("exclude: [{client.local_epochs: 1}, {client.local_epochs: 2}]", "leaves no grid combination"),
    ("tune: {grid: {client.lr: [0.1]}, metric: val/accuracy, at: {client.local_epochs: 1}}\n"
     "exclude: [{strategy.name: fedmut, client.local_epochs: 1}]", "fedmut would run untuned"),
])
def test_bad_protocol_is_one_line_exit_2(tmp_path, in_tmp, capsys, protocol: str, message: str) -> None:
    path = _spec_file(tmp_path, BASE + protocol + "\n")
    assert main(["reproduce", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsim: error: ") and message in err and err.count("\n") == 1
    assert not (in_tmp / "mlflow.db").exists()


def test_exclude_drops_exactly_the_matching_combinations(tmp_path) -> None:
    from fedsim.reproduce import load_claim, settings

    spec = load_claim(_spec_file(tmp_path, BASE + "exclude:\n  - {strategy.name: fedmut, client.local_epochs: 2}\n"
                                 "  - {strategy.name: fedprox}\n"))
    assert settings(spec) == [
        {"strategy.name": "fedavg", "client.local_epochs": 1}, {"strategy.name": "fedavg", "client.local_epochs": 2},
        {"strategy.name": "fedmut", "client.local_epochs": 1}]


def test_tuning_needs_a_validation_split(tmp_path) -> None:
    from fedsim.reproduce import load_claim, plan_claim

    spec = load_claim(_spec_file(tmp_path, BASE.replace(", evaluation.validation_fraction=0.2", "") + PROTOCOL), seeds=1)
    with pytest.raises(ConfigError, match="evaluation.validation_fraction"):
        plan_claim("c", spec)


def test_plan_lists_runs_and_an_estimate_and_records_nothing(tmp_path, in_tmp, capsys) -> None:
    path = _spec_file(tmp_path, BASE + PROTOCOL)
    assert main(["reproduce", path, "--plan", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    # tuning: 3 methods x 2 lr at local_epochs=1 x 1 seed; final: 6 configurations x 1 seed + 1 ceiling run,
    # of which the 3 at local_epochs=1 on seed 0 are the chosen candidates' tuning runs
    assert "plan for" in out and "10 runs" in out and "tuning on val/accuracy: 6 runs" in out
    assert "final: 7 runs" in out and "3 of them are the tuning runs of the chosen values, reused" in out
    assert "tune | strategy=fedprox, local_epochs=1 | client.lr=0.5 | seed 0" in out
    assert "estimated time: 5.0 min (0.50 min per run, the spec's minutes_per_run)" in out
    assert [p.name for p in in_tmp.iterdir()] == ["claim.yaml"]  # no store, no checkpoints
    # the claim reads fedprox and fedavg at local_epochs=1, the control fedmut and fedavg at 2
    assert ("2 configurations no claim, control or reference reads (leave them out with exclude:): "
            "strategy=fedprox, local_epochs=2; strategy=fedmut, local_epochs=1\n") in out


# -- end to end with hand-made histories ---------------------------------------------------------
BASE_ACC = {"fedavg": 0.50, "fedprox": 0.60, "fedmut": 0.58}
NOISE = [0.0, 0.01, -0.008]  # per seed, the same for every configuration: pairing removes it


def _curve(final: float) -> list[float]:
    return [0.1, (0.1 + final) / 2, final]


def fake_runner(calls: list[tuple[str, float]], tracking_uri: str | None = None, control_fails: bool = False):
    """A run_one with hand-made histories: val/ peaks at lr 0.1, eval/ at lr 0.5 (so tuning on the
    test metric would pick 0.5). With a tracking URI it writes each run as a small MLflow child."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    def run_one(cfg, *, parent_run_id=None, run_name=None, **kw):
        calls.append((run_name, cfg.client.lr))
        base = BASE_ACC[cfg.strategy.name] - (0.2 if control_fails and cfg.strategy.name == "fedmut" else 0.0)
        val = base + (0.05 if cfg.client.lr == 0.1 else 0.0) + NOISE[cfg.seed]
        test = base + (0.05 if cfg.client.lr == 0.5 else 0.0) + NOISE[cfg.seed] + 0.001 * cfg.client.local_epochs
        records = [RoundRecord(i, {"eval/accuracy": t, "val/accuracy": v})
                   for i, (t, v) in enumerate(zip(_curve(test), _curve(val)))]
        run_id = None
        if tracking_uri is not None:
            client = MlflowClient(tracking_uri)
            exp = client.get_run(parent_run_id).info.experiment_id
            run_id = client.create_run(exp, run_name=run_name, tags={"mlflow.parentRunId": parent_run_id}).info.run_id
            client.log_batch(run_id, metrics=[Metric(k, v, 0, r.round) for r in records for k, v in r.metrics.items()])
            client.set_terminated(run_id)
        return SimpleNamespace(history=History(records), run_id=run_id)

    return run_one


def test_protocol_end_to_end_tunes_on_val_and_decides(tmp_path) -> None:
    from fedsim.reproduce import load_claim, protocol_markdown, results_table_rows, run_claim, verdicts_or_error

    spec = load_claim(_spec_file(tmp_path, BASE + PROTOCOL), seeds=2, extra_overrides=["tracking.enabled=false"])
    calls: list[tuple[str, float]] = []
    tuning: list[dict] = []
    from fedsim import reproduce

    original = reproduce._run_tuning

    def keep_table(spec_, jobs, cfgs, execute, table, on_progress, outcomes):  # the table the parent would log
        chosen = original(spec_, jobs, cfgs, execute, table, on_progress, outcomes)
        tuning.extend(table)
        return chosen

    reproduce._run_tuning = keep_table
    try:
        results, parent_id = run_claim("c", spec, run_one=fake_runner(calls))
    finally:
        reproduce._run_tuning = original
    assert parent_id is None
    tune_calls = [c for c in calls if c[0].startswith("tune |")]
    # tuning, 6 configurations x 2 seeds less the 3 that are the chosen candidates' tuning runs, 2 ceiling runs
    assert len(tune_calls) == 6 and len(calls) == 6 + 12 - 3 + 2
    assert all(len(r.finals) == 2 and sorted(r.seeds) == [0, 1] for r in results)  # still every seed
    # every final run of every method used the lr that won on validation (0.1), not on test (0.5)
    finals = [c for c in calls if not c[0].startswith(("tune |", "ceiling"))]
    assert {lr for _, lr in finals} == {0.1}
    rows = {row["configuration"]: row for row in results_table_rows(spec, results)}
    assert rows["strategy=fedprox, local_epochs=1"]["tuned"] == "client.lr=0.1"
    best = {(t["method"], t["values"]): t for t in tuning}
    assert best[("fedprox", "client.lr=0.1")]["mean"] == pytest.approx(0.65) and best[("fedprox", "client.lr=0.1")]["chosen"]
    assert not best[("fedprox", "client.lr=0.5")]["chosen"]
    verdicts, error = verdicts_or_error(spec, results)
    assert error is None
    control, claim = verdicts
    assert (control.role, control.verdict.verdict) == ("control", "holds")
    assert (claim.role, claim.verdict.verdict, claim.control) == ("claim", "holds", "passed")
    # paired seeds: the per-seed noise cancels, so the difference is 0.10 with a zero-width interval
    assert claim.verdict.interval.mean == pytest.approx(0.10) and claim.verdict.interval.lo == pytest.approx(0.10)
    assert claim.text == "strategy=fedprox > strategy=fedavg by 0.01 on eval/accuracy at local_epochs=1"
    md = "\n".join(protocol_markdown(spec, results, tuning))
    assert "## Verdicts (95% paired t interval" in md and "## Tuning (selected on val/accuracy" in md
    assert "| floor | 0.1000 | constant: chance (10 classes) |" in md
    ceiling = next(r for r in results if r.role == "ceiling")
    assert f"| ceiling | {np.mean(ceiling.finals):.4f} | run with client.lr=0.3 (mean of 2 seeds) |" in md


def test_a_claim_may_compare_two_metrics_of_one_configuration(tmp_path) -> None:
    """A centralised run that evaluates every method itself logs one metric per method: the claim
    pairs two metrics of the same configuration, seed by seed."""
    from fedsim.reproduce import load_claim, run_claim, verdicts_or_error

    protocol = ("claim:\n  at: {strategy.name: fedprox, client.local_epochs: 2}\n"
                "  better_metric: val/accuracy\n  worse_metric: eval/accuracy\n  margin: 0.0\n")
    spec = load_claim(_spec_file(tmp_path, BASE + protocol), seeds=3, extra_overrides=["tracking.enabled=false"])
    assert "val/accuracy" in spec.tracked_metrics()
    calls: list[tuple[str, float]] = []
    results, _ = run_claim("c", spec, run_one=fake_runner(calls))
    rows, error = verdicts_or_error(spec, results)
    assert error is None and len(rows) == 1
    lr = {lr for _, lr in calls}.pop()
    # fake_runner: val = base + 0.05 [lr 0.1] + noise, test = base + 0.05 [lr 0.5] + noise + 0.001 x epochs
    expected = (0.05 if lr == 0.1 else 0.0) - (0.05 if lr == 0.5 else 0.0) - 0.002
    assert rows[0].verdict.interval.mean == pytest.approx(expected)
    assert rows[0].metric == "val/accuracy − eval/accuracy"
    assert rows[0].text == "val/accuracy > eval/accuracy by 0 at strategy=fedprox, local_epochs=2"


def test_a_claim_may_compare_one_configuration_with_a_constant(tmp_path) -> None:
    """A theory's value (an error floor, a slope of 1) is the worse side: the interval is then the
    one-sample interval on the mean of value_i - constant."""
    from fedsim.reproduce import load_claim, run_claim, verdicts_or_error

    protocol = ("claim:\n"
                "  - {better: {strategy.name: fedprox, client.local_epochs: 1}, worse_value: 0.5, margin: 0.01}\n"
                "  - {kind: equivalence, better: {strategy.name: fedavg, client.local_epochs: 1}, worse_value: 0.5,"
                " margin: 0.05, metric: val/accuracy, name: val near 0.5}\n")
    spec = load_claim(_spec_file(tmp_path, BASE + protocol), seeds=3, extra_overrides=["tracking.enabled=false"])
    calls: list[tuple[str, float]] = []
    results, _ = run_claim("c", spec, run_one=fake_runner(calls))
    rows, error = verdicts_or_error(spec, results)
    assert error is None and len(rows) == 2
    lr = {lr for _, lr in calls}.pop()
    test = [BASE_ACC["fedprox"] + (0.05 if lr == 0.5 else 0.0) + n + 0.001 for n in NOISE]
    d = np.asarray(test) - 0.5
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    iv = rows[0].verdict.interval
    assert iv.mean == pytest.approx(d.mean()) and iv.lo == pytest.approx(d.mean() - half)
    assert rows[0].verdict.verdict == ("holds" if d.mean() - half > 0.01 else "undecided")
    assert rows[0].text == "eval/accuracy > 0.5 by 0.01 at strategy=fedprox, local_epochs=1"
    val = [BASE_ACC["fedavg"] + (0.05 if lr == 0.1 else 0.0) + n for n in NOISE]
    assert rows[1].verdict.interval.mean == pytest.approx(np.mean(val) - 0.5) and rows[1].metric == "val/accuracy"


@pytest.mark.parametrize("control_on_the_failed_side", [False, True])
def test_a_seed_without_a_value_gives_its_comparison_a_no_data_row_and_the_others_are_decided(
        tmp_path, control_on_the_failed_side) -> None:
    """One failed run (fedprox, seed 2) used to blank the whole verdict table; now only the rows that
    read it say "no data" (why, in the difference column), and a control without data has not passed."""
    from fedsim.reproduce import load_claim, protocol_markdown, run_claim, verdicts_or_error

    control = "fedprox" if control_on_the_failed_side else "fedmut"
    protocol = ("claim:\n"
                "  - {better: {strategy.name: fedprox}, worse: {strategy.name: fedavg}, at: {client.local_epochs: 1}}\n"
                "  - {better: {strategy.name: fedmut}, worse: {strategy.name: fedavg}, at: {client.local_epochs: 1}}\n"
                "controls:\n  positive:\n"
                f"    - {{better: {{strategy.name: {control}}}, worse: {{strategy.name: fedavg}}, at: {{client.local_epochs: 2}}}}\n")
    spec = load_claim(_spec_file(tmp_path, BASE + protocol), seeds=3, extra_overrides=["tracking.enabled=false"])
    inner = fake_runner([])

    def run_one(cfg, **kw):
        if cfg.strategy.name == "fedprox" and cfg.seed == 2:
            raise RunFailedError("a client ran out of memory")
        return inner(cfg, **kw)

    results, _ = run_claim("c", spec, run_one=run_one)
    rows, error = verdicts_or_error(spec, results)
    assert error is None and [r.role for r in rows] == ["control", "claim", "claim"]
    verdicts = [r.verdict.verdict for r in rows]
    if control_on_the_failed_side:
        assert verdicts == ["no data", "no data", "invalid"]  # no data says more than invalid
    else:
        assert verdicts == ["holds", "no data", "holds"]  # fedmut 0.58 vs fedavg 0.50, the same noise
    missing = rows[0] if control_on_the_failed_side else rows[1]
    assert "seeds [2] are on one side only" in missing.as_row()["difference"]
    assert "seeds [2]" in missing.as_csv()["no_data"]
    assert "verdicts not computed" not in "\n".join(protocol_markdown(spec, results, []))


def test_a_claim_is_gated_only_by_the_controls_it_needs(tmp_path) -> None:
    """``needs`` names a claim's premises: a failing control voids the claims that need it (and, without
    ``needs``, every claim), while a claim resting on a passing control keeps its verdict."""
    from fedsim.reproduce import load_claim, run_claim, verdicts_or_error

    protocol = ("claim:\n"
                "  - {better: {strategy.name: fedprox}, worse: {strategy.name: fedavg}, at: {client.local_epochs: 1},"
                " needs: [mut helps]}\n"
                "  - {better: {strategy.name: fedmut}, worse: {strategy.name: fedavg}, at: {client.local_epochs: 1},"
                " needs: [prox hurts]}\n"
                "  - {better: {strategy.name: fedmut}, worse: {strategy.name: fedprox}, at: {client.local_epochs: 1}}\n"
                "controls:\n  positive:\n"
                "    - {name: mut helps, better: {strategy.name: fedmut}, worse: {strategy.name: fedavg},"
                " at: {client.local_epochs: 2}}\n"
                "    - {name: prox hurts, better: {strategy.name: fedavg}, worse: {strategy.name: fedprox},"
                " at: {client.local_epochs: 2}}\n")
    spec = load_claim(_spec_file(tmp_path, BASE + protocol), seeds=3, extra_overrides=["tracking.enabled=false"])
    results, _ = run_claim("c", spec, run_one=fake_runner([]))
    rows, error = verdicts_or_error(spec, results)
    assert error is None
    assert [(r.verdict.verdict, r.control) for r in rows] == [
        ("holds", ""), ("fails", ""),  # fedmut 0.58 > fedavg 0.50; fedavg 0.50 < fedprox 0.60
        ("holds", "passed"),  # needs only "mut helps"
        ("invalid", "failed"), ("invalid", "failed")]  # needs "prox hurts"; no `needs`: every control


@pytest.mark.parametrize("protocol, message", [
    ("claim: {better: {strategy.name: fedprox}, worse: {strategy.name: fedavg}, at: {client.local_epochs: 1},"
     " needs: [nope]}\ncontrols: {positive: {name: real, better: {strategy.name: fedmut}, worse: {strategy.name: fedavg},"
     " at: {client.local_epochs: 2}}}", "claim 1 needs 'nope', which names no positive control; named controls: 'real'"),
    ("claim: {better: {strategy.name: fedprox}, worse: {strategy.name: fedavg}, at: {client.local_epochs: 1}}\n"
     "controls: {positive: {needs: [x], better: {strategy.name: fedmut}, worse: {strategy.name: fedavg},"
     " at: {client.local_epochs: 2}}}", "`needs` belongs to claims"),
])
def test_needs_naming_no_control_is_one_line_exit_2(tmp_path, in_tmp, capsys, protocol: str, message: str) -> None:
    assert main(["reproduce", _spec_file(tmp_path, BASE + protocol + "\n")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsim: error: ") and message in err and err.count("\n") == 1


def _artifact(client, run_id: str, name: str) -> str:
    return Path(client.download_artifacts(run_id, name)).read_text()


def test_a_failed_control_marks_claims_invalid_and_resume_reads_tuning_back(tmp_path, tracking_uri) -> None:
    from mlflow import MlflowClient

    from fedsim.reproduce import load_claim, run_claim

    spec = load_claim(_spec_file(tmp_path, BASE + PROTOCOL), seeds=2)
    calls: list[tuple[str, float]] = []
    runner = fake_runner(calls, tracking_uri, control_fails=True)

    def interrupted(cfg, **kw):
        if len(calls) == 8:  # after the tuning stage and two final runs
            raise KeyboardInterrupt
        return runner(cfg, **kw)

    with pytest.raises(KeyboardInterrupt):
        run_claim("c", spec, tracking_uri=tracking_uri, run_one=interrupted)
    client = MlflowClient(tracking_uri)
    parent_id = next(r for r in client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
                     if r.data.tags.get("kind") == "claim-check").info.run_id
    calls.clear()
    run_claim("c", spec, tracking_uri=tracking_uri, run_one=runner, resume_parent=parent_id)
    assert not any(name.startswith("tune |") for name, _ in calls) and len(calls) == 17 - 8
    assert {lr for name, lr in calls if not name.startswith("ceiling")} == {0.1}  # chosen again from read-back runs
    stages = {r.data.tags["mlflow.runName"]: r.data.tags.get("claim_stage")
              for r in client.search_runs([client.get_run(parent_id).info.experiment_id])
              if r.data.tags.get("mlflow.parentRunId") == parent_id}
    assert stages["tune | strategy=fedprox, local_epochs=1 | client.lr=0.5 | seed 0"] == "tune"
    assert stages["strategy=fedprox, local_epochs=2 | seed 1"] == "final" and stages["ceiling | seed 0"] == "ceiling"
    arts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"results.md", "results.csv", "verdicts.csv", "tuning.csv", "plots"} <= arts
    table = _artifact(client, parent_id, "results.md")
    assert "| tuned |" in table.splitlines()[0] and "client.lr=0.1" in table.splitlines()[2]
    with open(client.download_artifacts(parent_id, "verdicts.csv")) as f:
        control, claim = list(csv.DictReader(f))
    assert (control["kind"], control["verdict"]) == ("control", "fails")
    assert (claim["kind"], claim["verdict"], claim["control"]) == ("claim", "invalid", "failed")
    assert float(claim["mean_difference"]) == pytest.approx(0.10)  # the interval is still reported
    # --plan's measured rate: the finished parent stored its seconds per run
    from fedsim.reproduce import SECONDS_PER_RUN, measured_seconds_per_run

    stored = client.get_run(parent_id).data.metrics[SECONDS_PER_RUN]
    assert stored > 0 and measured_seconds_per_run("c", tracking_uri) == pytest.approx(stored)
    assert measured_seconds_per_run("other", tracking_uri) is None


def test_the_quick_specs_declare_the_protocol() -> None:
    from fedsim.reproduce import load_claim

    for name in ("fedsvd_quick", "fedsvd_eps", "fedphoenix_quick"):  # load_claim validates claims and controls
        spec = load_claim(name)
        assert spec.claim and spec.controls.positive and spec.controls.floor and spec.controls.ceiling


def test_fedsvd_eps_reuses_fedsvd_quicks_chosen_rates_and_reads_every_cell() -> None:
    from fedsim.claim_protocol import read_configurations
    from fedsim.reproduce import load_claim, settings

    quick, eps = load_claim("fedsvd_quick"), load_claim("fedsvd_eps")
    assert {c.at["eps"] for c in eps.claim} == {1, 6} and quick.claim[0].at == {"eps": 3}
    # one candidate per method: the rate fedsvd_quick's tuning chose (docs/claims/fedsvd_quick)
    assert {m: g["client.lr"] for m, g in eps.tune.methods.items()} == {"fedsvd": [0.5], "ffa_lora": [1.0],
                                                                          "fedavg_lora": [0.25]}
    assert all(v in quick.tune.methods[m]["client.lr"] for m, g in eps.tune.methods.items() for v in g["client.lr"])
    grid = settings(eps)
    assert read_configurations(eps, grid) == set(range(len(grid))) and len(grid) == 5


# -- the validation split that tuning selects on ------------------------------------------------
def _digits():
    from fedsim.config import DataConfig, PartitionConfig

    return DataConfig(name="digits", partition=PartitionConfig(name="iid"))


def test_validation_split_off_by_default_and_carved_from_the_pool_when_on() -> None:
    from envs.federated import build_federated_data

    off = build_federated_data(_digits(), 4, seed=3)
    same = build_federated_data(_digits(), 4, seed=3, validation_fraction=0.0)
    assert off.server_val is None and same.server_val is None
    for a, b in zip([off.server_test_index, *off.train_index, *off.test_index],
                    [same.server_test_index, *same.train_index, *same.test_index]):
        np.testing.assert_array_equal(a, b)
    on = build_federated_data(_digits(), 4, seed=3, validation_fraction=0.2)
    np.testing.assert_array_equal(on.server_test_index, off.server_test_index)  # the test split is untouched
    parts = [on.server_test_index, on.server_val_index, *on.train_index, *on.test_index]
    every = np.concatenate(parts)
    assert len(every) == len(np.unique(every)) == len(np.concatenate([off.server_test_index, *off.train_index,
                                                                        *off.test_index]))
    pool = len(every) - len(on.server_test_index)
    assert len(on.server_val_index) == pytest.approx(0.2 * pool, abs=1)
    val_share = np.bincount(on.server_val.y, minlength=10) / len(on.server_val.y)
    test_share = np.bincount(on.server_test.y, minlength=10) / len(on.server_test.y)
    assert np.abs(val_share - test_share).max() < 0.02  # stratified


def test_supervised_server_evaluation_logs_val_metrics(in_tmp) -> None:
    from fedsim.config import load_config, validate
    from fedsim.runner import run_experiment

    overrides = ["rounds=1", "num_clients=2", "data.name=digits", "model.name=mlp", "data.partition.name=iid",
                 "tracking.enabled=false", "evaluation.validation_fraction=0.2"]
    history = run_experiment(load_config("fedavg", overrides)).history
    final = history.records[-1].metrics
    assert {"val/accuracy", "val/loss", "eval/accuracy"} <= set(final) and 0.0 <= final["val/accuracy"] <= 1.0
    assert final["val/accuracy"] != final["eval/accuracy"] or final["val/loss"] != final["eval/loss"]
    with pytest.raises(ConfigError, match=r"evaluation.validation_fraction must be in \[0, 1\)"):
        validate(load_config("fedavg", ["evaluation.validation_fraction=1.5"]))


# -- docs/claims.md ------------------------------------------------------------------------------
def _claims_doc():
    return load_script("scripts/claims_doc.py")


def test_docs_claims_md_is_generated_and_up_to_date() -> None:
    assert _claims_doc().main(["--check"]) == 0


def test_claims_doc_copies_a_parent_run_and_renders_it(tmp_path, tracking_uri, capsys) -> None:
    from mlflow import MlflowClient

    doc = _claims_doc()
    client = MlflowClient(tracking_uri)
    run = client.create_run(client.create_experiment("fedsim"), run_name="reproduce-demo",
                            tags={"git_commit": "abc123", "mlflow.note.content": "The spec's text when it ran."})
    art = tmp_path / "art"
    art.mkdir()
    (art / "results.md").write_text("| configuration | final |\n|---|---|\n| a | 0.5 |\n\n## Verdicts\n\nrow\n")
    (art / "verdicts.csv").write_text("kind,claim,verdict\nclaim,a > b,holds\n")
    for name in ("results.md", "verdicts.csv"):
        client.log_artifact(run.info.run_id, str(art / name))
    client.set_terminated(run.info.run_id)
    root = tmp_path / "repo"
    (root / "docs" / "claims").mkdir(parents=True)
    (root / "docs" / "claims" / "legacy.md").write_text("| old | table |\n")
    sources = root / "docs" / "claims_sources.yaml"
    sources.write_text(f"claims:\n  - {{name: demo, tracking_uri: '{tracking_uri}', parent: {run.info.run_id},"
                       " description: A demo claim.}\nlegacy: docs/claims/legacy.md\n")
    out = root / "docs" / "claims.md"
    args = ["--sources", str(sources), "--root", str(root), "--out", str(out)]
    assert doc.main(args) == 0
    text = out.read_text()
    assert "## `fedsim reproduce demo`" in text and "A demo claim." in text and "| a | 0.5 |" in text
    assert f"MLflow parent run `{run.info.run_id}`" in text and "commit `abc123`" in text
    assert text.index("## Legacy (pre-protocol) tables") > text.index("## Verdicts") and "| old | table |" in text
    assert (root / "docs" / "claims" / "demo" / "verdicts.csv").read_text().endswith("claim,a > b,holds\n")
    # --check rebuilds from the copies alone; a hand edit is caught
    sources.write_text("claims:\n  - {name: demo, description: A demo claim.}\nlegacy: docs/claims/legacy.md\n")
    assert doc.main([*args, "--check"]) == 0
    # without a description in the sources, the one the parent ran with (copied) labels the results
    sources.write_text("claims:\n  - {name: demo}\nlegacy: docs/claims/legacy.md\n")
    assert doc.main(args) == 0 and "The spec's text when it ran." in out.read_text()
    sources.write_text("claims:\n  - {name: demo, description: A demo claim.}\nlegacy: docs/claims/legacy.md\n")
    assert doc.main(args) == 0
    out.write_text(text + "hand edit\n")
    assert doc.main([*args, "--check"]) == 1
    sources.write_text("claims:\n  - {name: missing}\n")
    assert doc.main(args) == 2 and "claims_doc: error: missing: no" in capsys.readouterr().err


def test_curves_plot_draws_floor_and_ceiling(tmp_path, monkeypatch) -> None:
    import matplotlib.axes

    from fedsim.plots import plot_claim
    from fedsim.reproduce import ClaimSpec, ConfigResult

    drawn: list[tuple[float, str]] = []
    original = matplotlib.axes.Axes.axhline

    def spy(self, y=0, *args, **kwargs):
        drawn.append((y, kwargs.get("label", "")))
        return original(self, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", spy)
    res = ConfigResult("a", {"strategy.name": "fedavg"})
    res.add([0.1, 0.4, 0.5], 0, seed=0)
    paths = plot_claim(ClaimSpec(experiment="fedavg", grid={"strategy.name": ["fedavg"]}), [res], tmp_path, "t",
                       references={"floor": 0.1, "ceiling": 0.68})
    assert [p.name for p in paths] == ["curves.png"] and paths[0].stat().st_size > 0
    assert drawn == [(0.1, "floor (0.1)"), (0.68, "ceiling (0.68)")]


def test_fedsvd_control_spec_compares_fedsvd_with_its_orthonormal_a_control_at_one_rate() -> None:
    from fedsim.claim_protocol import read_configurations
    from fedsim.reproduce import build_config, load_claim, settings

    spec = load_claim("fedsvd_control")
    grid = settings(spec)
    (claim,) = spec.claim
    assert claim.kind == "equivalence" and claim.margin == 0.02 and read_configurations(spec, grid) == {0, 1}
    cfgs = [build_config(spec, setting, 0) for setting in grid]
    assert [c.strategy.name for c in cfgs] == ["fedsvd", "ffa_lora"] and {c.client.lr for c in cfgs} == {0.5}
    assert cfgs[1].strategy.params["orthonormalise_a"] == "first_round" and {c.privacy.epsilon for c in cfgs} == {1.0}
