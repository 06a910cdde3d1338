"""Export a megapar checkpoint of any layout to a Hugging Face GPT2LMHeadModel folder.

  python tools/convert_to_hf.py --load-dir ckpt --save-dir gpt2_hf [--dtype fp16|bf16|fp32]
  then: transformers.GPT2LMHeadModel.from_pretrained("gpt2_hf")
"""
from __future__ import annotations

import argparse
import sys

import torch

from megapar.checkpointing import CheckpointError
from megapar.cli.checkpoint_util import open_source
from megapar.reshard import bounded_heap
from megapar.reshard.hf import export_hf

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", "--load", dest="load_dir", required=True,
                   help="megapar checkpoint (any tp/pp/dp) or canonical folder")
    p.add_argument("--save-dir", "--save", dest="save_dir", required=True)
    p.add_argument("--iteration", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --save-dir that holds a previous export (exactly config.json + "
                        "model.safetensors), never anything else")
    a = p.parse_args(argv)
    bounded_heap()
    try:
        export_hf(open_source(a.load_dir, False, a.iteration), a.save_dir,
                  DTYPES[a.dtype] if a.dtype else None, force=a.force)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
