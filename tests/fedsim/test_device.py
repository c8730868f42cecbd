"""engine.device (fedsim/device.py): names, the GPU checks before a run starts, and the CPU path."""

from __future__ import annotations

import pytest
import torch

from fedsim import config as C
from fedsim.cli import main
from fedsim.device import resolve_device, to_host
from fedsim.engine.runtime import check_device
from fedsim.errors import ConfigError
from fedsim.registry import LEARNERS


def cfg_of(*overrides: str) -> C.ExperimentConfig:
    return C.load_config("fedavg_digits", ["tracking.enabled=false", *overrides], {})


def test_names_resolve_and_bad_names_say_what_is_allowed(monkeypatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="cpu, auto, cuda or cuda:N"):
        cfg_of("engine.device=gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"sees 1 CUDA GPU\(s\) \(cuda:0..cuda:0\)"):
        resolve_device("cuda:1")


def test_a_gpu_run_is_checked_before_it_starts(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    supervised = LEARNERS.get("supervised")
    check_device(cfg_of("engine.device=cuda"), supervised)  # a GPU here, a learner that uses it: fine
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        check_device(cfg_of("engine.device=cuda"), type("CpuLearner", (), {}))
    check_device(cfg_of("engine.device=auto"), type("CpuLearner", (), {}))  # auto: the CPU for it
    check_device(cfg_of("engine.device=cuda", "privacy.enabled=true", "privacy.epsilon=3"), supervised)  # DP too
    with pytest.raises(ConfigError, match="engine.ray.actor_num_gpus"):
        check_device(cfg_of("engine.device=cuda", "engine.name=ray"), supervised)
    with pytest.raises(ConfigError, match="engine.flower.client_num_gpus"):
        check_device(cfg_of("engine.device=cuda", "engine.name=flower"), supervised)


def test_cuda_on_a_machine_without_one_is_a_one_line_error(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["run", "fedavg", "engine.device=cuda", "--rounds", "1", "--no-tracking"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine.device=cuda" in err[0] and "Traceback" not in err[0]


def test_the_learner_keeps_model_and_data_on_its_device_and_replies_on_the_host() -> None:
    learner = LEARNERS.get("supervised")(cfg_of("engine.device=auto", "model.name=mlp"),
                                         LEARNERS.params("supervised", {}, "client.params"))
    assert next(learner.model.parameters()).device == learner.device
    x, _ = learner._tensors(learner.data.client_train(0))
    assert x.device == learner.device
    arrays = learner.init_arrays()
    assert all(a.device.type == "cpu" for a in arrays.values())
    t = torch.ones(3)
    copy = to_host(t)
    assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr()  # a copy, never the live tensor
