"""Convert JSON lines to Megatron `.bin/.idx` (same CLI and byte-identical output as Megatron-LM).

    python tools/preprocess_data.py --input docs.jsonl[.gz] --json-keys text \\
        --output-prefix out/my-gpt2 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod --workers 4

writes out/my-gpt2_text_document.{bin,idx}. See megapar/data/preprocess.py for the behaviour.
"""
from __future__ import annotations

import argparse
import signal
import sys

from megapar.data.preprocess import Interrupted, PreprocessConfig, PreprocessError, preprocess, request_stop
from megapar.data.tokenizer import TOKENIZER_TYPES, TokenizerError
from megapar.errors import USER_ERROR_EXIT, OneLineErrorParser


def get_args(argv=None) -> argparse.Namespace:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file (optionally .gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line")
    g.add_argument("--split-sentences", action="store_true", help="not supported (Megatron's nltk mode)")
    g.add_argument("--keep-newlines", action="store_true", help="only meaningful with --split-sentences")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed lines instead of stopping at the first")
    g.add_argument("--allow-empty", action="store_true",
                   help="write an empty dataset when the input has no text (otherwise an error)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES, help="Megatron's tokenizer names")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocabulary (encoder.json / vocab.json)")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges (vocab.bpe / merges.txt)")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model file")
    g.add_argument("--tiktoken-name", default=None, help="tiktoken encoding name for TikTokenizer")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    g.add_argument("--lang", default="english", help="ignored (sentence splitting language)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_text_document.bin/.idx (one pair per --json-keys key)")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="accepted for old scripts")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="worker processes for tokenization")
    g.add_argument("--partitions", type=int, default=1, help="only 1 is supported")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    g.add_argument("--keep-sequential-samples", action="store_true", help="ignored with --partitions 1")
    args = p.parse_args(argv)
    if args.split_sentences:
        p.error("--split-sentences is not supported; preprocess whole documents (drop the flag)")
    if args.partitions != 1:
        p.error("--partitions > 1 is not supported; use --workers N for parallelism")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    cfg = PreprocessConfig(input=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys,
                           tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                           tiktoken_name=args.tiktoken_name, append_eod=args.append_eod,
                           workers=args.workers, log_interval=args.log_interval,
                           skip_bad_lines=args.skip_bad_lines, allow_empty=args.allow_empty)
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = preprocess(cfg)
    except (PreprocessError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except (KeyboardInterrupt, Interrupted) as e:
        name = "SIGINT" if isinstance(e, KeyboardInterrupt) else str(e)
        print(f"error: interrupted by {name}; workers stopped and no output written (partial files removed); "
              "rerun the same command to convert from the start", file=sys.stderr)
        return 128 + signal.Signals[name]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    mb = result["bytes"] / 1e6
    print(f"Done: {mb:.1f} MB in {result['seconds']:.1f}s ({mb / max(result['seconds'], 1e-9):.2f} MB/s), "
          f"{result['bad_lines']} bad lines skipped", file=sys.stderr)
    for k in cfg.json_keys:
        r = result[k]
        print(f"  {k}: {r['num_docs']} documents, {r['num_tokens']} tokens -> {r['bin']}, {r['idx']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
