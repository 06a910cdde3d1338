#!/usr/bin/env bash
# Installs what megapar needs into the current Python: torch 2.13.0 (only if no torch is installed: an existing
# torch, CUDA or CPU, is kept), the requirements, and megapar itself (editable; the CUDA kernels are compiled only
# when a CUDA torch and nvcc are present). Each step says first what it installs and roughly how much; pip shows its
# download progress.
#   bash scripts/install.sh            install what is missing
#   bash scripts/install.sh --help     this text
# Which torch: with an NVIDIA GPU (nvidia-smi or /dev/nvidia0), PyPI's build (CUDA on Linux, about 2.7 GB with its
# CUDA libraries). Without one, the CPU build (about 190 MB) from PyTorch's CPU wheel index
# (https://download.pytorch.org/whl/cpu, PyPI for torch's own dependencies); where that index is unreachable (a 5 s
# probe), from pip's configured index, after saying which build that resolves to (a local CPU wheel, or PyPI's CUDA
# build: about 2.7 GB).
set -euo pipefail
case "${1:-}" in
  -h|--help) echo "usage: bash scripts/install.sh"; sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "error: install.sh takes no arguments (got '$1'); run: bash scripts/install.sh" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH=torch==2.13.0   # never unpinned
CPU_INDEX=https://download.pytorch.org/whl/cpu
step() { echo "install [$1/3]: $2" >&2; }

# Prints the build `pip install $TORCH` would fetch from pip's configured index: "CPU" or "CUDA".
configured_build() {
  python3 -m pip install --dry-run --ignore-installed --quiet --report - "$TORCH" 2>/dev/null | python3 -c '
import json, sys
names = [i["metadata"]["name"].lower() for i in json.load(sys.stdin)["install"]]
print("CUDA" if any(n.startswith("nvidia-") for n in names) else "CPU")' || echo "unknown"
}

reachable() {  # $1: URL; answers within 5 s
  python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2>/dev/null
}

install_torch() {
  if command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; then
    step 1 "torch 2.13.0 with CUDA (an NVIDIA GPU is present): about 2.7 GB to download with its CUDA libraries"
    python3 -m pip install "$TORCH"
  elif reachable "$CPU_INDEX/torch/"; then
    step 1 "torch 2.13.0, CPU build from $CPU_INDEX (about 190 MB to download, 750 MB installed)"
    python3 -m pip install --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple "$TORCH"
  else
    case "$(configured_build)" in
      CPU) step 1 "torch 2.13.0, CPU build from pip's configured index ($CPU_INDEX is unreachable; about 190 MB)" ;;
      CUDA) step 1 "torch 2.13.0 from pip's configured index: $CPU_INDEX is unreachable, so this is the CUDA build"\
" (about 2.7 GB with its CUDA libraries; it runs on a CPU too). To get the 190 MB CPU build instead, stop now"\
" (Ctrl-C) and run: pip install --index-url $CPU_INDEX $TORCH" ;;
      *) step 1 "torch 2.13.0 from pip's configured index ($CPU_INDEX is unreachable; 190 MB for a CPU build,"\
" about 2.7 GB for the CUDA build)" ;;
    esac
    python3 -m pip install "$TORCH"
  fi
}

if python3 -c "import torch" 2>/dev/null; then
  step 1 "torch $(python3 -c 'import torch; print(torch.__version__)') is installed: kept"
else
  install_torch
fi
step 2 "the requirements of requirements-dev.txt (numpy, tokenizers, data-prep libraries, transformers, torchao,"\
" pytest, ruff; about 300 MB installed, nothing to do for what is there already)"
python3 -m pip install -r requirements-dev.txt
step 3 "megapar itself, editable (seconds; compiling the CUDA kernels, with a CUDA torch and nvcc, takes minutes)"
python3 -m pip install -q --no-build-isolation -e .
echo "install: done" >&2
