#!/usr/bin/env bash
# OpenWebText: Pushshift dumps -> URLs -> pages -> clean, deduplicated JSON lines -> .bin/.idx.
#
#   bash scripts/prepare_openwebtext.sh --dumps DIR --output DIR --vocab-file encoder.json --merge-file vocab.bpe \
#        [--workers N] [--concurrency N] [--timeout S] [--retries N] [--backoff S] [--max-bytes B] [--max-urls N]
#        [--proxy URL] [--min-karma 3] [--seed 1234] [--no-progress]
#        [--fix-tasks TASK,TASK...] [--decontaminate-with EVAL.jsonl]...
#
# Optional steps: --fix-tasks runs cleanup_fix_dataset after cleanup (tasks: remove_512, remove_256_javascript,
# remove_512_non_english, ftfy_fix_text, general_cleaning); --decontaminate-with (repeatable) runs filter_ngrams
# after remove_duplicates, cutting 13-gram overlaps with those evaluation sets (JSON lines, "text" key).
#
# Resumable: each step writes its output atomically and is skipped when that output exists; the download
# step skips URLs that already have a result. Re-running after an interruption finishes the job and gives
# the same files as an uninterrupted run. Per-step kept/removed counts: OUTPUT/summaries/*.json.
# Each step is a CLI in data_prep/openwebtext/ (python -m data_prep.openwebtext.<step> --help).
set -euo pipefail

usage() { echo "usage: bash scripts/prepare_openwebtext.sh --dumps DIR --output DIR [FLAGS]"; sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "error: $*" >&2; exit 2; }

DUMPS= OUT= VOCAB= MERGE= WORKERS=$(nproc 2>/dev/null || echo 2) CONC=16 TIMEOUT=10 RETRIES=2 BACKOFF=1
MAXBYTES=5242880 MAXURLS=-1 PROXY= KARMA=3 SEED=1234 PROGRESS= FIX_TASKS= EVAL_FILES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dumps) DUMPS=$2; shift 2 ;;          --output) OUT=$2; shift 2 ;;
    --vocab-file) VOCAB=$2; shift 2 ;;     --merge-file) MERGE=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;      --concurrency) CONC=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;      --retries) RETRIES=$2; shift 2 ;;
    --backoff) BACKOFF=$2; shift 2 ;;      --max-bytes) MAXBYTES=$2; shift 2 ;;
    --max-urls) MAXURLS=$2; shift 2 ;;     --proxy) PROXY=$2; shift 2 ;;
    --min-karma) KARMA=$2; shift 2 ;;      --seed) SEED=$2; shift 2 ;;
    --no-progress) PROGRESS=--no-progress; shift ;;
    --fix-tasks) FIX_TASKS=$2; shift 2 ;;  --decontaminate-with) EVAL_FILES+=("$2"); shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown argument $1" >&2; usage ;;
  esac
done
[ -n "$DUMPS" ] && [ -n "$OUT" ] || die "--dumps and --output are required (see --help)"
[ -d "$DUMPS" ] || die "--dumps $DUMPS is not a folder; point it at your Pushshift RS_* dumps"
[ -f "$VOCAB" ] && [ -f "$MERGE" ] || die "--vocab-file/--merge-file must be the local GPT-2 encoder.json and vocab.bpe"

for f in ${EVAL_FILES[@]+"${EVAL_FILES[@]}"}; do
  [ -f "$f" ] || die "--decontaminate-with $f: no such file; give the evaluation set as JSON lines ({\"text\": ...} per line)"
done
for t in ${FIX_TASKS//,/ }; do
  case "$t" in remove_512|remove_256_javascript|remove_512_non_english|ftfy_fix_text|general_cleaning) ;;
    *) die "--fix-tasks: unknown task '$t'; choose from remove_512, remove_256_javascript, remove_512_non_english, ftfy_fix_text, general_cleaning" ;;
  esac
done

