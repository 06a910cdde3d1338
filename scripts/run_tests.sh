#!/usr/bin/env bash
# Runs the CPU test suite (GPU-marked tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q -m "not gpu" "$@"
