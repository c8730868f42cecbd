"""Sweeps: grid parsing, spec errors, and a 2×2 grid on a local Ray runtime with a failing trial and resume."""

from __future__ import annotations

import math

import pytest
from mlflow import MlflowClient

from fedsim.cli import main
from fedsim.errors import ConfigError
from fedsim.sweep import (
    SweepSpec,
    check_cuda,
    load_sweep,
    parse_grid,
    preflight_resources,
    run_sweep,
    trial_config,
    trial_device,
    trial_resources,
    trials_at_once,
)


def test_grid_values_are_typed_and_section_names_expand() -> None:
    grid = parse_grid(["eps=1,3,.inf", "strategy=fedsvd,ffa_lora", "client.lr=0.01,0.1", "rounds=2,4",
                       "data.partition.name=iid"], "fedsvd")
    assert grid == {"eps": [1, 3, math.inf], "strategy.name": ["fedsvd", "ffa_lora"], "client.lr": [0.01, 0.1],
                    "rounds": [2, 4], "data.partition.name": ["iid"]}
    for bad in (["eps"], ["=1,2"], ["lr="]):
        with pytest.raises(ConfigError, match="KEY=V1,V2"):
            parse_grid(bad, "fedavg")


def test_sweep_specs_and_their_errors() -> None:
    name, spec = load_sweep("fedsvd")  # experiments/sweeps/fedsvd.yaml
    assert name == "fedsvd" and spec.grid == {"eps": [1, 3, 6], "strategy.name": ["fedsvd", "ffa_lora"]}
    assert spec.seeds == [0, 1, 2] and spec.cpus_per_trial == 1
    name, spec = load_sweep("fedavg_digits", grid=["client.lr=0.1,0.2"], seeds=2, overrides=["rounds=1"],
                            cpus_per_trial=2, max_concurrent=1)
    assert (spec.experiment, spec.seeds, spec.overrides, spec.cpus_per_trial, spec.max_concurrent) == \
        ("fedavg_digits", [0, 1], ["rounds=1"], 2, 1)
    cfg = trial_config(spec, {"client.lr": 0.2}, seed=1)
    assert cfg.engine.name == "local" and cfg.engine.threads_per_client == 2 and cfg.client.lr == 0.2
    with pytest.raises(ConfigError, match="give a grid"):
        load_sweep("fedavg_digits")
    with pytest.raises(ConfigError, match="unknown experiment"):
        load_sweep("no_such_experiment", grid=["rounds=1,2"])
    with pytest.raises(ConfigError, match="cpus_per_trial must be > 0"):
        load_sweep("fedavg_digits", grid=["rounds=1,2"], cpus_per_trial=0)
    with pytest.raises(ConfigError, match="centralised-track"):
        load_sweep("paretoq", grid=["params.steps=1,2"])


