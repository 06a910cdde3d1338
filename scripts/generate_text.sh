#!/usr/bin/env bash
# Sample from a checkpoint: bash scripts/generate_text.sh --load CKPT [tools/generate_text.py flags]
# Runs python directly for one process, torchrun with tp x pp processes otherwise.
# PYTHON may be overridden from the environment; TORCHRUN, when set, is run directly (no launcher).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TP=1
PP=1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --tensor-model-parallel-size|--tensor-parallel) TP="${args[$((i + 1))]:-1}" ;;
    --tensor-model-parallel-size=*|--tensor-parallel=*) TP="${args[$i]#*=}" ;;
    --pipeline-model-parallel-size|--pipeline-parallel) PP="${args[$((i + 1))]:-1}" ;;
    --pipeline-model-parallel-size=*|--pipeline-parallel=*) PP="${args[$i]#*=}" ;;
  esac
done
N=$((TP * PP))
if [ "$N" -gt 1 ] && [ -n "${TORCHRUN:-}" ]; then
  exec $TORCHRUN --standalone --nproc-per-node "$N" "$HERE/../tools/generate_text.py" "$@"
fi
if [ "$N" -gt 1 ]; then  # torchrun behind megapar.launch: Ctrl-C / SIGTERM stop rank 0, which stops the others
  export PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}"
  exec ${PYTHON:-python} -m megapar.launch --generate --standalone --nproc-per-node "$N" -- "$@"
fi
exec ${PYTHON:-python} "$HERE/../tools/generate_text.py" "$@"
