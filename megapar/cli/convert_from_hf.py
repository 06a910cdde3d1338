"""Import a Hugging Face GPT-2 model (GPT2LMHeadModel folder) as a megapar checkpoint at any layout.

  python tools/convert_from_hf.py --load-dir gpt2_hf --save-dir ckpt_tp2 \\
      --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1
  then the fine-tune command it prints: bash scripts/pretrain_gpt2.sh --nproc-per-node 2 <the model and
  tokenizer flags> --load ckpt_tp2 --finetune --save ckpt_tp2_finetuned --train-iters 100

Reads config.json + model.safetensors (or pytorch_model.bin) and writes Megatron's legacy layout
with the tracker `release` (weights only), through the same writer as tools/checkpoint_util.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from megapar.errors import USER_ERROR_EXIT, MegaparError, OneLineErrorParser
from megapar.config.command import Processes, training_command
from megapar.config.settings import default_of
from megapar.reshard import bounded_heap
from megapar.reshard.convert import write_sharded
from megapar.reshard.hf_source import HFFolder, megapar_flags, tokenizer_flags
from megapar.reshard.hf_tokenizer import gpt2_files_from_tokenizer_json


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", "--load", dest="load_dir", required=True,
                   help="Hugging Face folder: config.json + model.safetensors or pytorch_model.bin")
    p.add_argument("--save-dir", "--save", dest="save_dir", required=True,
                   help="new folder for the megapar checkpoint (refused if it holds anything else)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="tensor-parallel size to write")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="pipeline-parallel size to write")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=default_of("make_vocab_size_divisible_by"),
                   help="vocabulary padding, as in training (default %(default)s; padded to a multiple of it x tp)")
    p.add_argument("--vocab-file", default=None,
                   help="GPT-2 BPE vocabulary the checkpoint names (default: the folder's vocab.json)")
    p.add_argument("--merge-file", default=None, help="GPT-2 BPE merges (default: the folder's merges.txt)")
    p.add_argument("--tokenizer-model", default=None,
                   help="a SentencePiece model instead (default: the folder's tokenizer.model, if any)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --save-dir that holds a previous output of this tool or "
                        "tools/checkpoint_util.py (never anything else)")
    return p


def check_sizes(a: argparse.Namespace) -> None:
    for flag, value in (("--target-tensor-parallel-size", a.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", a.target_pipeline_parallel_size),
                        ("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    bounded_heap()
    t0 = time.time()
    try:
        check_sizes(a)
        extra = None if (a.vocab_file or a.merge_file or a.tokenizer_model) else \
            gpt2_files_from_tokenizer_json(a.load_dir)
        if extra:   # only tokenizer.json: its BPE written beside the checkpoint, which names them
            a.vocab_file, a.merge_file = (os.path.abspath(os.path.join(a.save_dir, f)) for f in extra)
            print(f"{a.load_dir} has only tokenizer.json: its vocabulary and merges go to {a.save_dir}/"
                  f"{{{','.join(extra)}}}")
        src = HFFolder(a.load_dir, a.make_vocab_size_divisible_by, a.vocab_file, a.merge_file, a.tokenizer_model)
        print(f"read {src.describe()}")
        tp, pp = a.target_tensor_parallel_size, a.target_pipeline_parallel_size
        write_sharded(src, a.save_dir, tp, pp, with_optim=False, force=a.force, extra_files=extra)
    except (MegaparError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    print(f"done in {time.time() - t0:.1f} s; fine-tune it with\n  {finetune_command(a, src.config)}")
    return 0


def finetune_command(a: argparse.Namespace, hf_config: dict) -> str:
    """The training command that fine-tunes the imported checkpoint: its model and tokenizer flags,
    tp x pp processes, --finetune (weights only: it has no optimizer state). With GPT-2 BPE files
    it runs as printed, on the embedded corpus tokenized with them; otherwise it names a --data-path
    to replace."""
    tp, pp = a.target_tensor_parallel_size, a.target_pipeline_parallel_size
    tokenizer = tokenizer_flags(a.load_dir, a.vocab_file, a.merge_file, a.tokenizer_model)
    flags = [*megapar_flags(hf_config, a.make_vocab_size_divisible_by), "--tensor-model-parallel-size", tp,
             "--pipeline-model-parallel-size", pp, *tokenizer, "--load", a.save_dir, "--finetune",
             "--save", f"{a.save_dir.rstrip('/')}_finetuned", "--train-iters", 100]
    if "--vocab-file" in tokenizer and "--merge-file" in tokenizer:
        why = "on the embedded corpus; add --data-path PREFIX (tools/preprocess_data.py output) for yours"
    else:
        flags += ["--data-path", "PREFIX"]
        why = "PREFIX: your corpus, tokenized with this tokenizer by tools/preprocess_data.py"
    return training_command(flags, Processes(tp * pp), why)

if __name__ == "__main__":
    sys.exit(main())
