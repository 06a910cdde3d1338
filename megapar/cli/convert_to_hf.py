"""Export a megapar checkpoint of any layout to a Hugging Face GPT2LMHeadModel folder, with its tokenizer.

  python tools/convert_to_hf.py --load-dir ckpt --save-dir gpt2_hf [--dtype fp16|bf16|fp32]
  then: transformers.GPT2LMHeadModel.from_pretrained("gpt2_hf"), transformers.AutoTokenizer.from_pretrained("gpt2_hf")

The tokenizer files are the ones the checkpoint's args name (--vocab-file/--merge-file for GPT-2
BPE, --tokenizer-model for SentencePiece) unless the options below name others.
"""
from __future__ import annotations

import argparse
import sys

import torch

from megapar.errors import USER_ERROR_EXIT, MegaparError, OneLineErrorParser
from megapar.reshard import bounded_heap, hf_tokenizer, open_source
from megapar.reshard.hf import export_hf

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", "--load", dest="load_dir", required=True,
                   help="megapar checkpoint (any tp/pp/dp) or canonical folder")
    p.add_argument("--save-dir", "--save", dest="save_dir", required=True,
                   help="the Hugging Face folder to write (config.json, model.safetensors, the tokenizer)")
    p.add_argument("--iteration", default=None, help="iteration to export (default: the tracker's latest)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocabulary to export (default: the checkpoint's)")
    p.add_argument("--merge-file", default=None, help="GPT-2 BPE merges to export (default: the checkpoint's)")
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model to export (default: the checkpoint's, if it used one)")
    p.add_argument("--no-tokenizer", action="store_true", help="export the model alone, without tokenizer files")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --save-dir that holds a previous export (config.json + "
                        "model.safetensors + the tokenizer files an export writes), never anything else")
    a = p.parse_args(argv)
    bounded_heap()
    try:
        src = open_source(a.load_dir, a.iteration)
        tokenizer = None
        if a.no_tokenizer and (a.vocab_file or a.merge_file or a.tokenizer_model):
            raise ValueError("--no-tokenizer exports no tokenizer; drop it or --vocab-file/--merge-file/"
                             "--tokenizer-model")
        if a.no_tokenizer:
            print("warning: --no-tokenizer: no tokenizer files are written; AutoTokenizer.from_pretrained will not "
                  "load this folder", file=sys.stderr)
        else:
            tokenizer = hf_tokenizer.resolve(src.saved.data, a.vocab_file, a.merge_file, a.tokenizer_model)
        export_hf(src, a.save_dir, DTYPES[a.dtype] if a.dtype else None, force=a.force, tokenizer=tokenizer)
        note = tokenizer and hf_tokenizer.reader_note(tokenizer)
        if note:
            print(note, file=sys.stderr)
    except (MegaparError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
