"""The centralised track's runner: typed params, MLflow run, tables/plots, errors, claim checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from mlflow import MlflowClient

from fedsim.contracts.central import CentralContext
from fedsim.central_runner import run_central
from fedsim import config as C
from fedsim.cli import main
from fedsim.registry import CENTRAL


@dataclass
class EchoParams:
    steps: int = 3
    scale: float = 1.0


@CENTRAL.register("_echo", params=EchoParams, summary="test method: a seeded random walk")
def run_echo(ctx: CentralContext) -> dict[str, float]:
    rng = ctx.rng("walk")
    value = 0.0
    with ctx.progress(ctx.params.steps, "walking") as bar:
        for step in range(1, ctx.params.steps + 1):
            value += ctx.params.scale * float(rng.normal())
            ctx.log_metrics({"walk/value": value}, step=step)
            bar.advance()
    ctx.log_table([{"step": ctx.params.steps, "value": value}], "final")
    return {"final_value": value}


@pytest.fixture
def echo_yaml(tmp_path):
    path = tmp_path / "echo.yaml"
    path.write_text("method: _echo\ndescription: echo\nseed: 0\nparams:\n  steps: 4\n")
    return path


def test_same_seed_same_metrics_and_mlflow_run(echo_yaml, tracking_uri) -> None:
    a = run_central(C.load_central_config(str(echo_yaml)), tracking_uri=tracking_uri)
    b = run_central(C.load_central_config(str(echo_yaml)), tracking_uri=tracking_uri)
    c = run_central(C.load_central_config(str(echo_yaml), seed=5), tracking_uri=tracking_uri)
    assert a.metrics == b.metrics != c.metrics
    assert [r.round for r in a.history.records] == [1, 2, 3, 4]
    assert a.history.final()["final_value"] == a.metrics["final_value"]
    run = MlflowClient(tracking_uri).get_run(a.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kind"] == "central"
    assert run.data.params["params.steps"] == "4"
    arts = {x.path for x in MlflowClient(tracking_uri).list_artifacts(a.run_id, "tables")}
    assert arts == {"tables/final.csv", "tables/final.md"}


def test_cli_runs_a_central_experiment_and_rejects_federated_flags(echo_yaml, tracking_uri, capsys) -> None:
    assert main(["run", str(echo_yaml), "params.steps=2", "--tracking-uri", tracking_uri]) == 0
    assert "final_value" in capsys.readouterr().out
    assert main(["run", str(echo_yaml), "--rounds", "3", "--no-tracking"]) == 2
    err = capsys.readouterr().err
    assert "applies to federated experiments" in err and "(its length: params.steps)" in err  # a real knob
    assert main(["run", str(echo_yaml), "params.stpes=2", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stpes" in err[0]


def test_claim_check_over_central_params(tmp_path, echo_yaml, tracking_uri) -> None:
    claim = tmp_path / "claim.yaml"
    claim.write_text(f"experiment: {echo_yaml}\ngrid:\n  params.scale: [1.0, 2.0]\nseeds: [0, 1]\n"
                     "metric: final_value\n")
    assert main(["reproduce", str(claim), "--tracking-uri", tracking_uri]) == 0
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 4 and all(r.data.tags["kind"] == "central" for r in children)
    # scale 2 doubles every step of the same seeded walk
    by = {(r.data.params["params.scale"], r.data.params["seed"]): r.data.metrics["final_value"] for r in children}
    assert by[("2.0", "1")] == pytest.approx(2 * by[("1.0", "1")])
