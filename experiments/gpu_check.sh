#!/usr/bin/env bash
# One call on the GPU machine: the GPU test suite, then the benchmarks.
#   bash experiments/gpu_check.sh [tests|tests_train|tests_other|kernel|train|model|train_model|energy|patterns|switch|captured|decode|train_memory|capacity|demo|l1_target|tune|train_tune|memory|quality|l1sweep|heavy|prefill|all]...
# Results (JSON and logs) go to $OUT when set, else results/ (README.md, "Reproduce").
set -uo pipefail
cd "$(dirname "$0")/.."
# An unknown target (a typo) stops here, before anything runs.
TARGETS=" tests tests_train tests_other kernel train model train_model energy patterns switch "
TARGETS+="captured decode train_memory capacity demo l1_target tune train_tune memory quality "
TARGETS+="l1sweep heavy prefill all "
for what in "${@:-all}"; do
  case "$TARGETS" in
    *" $what "*) ;;
    *) echo "gpu_check.sh: unknown target '$what'; targets:$TARGETS" >&2; exit 2 ;;
  esac
done
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
# Output names end in the card they ran on (h200, h100, ...): timings compare only
# between runs on the same kind of card.
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h[0-9]+|a[0-9]+|b[0-9]+' | head -1 | tr 'A-Z' 'a-z')
CARD=${CARD:-gpu}
status=0
# A time-boxed pretraining run saves and stops on SIGINT: timeout's 124 or the run's 130.
stopped_ok() { [ "$1" -eq 0 ] || [ "$1" -eq 124 ] || [ "$1" -eq 130 ]; }
# The GPU tests (interpret=False) into $OUT/$1, with pytest's further arguments.
gpu_tests() { local log=$1; shift; python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$log"; }
for what in "${@:-all}"; do
  case "$what" in
    tests|all) gpu_tests "gpu_tests_${CARD}.log" || status=1 ;;&
    # The suite in two halves (~3 and ~6 minutes on an H200) where one run must stay short.
    tests_train) gpu_tests "gpu_tests_sparse_train_${CARD}.log" tests/pallas_kernels/sparse_train \
                   || status=1 ;;
    tests_other) gpu_tests "gpu_tests_other_${CARD}.log" --ignore=tests/pallas_kernels/sparse_train \
                   || status=1 ;;
    kernel|all) python3 -m experiments.benchmark --mode=kernel --out="$OUT/kernel_${CARD}.json" \
                  || status=1 ;;&
    train|all) python3 -m experiments.benchmark --mode=train --out="$OUT/train_${CARD}.json" \
                 || status=1 ;;&
    memory|all) python3 -m experiments.check_train_memory 2>&1 | tee "$OUT/train_memory_${CARD}.log" \
                  || status=1 ;;&
    model) python3 -m experiments.benchmark --mode=model --reps=15 --model_compressions=2 --out="$OUT/model_${CARD}.json" \
             || status=1 ;;
    train_model) python3 -m experiments.benchmark --mode=train_model --reps=8 \
                   --model_presets="${TRAIN_MODEL_PRESETS:-2b,1.5b}" \
                   --out="$OUT/train_model_${CARD}.json" || status=1 ;;
    energy)  # joules per token of the training step (NVML); TRAIN_MODEL_WORKDIR: also a run's
      python3 -m experiments.benchmark --mode=train_model --reps=8 --energy \
        --model_presets="${TRAIN_MODEL_PRESETS:-2b,1.5b}" \
        --out="$OUT/train_model_energy_${CARD}.json" || status=1
      if [ -n "${TRAIN_MODEL_WORKDIR:-}" ]; then
        python3 -m experiments.benchmark --mode=train_model --reps=8 --energy \
          --train_model_workdir="$TRAIN_MODEL_WORKDIR" \
          --out="$OUT/train_model_trained_${CARD}.json" || status=1
      fi ;;
    patterns)  # the training op and the 2B training step on each activation pattern
      for p in uniform skew heavy_rows; do
        sigma=1.0; [ "$p" = heavy_rows ] && sigma=0.35
        python3 -m experiments.benchmark --mode=train --reps=20 --train_nnz=10,29,40 \
          --pattern="$p" --pattern_sigma="$sigma" --out="$OUT/train_pattern_${p}_${CARD}.json" \
          || status=1
      done
      python3 -m experiments.benchmark --mode=train_model --reps=8 --model_presets=2b \
        --model_nnz=31.4 --pattern=skew --out="$OUT/train_model_2b_skew_${CARD}.json" \
        || status=1 ;;
    switch)  # the per-layer switch's rule at the 2B and 125M layer shapes, judged on held-out patterns
      python3 -m experiments.benchmark --mode=switch --model_presets=2b --train_tokens=16384 \
        --reps=10 --switch_l0_grid=2,4,8,16,24,32,40,48,56,64,80,96 \
        --switch_holdout=skew:0.75,skew:1.25,heavy_rows:0.2 --out="$OUT/switch_2b_m16384_${CARD}.json" || status=1
      python3 -m experiments.benchmark --mode=switch --model_presets=125m --train_tokens=32768 \
        --reps=10 --switch_l0_grid=2,3,4,6,8,12,16,24,32,40,48,56,64,80,96 \
        --switch_holdout=skew:0.75,skew:1.25,heavy_rows:0.2 --out="$OUT/switch_125m_m32768_${CARD}.json" || status=1 ;;
    captured)  # two 125M L1 runs (dense FFNs), their neuron profiles, the op on their layers
      for lam in ${L1_SWEEP:-2e-4 1e-3}; do
        run="/tmp/runs/125m_captured_$lam"
        python3 -m experiments.pretrain --flagfile=experiments/configs/125m.flags \
          --l1_coef="$lam" --ffn_impl=dense --workdir="$run" > "$OUT/125m_l1_${lam}_log.txt" 2>&1 \
          || status=1
        python3 -m experiments.neuron_profile --workdir="$run" --out="$OUT/profile_125m_l1_$lam.json" \
          || status=1
        python3 -m experiments.benchmark --mode=train --pattern=captured --capture_workdir="$run" \
          --capture_layers=0,3,6,9,11 --reps=20 --out="$OUT/train_captured_125m_l1_${lam}_${CARD}.json" \
          || status=1
      done ;;
    heavy)  # the inference MLP under heavy-tailed rows at the default C = 8, uniform and skew beside it
      for p in heavy_rows uniform skew; do
        sigma=0.35; [ "$p" = skew ] && sigma=1.0
        python3 -m experiments.benchmark --mode=kernel --pattern="$p" --pattern_sigma="$sigma" \
          --tokens=4096,16384,65536 --nnz=29 --sweep_nnz= --reps=15 --compression=8 \
          --out="$OUT/kernel_${p}_c8_tail_gate_rows_${CARD}.json" || status=1
      done ;;
    decode)  # the FFN at decode sizes on two patterns, then 1.5B generation
      for p in uniform skew; do
        python3 -m experiments.benchmark --mode=decode --decode_tokens=1,8,64 --reps=20 \
          --pattern="$p" --decode_kernel_trace --out="$OUT/decode_ffn_${p}_${CARD}.json" || status=1
      done
      python3 -m experiments.benchmark --mode=generate --model_presets=1.5b \
        --generate_batch=1,8,64 --reps=3 --decode_kernel_trace --generate_attention=auto,xla \
        --out="$OUT/generate_1.5b_${CARD}.json" || status=1
      python3 -m experiments.benchmark_attention_layout \
        --out="$OUT/attention_layout_decode_${CARD}.json" || status=1
      python3 -m experiments.benchmark_decode_attention \
        --out="$OUT/decode_attention_kernel_${CARD}.json" || status=1 ;;
    prefill)  # the 1.5B prefill: attention kernel against XLA's ops, then TwELL against dense by size
      python3 -m experiments.benchmark --mode=generate --model_presets=1.5b \
        --generate_batch=8 --reps=3 --decode_kernel_trace --generate_attention=auto,xla \
        --out="$OUT/generate_1.5b_b8_prompt_attention_${CARD}.json" || status=1
      python3 -m experiments.benchmark --mode=generate --model_presets=1.5b \
        --generate_batch=8,16,32,64 --generate_new=32 --reps=5 \
        --out="$OUT/generate_1.5b_prefill_b8_b64_no_prefill_command_buffers_${CARD}.json" \
        || status=1
      python3 -m experiments.benchmark_prompt_attention \
        --out="$OUT/prompt_attention_kernel_${CARD}.json" || status=1 ;;
    train_memory)  # peak memory of the real 2B step, dense and sparse (residuals saved, then recomputed)
      python3 -m experiments.benchmark_memory --preset=2b --batch=8 --seq=2048 \
        --ffn_impls=dense,sparse --model_nnz=29 --out="$OUT/train_step_memory_2b_${CARD}.json" \
        || status=1
      python3 -m experiments.benchmark_memory --preset=2b --batch=8 --seq=2048 \
        --ffn_impls=sparse --model_nnz=29 --set=sparse_save_residuals=false \
        --out="$OUT/train_step_memory_2b_sparse_recompute_${CARD}.json" || status=1 ;;
    capacity)  # the largest 2B micro-batch that fits, per FFN, to within CAPACITY_STEP sequences
      # The platform allocator: the BFC pool ran dense out of memory at batch 128, far
      # below the card (docs/results.md, "Training-step memory"). Both fit 224.
      # sparse_recompute: the sparse FFN with its ELL residuals recomputed in the backward.
      for impl in ${CAPACITY_IMPLS:-dense sparse}; do
        set_args=(); ffn="$impl"
        [ "$impl" = sparse_recompute ] && ffn=sparse && set_args=(--set=sparse_save_residuals=false)
        python3 -m experiments.benchmark_memory --preset=2b --batch=224 --calib_batch=64 \
          --seq=2048 --ffn_impls="$ffn" --model_nnz=29 --steps=2 --allocator=platform \
          --search_batch --max_batch=320 --search_step="${CAPACITY_STEP:-4}" ${set_args[@]+"${set_args[@]}"} \
          --out="$OUT/train_step_capacity_2b_${impl}_${CARD}.json" || status=1
      done ;;
    demo)  # the 1B run and its dense twin (README "A real run"); needs data/stdlib_bpe8k
      mkdir -p "$OUT/1b_demo"
      for run in 1b_demo_dense 1b_demo; do
        python3 -m experiments.pretrain --flagfile="experiments/configs/$run.flags" --energy \
          > "$OUT/1b_demo/${run}_log.txt" 2>&1 || status=1
        cp "runs/$run/metrics.jsonl" "$OUT/1b_demo/${run#1b_demo_}.jsonl"
      done
      mv "$OUT/1b_demo/1b_demo.jsonl" "$OUT/1b_demo/sparse.jsonl"
      python3 -m experiments.quality_report --baseline="$OUT/1b_demo/dense.jsonl" \
        "$OUT/1b_demo/sparse.jsonl" --plot="$OUT/1b_demo/curves.png" || status=1
      python3 -m experiments.benchmark --mode=train_model --train_model_workdir=runs/1b_demo \
        --reps=8 --energy --train_model_run_switch \
        --out="$OUT/1b_demo/train_model_1b_demo_run_switch_${CARD}.json" || status=1 ;;
    l1_target)  # 125M runs with the L1 penalty on the FFN weights, at each L1_SWEEP lambda
      for lam in ${L1_SWEEP:-1e-4 1e-3 1e-2}; do
        python3 -m experiments.pretrain --flagfile=experiments/configs/125m.flags \
          --set=sparsity.l1_target=weights --l1_coef="$lam" --ffn_impl=dense \
          --checkpoint_every=1000 --workdir="/tmp/runs/125m_wl1_$lam" \
          > "$OUT/125m_weights_l1_${lam}_log.txt" 2>&1 || status=1
        cp "/tmp/runs/125m_wl1_$lam/metrics.jsonl" "$OUT/125m_weights_l1_${lam}_metrics.jsonl"
      done ;;
    tune) python3 -m experiments.benchmark --mode=tune --out="$OUT/tune_${CARD}.json" || status=1 ;;
    train_tune) python3 -m experiments.benchmark --mode=train_tune \
                  --out="$OUT/train_tune_${CARD}.json" || status=1 ;;
    quality)  # the 125M L1 run and its dense baseline; QUALITY_ARGS adds flags
      for cfg in 125m 125m_dense; do
        # QUALITY_TIMEOUT_S bounds each run: SIGINT makes the loop save and stop cleanly.
        # shellcheck disable=SC2086
        timeout --signal=INT --kill-after=60 "${QUALITY_TIMEOUT_S:-0}" \
          python3 -m experiments.pretrain --flagfile="experiments/configs/$cfg.flags" \
          --workdir="/tmp/runs/$cfg" ${QUALITY_ARGS:-} 2>&1 | tee "$OUT/${cfg}_log.txt"
        stopped_ok $? || status=1
        cp "/tmp/runs/$cfg/metrics.jsonl" "$OUT/${cfg}_metrics.jsonl"
        cp "/tmp/runs/$cfg/metrics.png" "$OUT/${cfg}_metrics.png"
      done ;;
    l1sweep)  # 125M runs at each L1_SWEEP lambda, then their model body at real sparsity
      dirs=()
      for lam in ${L1_SWEEP:-2e-4 1e-3}; do
        dirs+=("/tmp/runs/125m_l1_$lam")
        # shellcheck disable=SC2086
        timeout --signal=INT --kill-after=60 "${QUALITY_TIMEOUT_S:-0}" \
          python3 -m experiments.pretrain --flagfile=experiments/configs/125m.flags \
          --l1_coef="$lam" --workdir="/tmp/runs/125m_l1_$lam" ${QUALITY_ARGS:-} \
          > "$OUT/125m_l1_${lam}_log.txt" 2>&1
        stopped_ok $? || status=1
        grep "summary:" "$OUT/125m_l1_${lam}_log.txt"
        cp "/tmp/runs/125m_l1_$lam/metrics.jsonl" "$OUT/125m_l1_${lam}_metrics.jsonl"
      done
      python3 -m experiments.benchmark --mode=model --model_presets= --reps=20 \
        --model_workdirs="$(IFS=,; echo "${dirs[*]}")" --out="$OUT/model_trained_125m_${CARD}.json" \
        || status=1 ;;
  esac
done
exit $status
