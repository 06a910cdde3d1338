#!/usr/bin/env bash
# Installs what megapar needs into the current Python: torch (pinned CPU build 2.13.0, only if no
# torch is installed: an existing CUDA torch is kept), the requirements, and megapar itself
# (editable; the CUDA kernels are compiled only when a CUDA torch and nvcc are present).
# pip runs quietly; each step says first what it installs and roughly how much.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { echo "install [$1/3]: $2" >&2; }
if python3 -c "import torch" 2>/dev/null; then
    step 1 "torch $(python3 -c 'import torch; print(torch.__version__)') is installed: kept"
else
    step 1 "torch 2.13.0, CPU build (about 190 MB to download, 750 MB installed; a few minutes on a slow link)"
    python3 -m pip install -q torch==2.13.0   # never unpinned
fi
step 2 "the requirements of requirements-dev.txt (numpy, tokenizers, data-prep libraries, transformers, torchao,"\
" pytest, ruff; about 300 MB installed, nothing to do for what is there already)"
python3 -m pip install -q -r requirements-dev.txt
step 3 "megapar itself, editable (seconds; compiling the CUDA kernels, with a CUDA torch and nvcc, takes minutes)"
python3 -m pip install -q --no-build-isolation -e .
echo "install: done" >&2
