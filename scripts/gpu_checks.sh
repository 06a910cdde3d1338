#!/usr/bin/env bash
# Everything that needs a GPU, in one pass (run on a lent GPU machine from the repo root):
#   bash scripts/gpu_checks.sh [kernels] [tests [PYTEST_SELECTION...]] [bench CONFIG...]
# GPT-2 BPE files are read from $GPT2_DIR (default tests/data/gpt2: encoder.json, vocab.bpe).
# Logs go to $OUT (or ./gpu_logs); each part prints a short table last.
source "$(dirname "$0")/lib/usage.sh"  # --help: the usage above, nothing else
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-gpu_logs}"; mkdir -p "$OUT"
GPT2_DIR="${GPT2_DIR:-tests/data/gpt2}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
while [ $# -gt 0 ]; do
  case "$1" in
    kernels) bash scripts/gpu_kernel_checks.sh 2>&1 | tee "$OUT/kernels.log" | tail -30; shift;;
    tests) shift; selected=()  # optional pytest selections (files, file::test); training runs: tests/gpu_runs.py
           while [ $# -gt 0 ] && [ "$1" != kernels ] && [ "$1" != bench ]; do selected+=("$1"); shift; done
           [ ${#selected[@]} -gt 0 ] || selected=($(grep -rl --include="test_*.py" "mark.gpu" tests))
           python3 -m pytest -q -m gpu -rf --durations=10 "${selected[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25;;
    bench) shift; configs=()
           while [ $# -gt 0 ] && [ "$1" != kernels ] && [ "$1" != tests ]; do configs+=("$1"); shift; done
           python3 benchmarks/bench_train.py --vocab-file "$GPT2_DIR/encoder.json" --merge-file "$GPT2_DIR/vocab.bpe" \
             --log-dir "$OUT" --configs "${configs[@]}" 2>&1 | tee "$OUT/bench.log" | grep -v "^{" ;;
    *) echo "unknown part $1 (kernels | tests | bench CONFIG...)"; exit 2;;
  esac
done
