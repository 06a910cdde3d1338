"""Train a SentencePiece BPE tokenizer on your text (offline, deterministic).

    python tools/train_tokenizer.py --input docs.jsonl [more.txt ...] --json-keys text \\
        --model-prefix out/spm --vocab-size 8000
    python tools/preprocess_data.py --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model out/spm.model ...

.jsonl(.gz) inputs are read through --json-keys; other files are used as plain text.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile

from megapar.data.tokenizer import TokenizerError
from megapar.data.train_tokenizer import train_sentencepiece
from megapar.errors import USER_ERROR_EXIT, OneLineErrorParser


def _jsonl_to_text(path: str, keys: list[str], out) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{lineno}: malformed JSON line ({e})")
            for k in keys:
                for ln in str(obj.get(k, "")).split("\n"):
                    if ln.strip():
                        out.write(ln + "\n")


def main(argv=None) -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSON-lines or text files to train on")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="the JSON keys whose text is read")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000, help="pieces in the SentencePiece model")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"], help="SentencePiece's model type")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = []
        for i, path in enumerate(args.input):
            if not os.path.isfile(path):
                print(f"error: --input {path!r} not found", file=sys.stderr)
                return USER_ERROR_EXIT
            if ".jsonl" in path or path.endswith(".json"):
                txt = os.path.join(tmp, f"{i}.txt")
                with open(txt, "w", encoding="utf-8") as out:
                    _jsonl_to_text(path, args.json_keys, out)
                inputs.append(txt)
            else:
                inputs.append(path)
        try:
            model = train_sentencepiece(inputs, args.model_prefix, args.vocab_size, args.model_type)
        except TokenizerError as e:
            print(f"error: {e}; pass a larger --vocab-size or more text", file=sys.stderr)
            return USER_ERROR_EXIT
    print(f"wrote {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
