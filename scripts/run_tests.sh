#!/usr/bin/env bash
# Lints the code, then runs the CPU test suite (GPU-marked tests skip themselves without CUDA; see
# scripts/gpu_checks.sh).
#   bash scripts/run_tests.sh            full CPU suite (what CI runs via .ci/run): -m "not gpu"
#   bash scripts/run_tests.sh --quick    quick tier (its size and time: docs/testing.md): -m "not gpu and not slow"
# Every other argument goes to pytest (a -m given there replaces the tier's; -n 0 runs the tests in this one
# process). See docs/testing.md.
# Tests run in 2 pytest-xdist worker processes, each test file in one worker (--dist loadscope: a file's
# module-scoped fixtures, often training runs, are built once); tests marked `serial` run while no other
# test does (tests/conftest.py).
# Installs megapar and its dependencies first if they are missing (fresh machine). The lint is
# `python3 -m ruff check .` (rules in pyproject.toml): a finding fails the run before any test; without
# ruff installed (requirements-dev.txt pins it) the lint is skipped with a note.
source "$(dirname "$0")/lib/usage.sh"  # --help: the usage above, nothing else
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not gpu"; args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then marks="not gpu and not slow"; else args+=("$a"); fi
done
python3 -c "import torch, megapar, tiktoken, pytest, xdist" 2>/dev/null || bash scripts/install.sh
if python3 -m ruff --version >/dev/null 2>&1; then
  python3 -m ruff check . || { echo "lint failed (python3 -m ruff check .): fix the findings above" >&2; exit 1; }
else
  echo "lint: skipped, ruff is not installed (pip install -r requirements-dev.txt installs it)" >&2
fi
exec python3 -m pytest -q -n 2 --dist loadscope -m "$marks" ${args[@]+"${args[@]}"}