DUMPS=$(realpath "$DUMPS"); OUT=$(realpath -m "$OUT"); VOCAB=$(realpath "$VOCAB"); MERGE=$(realpath "$MERGE")
EVAL_ABS=(); for f in ${EVAL_FILES[@]+"${EVAL_FILES[@]}"}; do EVAL_ABS+=("$(realpath "$f")"); done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ${#EVAL_ABS[@]} -gt 0 ]; then  # a bad evaluation file stops here, not after the downloads
  "$PY" -c 'import sys; from data_prep.openwebtext.filter_ngrams import check_eval_files as c; c(sys.argv[1:])' \
    "${EVAL_ABS[@]}"
fi
S="$OUT/summaries"
mkdir -p "$S"
# A killed earlier run can leave atomic-write temp files (.NAME.XXXX.tmp; megapar/atomic.py): never outputs.
find "$OUT" -name '.*.tmp' -type f -delete
step() {  # step NAME OUTPUT MODULE ARGS...: run unless OUTPUT exists
  local name=$1 output=$2 module=$3; shift 3
  if [ -e "$output" ]; then echo "[$name] done already ($output), skipping" >&2; return; fi
  echo "[$name] running" >&2
  "$PY" -m "data_prep.openwebtext.$module" "$@" $PROGRESS --summary "$S/$name.json"
}

# 1. Always runs: finished dumps are skipped inside the step.
"$PY" -m data_prep.openwebtext.extract_urls --psdir "$DUMPS" --outdir "$OUT/urls" --min-karma "$KARMA" \
  $PROGRESS --summary "$S/extract_urls.json"
step dedup_urls "$OUT/urls_deduped" dedup_urls --input-dir "$OUT/urls" --output-dir "$OUT/urls_deduped"
step blacklist_urls "$OUT/clean_urls.txt" blacklist_urls "$OUT/urls_deduped" --output "$OUT/clean_urls.txt"
# 4. Always runs until complete: finished URLs are skipped inside the step; merged.jsonl marks completion.
if [ ! -e "$OUT/merged.jsonl" ]; then
  "$PY" -m data_prep.openwebtext.download --url-file "$OUT/clean_urls.txt" --output-dir "$OUT/download" \
    --concurrency "$CONC" --timeout "$TIMEOUT" --retries "$RETRIES" --backoff "$BACKOFF" --max-bytes "$MAXBYTES" \
    --max-urls "$MAXURLS" ${PROXY:+--proxy "$PROXY"} $PROGRESS --summary "$S/download.json"
fi
step merge "$OUT/merged.jsonl" merge "$OUT/download" --output "$OUT/merged.jsonl"
step cleanup "$OUT/cleaned.jsonl" cleanup "$OUT/merged.jsonl" "$OUT/cleaned.jsonl" \
  --vocab-file "$VOCAB" --merge-file "$MERGE" --workers "$WORKERS"
# An optional step asked for after the steps that follow it were done without it would not apply: refuse.
late() {  # late FLAG STEP_OUTPUT NEXT_OUTPUT
  [ -e "$2" ] || [ ! -e "$3" ] || die "$1 was not given when $OUT was built, whose $(basename "$3") exists already; \
write to a new --output to run with $1"
}
CLEAN="$OUT/cleaned.jsonl"
if [ -n "$FIX_TASKS" ]; then  # 6b. optional fix-up pass
  late --fix-tasks "$OUT/fixed/cleaned_cleaned.jsonl" "$OUT/near_duplicates.jsonl"
  step cleanup_fix_dataset "$OUT/fixed/cleaned_cleaned.jsonl" cleanup_fix_dataset --input-files "$CLEAN" \
    --tasks ${FIX_TASKS//,/ } --output-path "$OUT/fixed" --workers "$WORKERS"
  CLEAN="$OUT/fixed/cleaned_cleaned.jsonl"
fi
step find_duplicates "$OUT/near_duplicates.jsonl" find_duplicates "$CLEAN" \
  --output "$OUT/near_duplicates.jsonl" --seed "$SEED" --workers "$WORKERS"
step group_duplicates "$OUT/duplicate_groups.jsonl" group_duplicates "$OUT/near_duplicates.jsonl" \
  "$OUT/duplicate_groups.jsonl"
step remove_duplicates "$OUT/deduplicated.jsonl" remove_duplicates "$OUT/duplicate_groups.jsonl" \
  "$CLEAN" "$OUT/deduplicated.jsonl"
FINAL="$OUT/deduplicated.jsonl"
if [ ${#EVAL_ABS[@]} -gt 0 ]; then  # optional task decontamination
  late --decontaminate-with "$OUT/decontaminated.jsonl" "$OUT/openwebtext.jsonl"
  step filter_ngrams "$OUT/decontaminated.jsonl" filter_ngrams "$FINAL" "$OUT/decontaminated.jsonl" \
    --decontaminate-with "${EVAL_ABS[@]}"
  FINAL="$OUT/decontaminated.jsonl"
fi
step shuffle "$OUT/openwebtext.jsonl" shuffle "$FINAL" "$OUT/openwebtext.jsonl" --seed "$SEED"

PREFIX="$OUT/openwebtext"
if [ -e "${PREFIX}_text_document.idx" ]; then
  echo "[preprocess_data] done already, skipping" >&2
else
  echo "[preprocess_data] running" >&2
  "$PY" tools/preprocess_data.py --input "$OUT/openwebtext.jsonl" --output-prefix "$PREFIX" --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" --append-eod --workers "$WORKERS"
fi
"$PY" -m megapar.data.validate "${PREFIX}_text_document"
echo "done: ${PREFIX}_text_document.{bin,idx}" >&2
