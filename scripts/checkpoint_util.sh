#!/usr/bin/env bash
# Reshard / inspect a megapar checkpoint; all flags go to tools/checkpoint_util.py, e.g.
#   bash scripts/checkpoint_util.sh --load-dir ckpt --save-dir ckpt_tp1 --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 tools/checkpoint_util.py "$@"
