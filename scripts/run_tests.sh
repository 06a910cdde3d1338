#!/usr/bin/env bash
# Runs the CPU test suite (GPU-marked tests skip themselves without CUDA; see scripts/gpu_checks.sh).
#   bash scripts/run_tests.sh            full CPU suite (what CI runs via .ci/run): -m "not gpu"
#   bash scripts/run_tests.sh --quick    quick tier, about 5 minutes on 2 cores: -m "not gpu and not slow"
# Every other argument goes to pytest (a -m given there replaces the tier's). See docs/testing.md.
# Installs megapar and its dependencies first if they are missing (fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not gpu"; args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then marks="not gpu and not slow"; else args+=("$a"); fi
done
python3 -c "import torch, megapar, tiktoken, pytest" 2>/dev/null || bash scripts/install.sh
exec python3 -m pytest -q -m "$marks" ${args[@]+"${args[@]}"}
