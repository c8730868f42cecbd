"""Checkpoint and resume: the same final metrics as an uninterrupted run, even after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord
from mlflow import MlflowClient

from fedsim import config as C
from fedsim.cli import main
from fedsim.engine import checkpoint as ckpt
from fedsim.runner import run_experiment

BASE = ["strategy.fraction_train=0.5", "strategy.fraction_evaluate=0.25"]


def load(*overrides: str) -> C.ExperimentConfig:
    return C.load_config("fedavg_digits", [*BASE, *overrides], {})


def accuracy_history(uri: str, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "eval/accuracy"))


def test_resume_from_a_mid_run_checkpoint_matches_an_uninterrupted_run(in_tmp, tracking_uri) -> None:
    full = run_experiment(load("rounds=4"), tracking_uri=tracking_uri)
    assert not (in_tmp / "fedsim-checkpoints" / full.run_id).exists()  # removed once finished
    part = run_experiment(load("rounds=2", "engine.keep_checkpoint=true"), tracking_uri=tracking_uri)
    resumed = run_experiment(load("rounds=4"), tracking_uri=tracking_uri, resume_run_id=part.run_id)
    assert resumed.run_id == part.run_id
    assert resumed.history.as_rows() == full.history.as_rows()
    assert accuracy_history(tracking_uri, part.run_id) == accuracy_history(tracking_uri, full.run_id)
    assert MlflowClient(tracking_uri).get_run(part.run_id).info.status == "FINISHED"


def test_fedmut_strategy_state_survives_a_resume(in_tmp, tracking_uri) -> None:
    """FedMut keeps the previous global model between rounds: it must be checkpointed."""
    over = ["num_clients=10", "strategy.name=fedmut", "strategy.params.alpha=2.0", "strategy.fraction_train=0.3"]
    full = run_experiment(load("rounds=3", *over), tracking_uri=tracking_uri)
    part = run_experiment(load("rounds=2", "engine.keep_checkpoint=true", *over), tracking_uri=tracking_uri)
    saved = ckpt.load(in_tmp / "fedsim-checkpoints" / part.run_id)
    assert any(k.startswith("_previous/") for k in saved.strategy_state)
    resumed = run_experiment(load("rounds=3", *over), tracking_uri=tracking_uri, resume_run_id=part.run_id)
    assert resumed.history.as_rows() == full.history.as_rows()


def test_kill_9_then_resume_gives_identical_final_metrics(in_tmp, tracking_uri) -> None:
    args = ["run", "fedavg_digits", "--rounds", "8", *BASE, "--tracking-uri", tracking_uri, "--quiet"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "fedsim", *args], cwd=in_tmp, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, killed_after = time.monotonic() + 240, None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            metas = list((in_tmp / "fedsim-checkpoints").glob("*/meta.json"))
            if metas and json.loads(metas[0].read_text())["round"] >= 2:
                proc.send_signal(signal.SIGKILL)
                killed_after = json.loads(metas[0].read_text())["round"]
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert killed_after is not None and proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    run_id = metas[0].parent.name
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "RUNNING"  # kill -9: nobody closed it
    assert main([*args, "--resume", run_id]) == 0
    reference = run_experiment(load("rounds=8"), tracking_uri=tracking_uri)
    assert accuracy_history(tracking_uri, run_id) == accuracy_history(tracking_uri, reference.run_id)
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "FINISHED"


def test_resume_errors_are_one_line(in_tmp, tracking_uri, capsys) -> None:
    part = run_experiment(load("rounds=1", "engine.keep_checkpoint=true"), tracking_uri=tracking_uri)
    with pytest.raises(C.ConfigError, match="differs from the checkpointed one at client.lr"):
        run_experiment(load("rounds=2", "client.lr=0.5"), tracking_uri=tracking_uri, resume_run_id=part.run_id)
    with pytest.raises(C.ConfigError, match="no checkpoint in"):
        run_experiment(load("rounds=2"), tracking_uri=tracking_uri, resume_run_id="0123abcd")
    state = next((in_tmp / "fedsim-checkpoints" / part.run_id).glob("state-*.safetensors"))
    state.write_bytes(state.read_bytes()[:-8] + b"corrupt!")
    assert main(["run", "fedavg_digits", "--rounds", "2", *BASE, "--tracking-uri", tracking_uri,
                 "--resume", part.run_id]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0]
    assert main(["run", "fedavg_digits", "--no-tracking", "--resume", part.run_id]) == 2


def test_checkpoint_files_hold_no_pickles(tmp_path) -> None:
    """safetensors + JSON only: a checkpoint cannot execute code when loaded."""
    class Strategy:
        def __init__(self) -> None:
            self._previous = ArrayRecord({"w": torch.arange(3.0)})

    state = ckpt.strategy_state(Strategy())
    ckpt.save(tmp_path, ckpt.Checkpoint(round=1, config_yaml="x: 1", arrays={"w": torch.ones(2)},
                                        strategy_state=state, rng=ckpt.rng_states()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "records.jsonl", "state-1.safetensors"]
    loaded = ckpt.load(tmp_path)
    fresh = Strategy()
    fresh._previous = None
    ckpt.restore_strategy_state(fresh, loaded.strategy_state)
    assert torch.equal(fresh._previous.to_torch_state_dict()["w"], torch.arange(3.0))
    assert Path(tmp_path / "meta.json").read_text().startswith("{")
