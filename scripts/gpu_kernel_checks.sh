#!/usr/bin/env bash
# All GPU checks of the fused kernels in one pass (run on a lent GPU; logs under $OUT):
#   1. AOT build through setup.py and a JIT build through megapar.kernels, in parallel
#   2. parity vs float64 + benchmark table (benchmarks/bench_kernels.py)
#   3. compute-sanitizer memcheck over a small parity run (no caching allocator, so that
#      out-of-bounds accesses hit real allocation edges)
#   4. the GPU-marked pytest file, and the LayerNorm backward with 512-thread blocks
source "$(dirname "$0")/lib/usage.sh"  # --help: the usage above, nothing else
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megapar_kernel_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MEGAPAR_KERNEL_CACHE=${MEGAPAR_KERNEL_CACHE:-/tmp/megapar_kernel_cache}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
date -u | tee -a "$OUT/device.txt"

t0=$SECONDS
( $PY setup.py build_ext --inplace >"$OUT/aot_build.log" 2>&1; echo "aot build rc=$?" >>"$OUT/aot_build.log" ) &
aot=$!
MEGAPAR_FORCE_JIT=1 $PY -c "import logging; logging.basicConfig(level=logging.INFO)
from megapar.kernels import load_fused_kernels, fused_kernels_source
load_fused_kernels(); print('jit build ok:', fused_kernels_source())" 2>&1 | tee "$OUT/jit_build.log"
wait $aot
tail -1 "$OUT/aot_build.log"
$PY -c "import torch, megapar_kernels; print('aot import ok:', megapar_kernels.__file__)" 2>&1 | tail -1
echo "builds: $((SECONDS - t0)) s"

MEGAPAR_FORCE_JIT=1 $PY benchmarks/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== compute-sanitizer memcheck (small parity run)"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 MEGAPAR_FORCE_JIT=1 timeout 150 compute-sanitizer --tool memcheck \
  --print-limit 20 $PY benchmarks/bench_kernels.py --quick --parity-only --out /tmp/san >"$OUT/sanitizer.log" 2>&1
echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|parity:" "$OUT/sanitizer.log"

MEGAPAR_FORCE_JIT=1 timeout 60 $PY -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py 2>&1 | tail -3
echo "== LayerNorm backward, 1024-thread blocks (comparison)"
MEGAPAR_LN_BWD_THREADS=1024 MEGAPAR_FORCE_JIT=1 timeout 60 $PY benchmarks/bench_kernels.py --bench-only --ln-bwd-only \
  --out /tmp/bt512 2>&1 | grep -E "ln_bwd .*fused"
echo "== table"; cat "$OUT/bench_table.md"
exit $bench_rc