# -- gpus_per_trial ---------------------------------------------------------------------------------
@pytest.fixture
def head_address():
    """The address of a port that accepts connections, standing in for a cluster's head (the sweep
    checks that its --address answers before anything else)."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch):
    """Make torch report ``n`` CUDA GPUs (this machine may have none); returns the setter."""
    import torch

    def set_gpus(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_gpus


def test_gpus_per_trial_from_a_sweep_file_and_the_flag(tmp_path) -> None:
    assert load_sweep("fedsvd")[1].gpus_per_trial == 0  # the default: CPU trials
    path = tmp_path / "gpu_sweep.yaml"
    path.write_text("experiment: fedavg_digits\ngpus_per_trial: 0.5\ncpus_per_trial: 2\ngrid: {client.lr: [0.1]}\n")
    _, spec = load_sweep(str(path))
    assert (spec.gpus_per_trial, spec.cpus_per_trial) == (0.5, 2)
    assert load_sweep(str(path), gpus_per_trial=1)[1].gpus_per_trial == 1  # the flag wins over the file
    assert load_sweep("fedavg_digits", grid=["rounds=1"], gpus_per_trial=0.25)[1].gpus_per_trial == 0.25


@pytest.mark.parametrize("gpus, summary", [(None, "1 CPU(s) per trial"), ("0.5", "1 CPU(s) and 0.5 GPU(s) per trial")])
def test_the_gpus_per_trial_flag_reaches_the_sweep(gpus, summary, monkeypatch, capsys) -> None:
    import fedsim.sweep

    seen = []

    def fake_run_sweep(name, spec, **kwargs):
        seen.append(spec)
        kwargs["on_checked"]()  # the trials checked: the summary is printed now
        raise ConfigError("stopped by the test")

    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(fedsim.sweep, "run_sweep", fake_run_sweep)
    argv = ["sweep", "fedavg_digits", "--grid", "rounds=1", *(["--gpus-per-trial", gpus] if gpus else [])]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert seen[0].gpus_per_trial == (float(gpus) if gpus else 0.0)
    assert summary in out and (gpus or "GPU" not in out)
    assert "stopped by the test" in err


@pytest.mark.parametrize("gpus", [-1, -0.5, math.nan, math.inf, 9, 1.5, 0.00001])
def test_bad_gpus_per_trial_is_a_one_line_error(gpus) -> None:
    with pytest.raises(ConfigError, match=r"gpus_per_trial must be 0 \(no GPU\), a fraction .* got ") as exc:
        load_sweep("fedavg_digits", grid=["rounds=1"], gpus_per_trial=gpus)
    assert "\n" not in str(exc.value)


def test_good_gpus_per_trial_values_load() -> None:
    for gpus in (0, 0.0001, 0.25, 0.5, 1, 2, 8):
        assert load_sweep("fedavg_digits", grid=["rounds=1"], gpus_per_trial=gpus)[1].gpus_per_trial == gpus


def test_no_cuda_gpu_is_a_one_line_error_with_the_fix(fake_gpus, monkeypatch, tmp_path, capsys) -> None:
    import torch

    fake_gpus(0)
    with pytest.raises(ConfigError, match=r"gpus_per_trial=0.5 but torch sees no CUDA GPU here; run "
                                          r"`make install-gpu` .* or drop --gpus-per-trial"):
        check_cuda(SweepSpec(experiment="fedavg_digits", gpus_per_trial=0.5))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CPU trials need no CUDA check"))
    check_cuda(SweepSpec(experiment="fedavg_digits"))
    # through the CLI: exit 2, one line, before MLflow or Ray start
    fake_gpus(0)
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "fedavg_digits", "--grid", "rounds=1", "--gpus-per-trial", "1"]) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert len(err) == 1 and "make install-gpu" in err[0]
    assert "per trial" not in out  # no summary of a sweep that never starts
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "fedsim-sweeps").exists()


def test_more_gpus_per_trial_than_this_machine_has(fake_gpus, monkeypatch, head_address) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake_gpus(1)
    with pytest.raises(ConfigError, match=r"gpus_per_trial=2 exceeds the 1 GPU\(s\) of this machine; lower it "
                                          r"\(--gpus-per-trial\)"):
        preflight_resources(SweepSpec(experiment="fedavg_digits", gpus_per_trial=2), None)
    preflight_resources(SweepSpec(experiment="fedavg_digits", gpus_per_trial=1), None)
    preflight_resources(SweepSpec(experiment="fedavg_digits", gpus_per_trial=2), head_address)  # checked by Ray
    fake_gpus(0)
    preflight_resources(SweepSpec(experiment="fedavg_digits"), None)  # CPU trials: no GPU needed


class Checked(Exception):
    """Raised by ``on_checked``: the sweep passed its checks (and would now record and start Ray)."""


def _raise_checked() -> None:
    raise Checked


def test_gpu_trials_on_a_cluster_look_for_the_gpus_there(fake_gpus, monkeypatch, tmp_path, head_address) -> None:
    """With --address (or RAY_ADDRESS) the trials run on the cluster's nodes: this machine needs no GPU
    (the cluster's are counted once connected), while a local sweep still needs one here."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    fake_gpus(0)
    _, spec = load_sweep("fedavg_digits", grid=["rounds=1"], gpus_per_trial=1)
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU here"):
        run_sweep("gpu", spec, on_checked=_raise_checked)
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        trial_config(spec, {}, seed=0)  # the device is resolved on this machine
    cfg = trial_config(spec, {}, seed=0, gpus_here=False)
    assert cfg.engine.device == "cuda"  # kept for the trial (checked there), not swapped for the check
    with pytest.raises(Checked):
        run_sweep("gpu", spec, address=head_address, on_checked=_raise_checked)
    monkeypatch.setenv("RAY_ADDRESS", head_address)
    with pytest.raises(Checked):
        run_sweep("gpu", spec, on_checked=_raise_checked)
    assert not (tmp_path / "fedsim-sweeps").exists()


def test_trial_resources_are_cpus_and_gpus_only_when_asked() -> None:
    assert trial_resources(SweepSpec(experiment="x", cpus_per_trial=2)) == {"cpu": 2}
    assert trial_resources(SweepSpec(experiment="x", cpus_per_trial=2, gpus_per_trial=0.5)) == {"cpu": 2, "gpu": 0.5}


def test_trials_at_once_fit_the_cpus_and_the_gpus() -> None:
    def at_once(cluster: dict[str, float], **kw) -> int:
        return trials_at_once(SweepSpec(experiment="x", **kw), cluster)

    assert at_once({"CPU": 8}) == 8 and at_once({"CPU": 8, "GPU": 0}) == 8  # CPU trials ignore GPUs
    assert at_once({"CPU": 8, "GPU": 1}, cpus_per_trial=2) == 4
    assert at_once({"CPU": 8, "GPU": 1}, gpus_per_trial=0.5) == 2  # two trials share the GPU
    assert at_once({"CPU": 8, "GPU": 2}, gpus_per_trial=1) == 2
    assert at_once({"CPU": 3, "GPU": 2}, gpus_per_trial=0.5) == 3  # CPU-bound
    assert at_once({"CPU": 64, "GPU": 1}, gpus_per_trial=0.1) == 10  # 1 // 0.1 would be 9
    assert at_once({"CPU": 8, "GPU": 4}, gpus_per_trial=0.5, max_concurrent=3) == 3
    with pytest.raises(ConfigError, match=r"gpus_per_trial=2 exceeds the 1 GPUs Ray sees; lower it "
                                          r"\(--gpus-per-trial\)"):
        at_once({"CPU": 8, "GPU": 1}, gpus_per_trial=2)
    with pytest.raises(ConfigError, match=r"gpus_per_trial=1 exceeds the 0 GPUs Ray sees"):
        at_once({"CPU": 8}, gpus_per_trial=1)
    with pytest.raises(ConfigError, match=r"cpus_per_trial=16 exceeds the 8 CPUs Ray sees; lower it "
                                          r"\(--cpus-per-trial\)"):
        at_once({"CPU": 8, "GPU": 8}, cpus_per_trial=16, gpus_per_trial=1)


def test_trial_device() -> None:
    assert [trial_device(d, 0) for d in ("cpu", "auto")] == ["cpu", "auto"]
    assert [trial_device(d, 0.5) for d in ("cpu", "auto", "cuda", "cuda:0")] == ["cuda", "cuda", "cuda", "cuda:0"]
    assert trial_device("cuda:1", 2) == "cuda:1"
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=rf"engine.device={device} in a sweep needs GPUs reserved per trial .* "
                                              r"add --gpus-per-trial"):
            trial_device(device, 0)
    with pytest.raises(ConfigError, match=r"engine.device=cuda:1 but each trial sees 1 GPU\(s\) \(cuda:0..cuda:0"):
        trial_device("cuda:1", 0.5)


