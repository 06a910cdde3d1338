#!/usr/bin/env bash
# GPT-2 pretraining launcher: starts torchrun with the right number of processes and passes
# every other flag to `python -m megapar.pretrain_gpt2` (Megatron-LM flag names).
#
#   bash scripts/pretrain_gpt2.sh                                   # embedded default, 1 process
#   bash scripts/pretrain_gpt2.sh --tensor-parallel 2 --pipeline-parallel 2 [megatron flags]
#   bash scripts/pretrain_gpt2.sh --nproc-per-node 2 --recipe 345m-tp2 [data flags]  # a named run recipe
#     (python -m megapar.config.recipes lists them with their GPU counts; a flag you give overrides the recipe's)
#
# Processes per node: --nproc-per-node N, else every visible GPU, else tp x pp on CPU (dp = 1).
# Several nodes: run it once on every node with the same --nnodes N, --master-addr (the address of
# node rank 0) and --master-port, and --node-rank 0..N-1 (torchrun's static rendezvous; checked by
# megapar.launch before any process starts). On SLURM: scripts/slurm_pretrain_gpt2.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
# fresh machine: install first (find_spec looks for the packages without the seconds an import of torch takes)
python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('megapar')))" \
  || bash scripts/install.sh

tp=1; pp=1; nproc=""; launcher=()
args=("$@"); passthrough=()
i=0
while [ $i -lt ${#args[@]} ]; do
  a="${args[$i]}"; v="${args[$((i+1))]:-}"
  case "$a" in
    --tensor-parallel|--tensor-model-parallel-size) tp="$v"; passthrough+=("$a" "$v"); i=$((i+2));;
    --pipeline-parallel|--pipeline-model-parallel-size) pp="$v"; passthrough+=("$a" "$v"); i=$((i+2));;
    --nproc-per-node) nproc="$v"; i=$((i+2));;
    --nnodes|--node-rank|--master-addr|--master-port) launcher+=("$a" "$v"); i=$((i+2));;
    *) passthrough+=("$a"); i=$((i+1));;
  esac
done

if [ -z "$nproc" ]; then
  gpus=0   # torch counts the GPUs it may use (CUDA_VISIBLE_DEVICES); without nvidia-smi there are none to count
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  fi
  if [ "$gpus" -gt 0 ]; then nproc="$gpus"; chosen="every visible GPU"
  elif [[ "$tp" =~ ^[0-9]+$ && "$pp" =~ ^[0-9]+$ ]] && [ $((tp * pp)) -gt 0 ]; then
    nproc=$((tp * pp)); chosen="tensor x pipeline on the command line, on a CPU"
  else nproc=1; chosen="one"  # a --tensor-parallel / --pipeline-parallel that is no size: refused by name
  fi
  export MEGAPAR_NPROC_CHOSEN="$chosen"  # megapar.launch names the count that fits when the flags need another
fi
if [ ${#launcher[@]} -eq 0 ]; then launcher=(--standalone); fi

# CPU threads per process: the cores shared evenly (torchrun would otherwise force 1).
# (A --nproc-per-node that is not a whole number >= 1 is refused by megapar.launch below.)
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc 2>/dev/null || echo 1)
  if [[ "$nproc" =~ ^[0-9]+$ ]] && [ "$nproc" -gt 0 ] && [ "$cores" -gt "$nproc" ]; then
    export OMP_NUM_THREADS=$((cores / nproc))
  else
    export OMP_NUM_THREADS=1
  fi
fi
# megapar.launch checks the flags at this world size before any process starts, then runs torchrun:
# a user error ends in one `error:` line (no torchrun report), and SIGTERM / Ctrl-C reach the training
# processes once (with --exit-signal-handler: finish the iteration, save, exit 0). See its docstring.
exec python3 -m megapar.launch "${launcher[@]}" --nproc-per-node "$nproc" -- "${passthrough[@]}"
