#!/usr/bin/env bash
# Layout check on one multi-GPU machine: GPT-2 345M, bf16, tp x pp with ZeRO-1,
# ITERS iterations with a checkpoint mid-way, resumed for RESUME more; and the same data, seed
# and global batch at (1,1,1) on one GPU for the first BASE iterations; losses side by side.
# PRECISION=--bf16 (default), --fp16 or " " (fp32: the layouts then agree to float32 rounding).
#   TP=2 PP=2 NPROC=4 ITERS=200 RESUME=50 BASE=50 bash scripts/layout_check.sh
source "$(dirname "$0")/lib/usage.sh"  # --help: the usage above, nothing else
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-layout_logs}"; mkdir -p "$OUT"; GPT2_DIR="${GPT2_DIR:-tests/data/gpt2}"
TP="${TP:-2}"; PP="${PP:-2}"; NPROC="${NPROC:-4}"; ITERS="${ITERS:-200}"; RESUME="${RESUME:-50}"; BASE="${BASE:-50}"
CK="${CK:-/tmp/megapar_layout_ckpt}"; rm -rf "$CK"
common=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
        --micro-batch-size 4 --global-batch-size 32 ${PRECISION:---bf16} --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20
        --lr-decay-iters $((ITERS + RESUME)) --hidden-dropout 0 --attention-dropout 0 --seed 1234 --log-interval 1
        --eval-interval 100 --eval-iters 2 --tokenizer-type GPT2BPETokenizer
        --vocab-file "$GPT2_DIR/encoder.json" --merge-file "$GPT2_DIR/vocab.bpe")
bash scripts/pretrain_gpt2.sh --nproc-per-node "$NPROC" --tensor-parallel "$TP" --pipeline-parallel "$PP" \
  --use-distributed-optimizer "${common[@]}" --train-iters "$ITERS" --save "$CK" --save-interval $((ITERS / 2)) \
  > "$OUT/layout_${TP}x${PP}.log" 2>&1; echo "layout run rc=$?"
bash scripts/pretrain_gpt2.sh --nproc-per-node "$NPROC" --tensor-parallel "$TP" --pipeline-parallel "$PP" \
  --use-distributed-optimizer "${common[@]}" --train-iters $((ITERS + RESUME)) --load "$CK" --save "$CK" \
  > "$OUT/layout_${TP}x${PP}_resumed.log" 2>&1; echo "resumed run rc=$?"
bash scripts/pretrain_gpt2.sh --nproc-per-node 1 "${common[@]}" --train-iters "$BASE" --save "" \
  > "$OUT/layout_1x1.log" 2>&1; echo "baseline run rc=$?"
grep -h "number of parameters\|memory (MB)\|loaded checkpoint\|saving checkpoint" "$OUT"/layout_${TP}x${PP}*.log | sort | uniq | head -20
for f in "$OUT/layout_${TP}x${PP}.log" "$OUT/layout_${TP}x${PP}_resumed.log" "$OUT/layout_1x1.log"; do
  echo "$f: $(grep '^ iteration' "$f" | tail -1 | grep -o 'elapsed time per iteration (ms): [0-9.]*\|tokens/s: [0-9]*\|MFU: [0-9.%]*' | tr '\n' ' ')"
done
python3 tools/compare_losses.py "$OUT/layout_${TP}x${PP}.log" "$OUT/layout_1x1.log" --every 5 --tolerance 0.02
