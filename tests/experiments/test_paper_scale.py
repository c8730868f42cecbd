"""`fedsim reproduce NAME --scale quick|default|paper` and the FedPhoenix paper-scale preset."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.reproduce import build_config, claim_name, load_claim, scales_of, settings
from tests.envs.test_cifar import write_cifar_fixture


def test_scale_resolves_the_spec_file() -> None:
    assert claim_name("fedphoenix", "paper") == "fedphoenix_paper"
    assert claim_name("fedphoenix", "quick") == "fedphoenix_quick"
    assert claim_name("fedphoenix") == "fedphoenix"
    assert scales_of("fedphoenix") == ["quick", "default", "paper"]
    spec = load_claim("fedphoenix", scale="paper")
    assert spec.experiment == "fedphoenix_paper"


@pytest.mark.parametrize("name, scale, match", [
    ("fedavg_alpha", "paper", "no 'paper' scale for claim check 'fedavg_alpha'.*scales of fedavg_alpha: default$"),
    ("nope", "quick", "scales of nope: none"),
    ("fedphoenix", "huge", "--scale must be one of quick, default, paper"),
    ("x.yaml", "paper", "selects a claim by name"),
])
def test_missing_scale_is_a_one_line_error(name: str, scale: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_claim(name, scale=scale)


def test_cli_missing_scale_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "fedavg_alpha", "--scale", "paper", "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsim: error: no 'paper' scale") and err.count("\n") == 1


def test_cli_plan_at_paper_scale_names_the_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "fedphoenix", "--scale", "paper", "--plan", "data.params.root=/data/cifar10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for fedphoenix_paper: 15 runs")  # 4 methods x 3 seeds + the IID ceiling
    assert "strategy=fedmut(params.alpha=4.0) | seed 3" in out


def test_paper_preset_is_the_paper_setting() -> None:
    spec = load_claim("fedphoenix", scale="paper", extra_overrides=["data.params.root=/data/cifar10"])
    phoenix = next(s for s in settings(spec) if s["strategy"]["name"] == "fedphoenix")
    cfg = build_config(spec, phoenix, seed=1)
    assert (cfg.rounds, cfg.num_clients, cfg.client.local_epochs, cfg.strategy.fraction_train) == (1200, 100, 5, 0.1)
    assert cfg.strategy.params == {"theta": 1 / 64, "reset_rounds": 1000}
    assert (cfg.data.name, cfg.model.name, cfg.data.params["root"]) == ("cifar10", "vgg", "/data/cifar10")
    assert {s["strategy"]["name"] for s in settings(spec)} == {"fedphoenix", "fedavg", "fedprox", "fedmut"}


def test_quick_plan_has_the_skew_control(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "fedphoenix", "--scale", "quick", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for fedphoenix_quick:")
    assert "pathological" in out
    spec = load_claim("fedphoenix_quick")
    fits, generalises = spec.controls.positive[:2]  # the skew control: same train loss, lower test accuracy
    assert fits.metric == "train/loss" and fits.kind == "equivalence" and 0 < fits.margin <= 0.1
    assert fits.better["data.partition"] == "pathological" and fits.worse["data.partition"] == "dirichlet"
    assert generalises.metric is None and generalises.margin >= 0.05  # the spec's metric, eval/accuracy
    assert generalises.better["data.partition"] == "dirichlet" and generalises.worse["data.partition"] == "pathological"
    assert {c.better["strategy"] for c in [fits, generalises]} == {"fedavg"}
    assert "train/loss" in spec.tracked_metrics()


@pytest.mark.slow
@pytest.mark.parallel
def test_first_rounds_of_the_paper_experiment_on_a_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedsim.runner import run_experiment

    write_cifar_fixture(tmp_path / "cifar", per_file=40)
    monkeypatch.chdir(tmp_path)
    cli = [f"data.params.root={tmp_path / 'cifar'}", "rounds=2", "num_clients=4", "strategy.fraction_train=0.5",
           "model.params.width=0.125", "model.params.hidden=32", "client.local_epochs=1", "tracking.enabled=false"]
    spec = load_claim("fedphoenix", scale="paper", extra_overrides=cli)
    phoenix = next(s for s in settings(spec) if s["strategy"]["name"] == "fedphoenix")
    cfg = build_config(spec, phoenix, seed=1)
    assert cfg.data.params["root"] == str(tmp_path / "cifar") and cfg.strategy.params["reset_rounds"] == 1000
    summary = run_experiment(cfg)
    finals = summary.history.final()
    for key in ("eval/accuracy", "eval/loss", "train/loss"):
        assert key in finals and math.isfinite(finals[key]), (key, finals)
    assert len(summary.history.series("eval/accuracy")) >= 2
