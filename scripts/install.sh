#!/usr/bin/env bash
# Installs what megapar needs into the current Python: torch (pinned CPU build 2.13.0, only if no
# torch is installed: an existing CUDA torch is kept), the requirements, and megapar itself
# (editable; the CUDA kernels are compiled only when a CUDA torch and nvcc are present).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0   # never unpinned
python3 -m pip install -q -r requirements-dev.txt
python3 -m pip install -q --no-build-isolation -e .
