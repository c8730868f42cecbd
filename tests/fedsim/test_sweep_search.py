"""Sweeps with Ray Tune's random search (``--samples N --search KEY=DIST``) and ASHA (``--asha METRIC``):
distribution parsing, seeded sampling, one 2-sample search and one ASHA run on a local Ray runtime."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.sweep import (
    STOPPED_AT_TAG,
    STOPPED_BY_TAG,
    Dist,
    load_sweep,
    parse_distribution,
    parse_search,
    sample_settings,
    sweep_settings,
)


def test_every_distribution_form_parses() -> None:
    search = parse_search(["client.lr=loguniform(0.01,1)", "data.partition.alpha=uniform(0.1, 10)",
                           "client.local_epochs=randint(1,5)", "strategy=choice(fedavg,fedprox)",
                           "a.q=quniform(0,1,0.25)", "a.ql=qloguniform(0.001,1,0.001)", "a.qi=qrandint(2,10,2)",
                           "a.li=lograndint(1,100)", "a.mixed=choice(1, 0.5, true, x)"], "fedavg_digits")
    assert search == {
        "client.lr": Dist("loguniform", (0.01, 1.0)), "data.partition.alpha": Dist("uniform", (0.1, 10.0)),
        "client.local_epochs": Dist("randint", (1, 5)), "strategy.name": Dist("choice", ("fedavg", "fedprox")),
        "a.q": Dist("quniform", (0.0, 1.0, 0.25)), "a.ql": Dist("qloguniform", (0.001, 1.0, 0.001)),
        "a.qi": Dist("qrandint", (2, 10, 2)), "a.li": Dist("lograndint", (1, 100)),
        "a.mixed": Dist("choice", (1, 0.5, True, "x"))}
    # a sweep file's mapping, with spaces
    assert parse_search({"client.lr": " LogUniform( 0.01 , 1 ) "}, "fedavg_digits") == \
        {"client.lr": Dist("loguniform", (0.01, 1.0))}


@pytest.mark.parametrize("text, why", [
    ("normal(0,1)", "unknown distribution 'normal'"), ("uniform(1)", "takes 2 numbers, got 1"),
    ("uniform(a,b)", "takes numbers"), ("uniform(2,1)", "lower bound must be below"),
    ("uniform(0,inf)", "finite"), ("loguniform(0,1)", "lower bound > 0"), ("randint(1.5,3)", "integers"),
    ("quniform(0,1,0)", "step Q must be > 0"), ("choice()", "one or more"), ("choice(1,,2)", "one or more"),
    ("choice([1,2])", "plain values"), ("0.1", "not a distribution"), ("uniform(0,1", "not a distribution"),
])
def test_bad_distributions_are_one_line_errors_naming_the_key(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match="loguniform\\(LO,HI\\)") as err:
        parse_distribution("client.lr", text)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--search client.lr=") and why in message


def test_search_spec_errors() -> None:
    with pytest.raises(ConfigError, match="write KEY=DIST"):
        parse_search(["client.lr"], "fedavg_digits")
    with pytest.raises(ConfigError, match="give --samples N"):
        load_sweep("fedavg_digits", search=["client.lr=uniform(0.01,0.1)"])
    with pytest.raises(ConfigError, match="needs ranges"):
        load_sweep("fedavg_digits", grid=["rounds=1,2"], samples=2)
    with pytest.raises(ConfigError, match="both a grid axis and a --search range"):
        load_sweep("fedavg_digits", grid=["client.lr=0.1,0.2"], search=["client.lr=uniform(0.01,0.1)"], samples=2)
    with pytest.raises(ConfigError, match="give --asha METRIC too"):
        load_sweep("fedavg_digits", grid=["rounds=1,2"], grace_period=2)
    with pytest.raises(ConfigError, match="reduction-factor must be > 1"):
        load_sweep("fedavg_digits", grid=["rounds=1,2"], asha="eval/accuracy", reduction_factor=1)
    _, spec = load_sweep("fedavg_digits", grid=["rounds=1,2"], asha="eval/loss", asha_mode="min")
    assert (spec.asha.metric, spec.asha.mode, spec.asha.grace_period, spec.asha.reduction_factor) == \
        ("eval/loss", "min", 1, 4.0)


def test_seeded_sampling_is_deterministic_and_in_range() -> None:
    search = parse_search(["client.lr=loguniform(0.01,1)", "client.local_epochs=randint(1,5)",
                           "strategy=choice(fedavg,fedprox)"], "fedavg_digits")
    first = sample_settings(search, 20, seed=7)
    assert first == sample_settings(search, 20, seed=7)
    assert first != sample_settings(search, 20, seed=8)
    assert all(0.01 <= s["client.lr"] <= 1 and s["client.local_epochs"] in range(1, 5)
               and s["strategy.name"] in ("fedavg", "fedprox") for s in first)
    assert all(type(s["client.lr"]) is float and type(s["client.local_epochs"]) is int for s in first)  # not numpy
    # grid × samples, named by the sample index and the rounded values; the same spec seed, the same trials
    _, spec = load_sweep("fedavg_digits", grid=["num_clients=2,3"], samples=2, search_seed=7,
                         search=["client.lr=loguniform(0.01,1)"])
    trials = sweep_settings(spec)
    assert [t.setting for t in trials] == [{"num_clients": n, "client.lr": s["client.lr"]}
                                           for n in (2, 3) for s in sample_settings(
                                               parse_search(["client.lr=loguniform(0.01,1)"], "x"), 2, 7)]
    assert trials[0].label == f"s0: num_clients=2, lr={trials[0].setting['client.lr']:.3g}"
    assert [t.label for t in sweep_settings(spec)] == [t.label for t in trials]


def test_a_sweep_file_with_a_search_and_asha() -> None:
    name, spec = load_sweep("digits_search")  # experiments/sweeps/digits_search.yaml
    assert (name, spec.samples, spec.search_seed, spec.grid) == ("digits_search", 8, 0, {})
    assert spec.search["client.lr"] == "loguniform(0.01, 0.5)"
    assert (spec.asha.metric, spec.asha.mode, spec.asha.grace_period, spec.asha.reduction_factor) == \
        ("eval/accuracy", "max", 2, 2.0)
    trials = sweep_settings(spec)
    assert len(trials) == 8 and all(t.label.startswith(f"s{i}: lr=") for i, t in enumerate(trials))
    assert all(t.setting["client.local_epochs"] in (1, 2, 3) for t in trials)
    # the command line adds to the file: more samples, another mode
    _, spec = load_sweep("digits_search", samples=3, asha_mode="min")
    assert len(sweep_settings(spec)) == 3 and spec.asha.mode == "min"


def _children(tracking_uri: str) -> tuple[MlflowClient, object, list]:
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("kind") == "sweep")
    return client, parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_random_search_runs_each_sample_as_a_named_child(tmp_path, tracking_uri, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")
    args = ["sweep", "fedavg_digits", "rounds=1", "num_clients=2", "data.partition.name=iid", "--samples", "2", "--search",
            "client.lr=loguniform(0.01,0.3)", "--search", "strategy=choice(fedavg,fedprox)", "--search-seed", "3",
            "--seeds", "1", "--tracking-uri", tracking_uri, "--max-concurrent", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "trials: 2 done, 0 running, 0 failed, 0 pending" in out
    _, spec = load_sweep("fedavg_digits", samples=2, search_seed=3,
                         search=["client.lr=loguniform(0.01,0.3)", "strategy=choice(fedavg,fedprox)"])
    expected = {f"{t.label} | seed 0": t.setting for t in sweep_settings(spec)}
    client, parent, children = _children(tracking_uri)
    assert parent.data.params["samples"] == "2" and parent.data.params["search_seed"] == "3"
    assert {c.info.run_name for c in children if c.info.status == "FINISHED"} == set(expected)
    for c in children:
        assert float(c.data.params["client.lr"]) == expected[c.info.run_name]["client.lr"]
        assert c.data.params["strategy.name"] == expected[c.info.run_name]["strategy.name"]
    assert "results.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_asha_stops_a_bad_configuration_early(tmp_path, tracking_uri, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")
    # one trial at a time, the good one first: ASHA's first rung holds its round-1 accuracy, and lr=1e-6
    # (the initial model, barely trained) falls below it at round 1
    args = ["sweep", "fedavg_digits", "rounds=4", "num_clients=2", "data.partition.name=iid", "--grid", "client.lr=0.1,0.000001", "--seeds", "1",
            "--asha", "eval/accuracy", "--grace-period", "1", "--reduction-factor", "2", "--max-concurrent", "1",
            "--tracking-uri", tracking_uri]
    assert main(args) == 0  # a stopped trial is not a failure
    out = capsys.readouterr().out
    assert "1 done, 0 running, 0 failed, 0 pending, 1 stopped by ASHA" in out
    assert "stopped by ASHA at round 1: lr=1e-06 | seed 0" in out
    client, parent, children = _children(tracking_uri)
    by_name = {c.info.run_name: c for c in children}
    good, bad = by_name["lr=0.1 | seed 0"], by_name["lr=1e-06 | seed 0"]
    assert good.info.status == "FINISHED" and STOPPED_BY_TAG not in good.data.tags
    assert bad.info.status == "KILLED"
    assert bad.data.tags[STOPPED_BY_TAG] == "asha" and bad.data.tags[STOPPED_AT_TAG] == "1"
    rounds = lambda run: sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy"))
    assert rounds(good) == [0, 1, 2, 3, 4] and rounds(bad) == [0, 1]
    results = client.download_artifacts(parent.info.run_id, "results.md", str(tmp_path))
    text = open(results).read()
    assert "Stopped early by ASHA" in text and "| lr=1e-06 \\| seed 0 | 1 |" in text
    assert "failed" not in text.split("## Stopped")[0]  # the table does not count it as a failure
    # resume: the stopped trial is a result, read back with the finished one; nothing runs again
    assert main([*args, "--resume", parent.info.run_id]) == 0
    assert "1 done, 0 running, 0 failed, 0 pending, 1 stopped by ASHA (2 read back)" in capsys.readouterr().out
    assert len(_children(tracking_uri)[2]) == 2
