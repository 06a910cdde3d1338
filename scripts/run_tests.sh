#!/usr/bin/env bash
# Runs the CPU test suite (GPU-marked tests skip themselves without CUDA; see scripts/gpu_checks.sh).
# Installs megapar and its dependencies first if they are missing (fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, megapar, tiktoken, pytest" 2>/dev/null || bash scripts/install.sh
exec python3 -m pytest -q -m "not gpu" "$@"
