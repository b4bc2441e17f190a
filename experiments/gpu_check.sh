#!/usr/bin/env bash
# One call on the GPU machine: the GPU test suite, then the benchmarks.
#   bash experiments/gpu_check.sh [tests|kernel|train|model|tune|quality|all]...
# Results (JSON and logs) go to $OUT when set (the device tool), else results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
# grain and its missing dependencies travel as wheels in .whl (BUILD.md).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
for what in "${@:-all}"; do
  case "$what" in
    tests|all) python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
                 || status=1 ;;&
    kernel|all) python3 -m experiments.benchmark --mode=kernel --out="$OUT/kernel_h200.json" \
                  || status=1 ;;&
    train|all) python3 -m experiments.benchmark --mode=train --out="$OUT/train_h200.json" \
                 || status=1 ;;&
    model) python3 -m experiments.benchmark --mode=model --reps=10 --out="$OUT/model_h200.json" \
             || status=1 ;;
    tune) python3 -m experiments.benchmark --mode=tune --out="$OUT/tune_h200.json" || status=1 ;;
    quality)  # issue 3 (a): the 125M L1 run and its dense baseline; QUALITY_ARGS adds flags
      for cfg in 125m 125m_dense; do
        # shellcheck disable=SC2086
        python3 -m experiments.pretrain --flagfile="experiments/configs/$cfg.flags" \
          --workdir="/tmp/runs/$cfg" ${QUALITY_ARGS:-} || status=1
        cp "/tmp/runs/$cfg/metrics.jsonl" "$OUT/${cfg}_metrics.jsonl"
        cp "/tmp/runs/$cfg/metrics.png" "$OUT/${cfg}_metrics.png"
      done ;;
  esac
done
exit $status