def test_a_trial_runs_on_cuda_only_when_it_reserves_gpus(fake_gpus, monkeypatch) -> None:
    _, cpu = load_sweep("fedavg_digits", grid=["rounds=1"])
    assert trial_config(cpu, {"rounds": 1}, seed=0).engine.device == "cpu"
    with pytest.raises(ConfigError, match="add --gpus-per-trial"):  # whatever GPUs this machine has
        trial_config(load_sweep("fedavg_digits", grid=["rounds=1"], overrides=["engine.device=cuda"])[1], {}, seed=0)
    fake_gpus(2)
    _, gpu = load_sweep("fedavg_digits", grid=["rounds=1"], gpus_per_trial=0.5)
    cfg = trial_config(gpu, {"rounds": 1}, seed=0)
    assert (cfg.engine.device, cfg.engine.name, cfg.engine.threads_per_client) == ("cuda", "local", 1)
    assert trial_config(gpu, {"engine.device": "cuda:0"}, seed=0).engine.device == "cuda:0"
    _, two = load_sweep("fedavg_digits", grid=["rounds=1"], gpus_per_trial=2)
    assert trial_config(two, {"engine.device": "cuda:1"}, seed=0).engine.device == "cuda:1"
    from clients.supervised import SupervisedLearner

    monkeypatch.setattr(SupervisedLearner, "supports_device", False)
    with pytest.raises(ConfigError, match=r"learner 'supervised' runs on the CPU only, .* drop --gpus-per-trial"):
        trial_config(gpu, {"rounds": 1}, seed=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_2x2_sweep_reports_a_failed_trial_runs_the_others_and_resumes(tmp_path, tracking_uri, capsys,
                                                                        monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps at 80 columns otherwise
    # pathological partitioning with 2 clients fails at data build: 2 of the 4 trials fail
    args = ["sweep", "fedavg_digits", "rounds=1", "num_clients=2", "--grid", "client.lr=0.05,0.2",
            "data.partition.name=iid,pathological", "--seeds", "1", "--tracking-uri", tracking_uri,
            "--max-concurrent", "2"]
    assert main(args) == 1  # some trials failed
    out = capsys.readouterr().out
    assert "trials: 2 done, 0 running, 2 failed, 0 pending" in out and "trial failed:" in out
    assert "leaves some of the 10 classes to no client" in out  # the trial's own one-line error
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("kind") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED"
    assert sorted(c.info.run_name for c in children if c.info.status == "FINISHED") == \
        ["lr=0.05, partition=iid | seed 0", "lr=0.2, partition=iid | seed 0"]
    accuracy = {c.info.run_name: c.data.metrics["eval/accuracy"] for c in children if c.info.status == "FINISHED"}
    assert "results.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    # resume: the finished trials are read back, not rerun; the failed ones run again (and fail again)
    assert main([*args, "--resume", parent.info.run_id]) == 1
    out = capsys.readouterr().out
    assert "trials: 2 done, 0 running, 2 failed, 0 pending (2 read back)" in out
    runs = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    finished = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.info.status == "FINISHED"]
    assert {r.info.run_name: r.data.metrics["eval/accuracy"] for r in finished} == accuracy
    # compare: the same table from MLflow, plots logged to the parent
    assert main(["compare", parent.info.run_id, "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    assert f"{accuracy['lr=0.2, partition=iid | seed 0']:.4f} ± 0.0000" in out
    assert {"compare/eval_accuracy/curves.png", "compare/comparison.md"} <= {
        a.path for d in client.list_artifacts(parent.info.run_id, "compare")
        for a in ([d] if not d.is_dir else client.list_artifacts(parent.info.run_id, d.path))}
