"""Reshard a megapar checkpoint to any (tensor, pipeline, data) parallel layout, on CPU.

  python tools/checkpoint_util.py --load-dir A --save-dir B \\
      --target-tensor-parallel-size T --target-pipeline-parallel-size P [--target-data-parallel-size D]
  python tools/checkpoint_util.py --load-dir A --save-dir FULL --to-full      # canonical unsharded folder
  python tools/checkpoint_util.py --load-dir FULL --save-dir B --from-full --target-... # back to shards
  python tools/checkpoint_util.py --load-dir A --save-dir B --target-virtual-pipeline-parallel-size 1
      # interleaved (model0, model1, ... per rank) <-> plain stages; any v the layers allow
  python tools/checkpoint_util.py --load-dir A --save-dir B --target-ckpt-format torch_dist
      # legacy -> torch_dist (loads at any layout); a torch_dist source converts to legacy at any layout

Every conversion reads the source as canonical full tensors (megapar.reshard) one parameter
at a time. See megapar/reshard/convert.py for what is carried and how.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from megapar.checkpoint import CheckpointError
from megapar.errors import USER_ERROR_EXIT, OneLineErrorParser
from megapar.reshard import bounded_heap, open_source
from megapar.reshard.canonical import write_canonical
from megapar.reshard.convert import write_sharded
from megapar.reshard.torch_dist import write_dist


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", "--load", dest="load_dir", required=True,
                   help="the checkpoint folder to read (any tp/pp/dp layout, or a canonical folder with --from-full)")
    p.add_argument("--save-dir", "--save", dest="save_dir", required=True,
                   help="where to write the converted checkpoint (a new folder: never the --load-dir)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None,
                   help="tensor-parallel size of the output (default: the checkpoint's)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                   help="pipeline-parallel size of the output (default: the checkpoint's)")
    p.add_argument("--target-data-parallel-size", type=int, default=None,
                   help="recorded in args; ZeRO-1 state is stored full over dp and sliced at load time")
    p.add_argument("--target-decoder-first-pipeline-num-layers", dest="target_first", type=int, default=None,
                   help="layers on the target's first pipeline stage (the rest split evenly over the others)")
    p.add_argument("--target-decoder-last-pipeline-num-layers", dest="target_last", type=int, default=None,
                   help="layers on the target's last pipeline stage (default: the source's split at the same "
                        "pipeline size, else an even split)")
    v = p.add_mutually_exclusive_group()
    v.add_argument("--target-virtual-pipeline-parallel-size", dest="target_virtual", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B: model0, model1, ... entries); 1 = none "
                        "(default: the source's at the same pipeline size, else none)")
    v.add_argument("--target-num-layers-per-virtual-pipeline-stage", dest="target_layers_per_chunk", type=int,
                   default=None, help="layers per model chunk (the other way to give the chunk count)")
    p.add_argument("--iteration", default=None, help="iteration to convert (default: the tracker's)")
    p.add_argument("--no-optim", action="store_true", help="convert model weights only")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--use-distributed-optimizer", dest="distributed", action="store_true", default=None,
                   help="store optimizer state in distrib_optim.pt (default: as in the source)")
    g.add_argument("--no-distributed-optimizer", dest="distributed", action="store_false",
                   help="store optimizer state in the model shard files, not distrib_optim.pt")
    p.add_argument("--target-ckpt-format", choices=("torch", "torch_dist"), default="torch",
                   help="torch: Megatron's legacy shard files at the target layout (default); torch_dist: one "
                        "distributed checkpoint that loads at any layout (no --target-* sizes)")
    p.add_argument("--to-full", action="store_true", help="write the canonical unsharded folder")
    p.add_argument("--from-full", action="store_true", help="--load-dir is a canonical folder")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --save-dir that holds a previous output of this tool "
                        "(never anything else)")
    return p


def check_targets(a: argparse.Namespace) -> None:
    """Refuse a target size below 1 (0 would silently mean 'as in the source')."""
    for flag, value in (("--target-tensor-parallel-size", a.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", a.target_pipeline_parallel_size),
                        ("--target-data-parallel-size", a.target_data_parallel_size),
                        ("--target-virtual-pipeline-parallel-size", a.target_virtual),
                        ("--target-num-layers-per-virtual-pipeline-stage", a.target_layers_per_chunk)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}; omit it to keep the source's size")
        if value is not None and a.target_ckpt_format == "torch_dist":
            raise ValueError(f"{flag}: a torch_dist checkpoint has no layout (it loads at any); drop {flag}")
    if a.to_full and a.target_ckpt_format == "torch_dist":
        raise ValueError("--to-full writes the canonical folder; drop --target-ckpt-format torch_dist (or --to-full)")


def target_chunks(a: argparse.Namespace, num_layers: int, pp: int) -> Optional[int]:
    """Model chunks per pipeline rank asked for (None: as the source at the same pipeline size)."""
    n = a.target_layers_per_chunk
    if n is None:
        return a.target_virtual
    if num_layers % (pp * n):
        raise ValueError(f"--target-num-layers-per-virtual-pipeline-stage {n}: --num-layers {num_layers} is not "
                         f"divisible by the target pipeline-parallel size {pp} x {n}")
    return num_layers // (pp * n)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    bounded_heap()
    t0 = time.time()
    try:
        check_targets(a)
        src = open_source(a.load_dir, a.iteration, a.from_full)
        if a.to_full:
            write_canonical(src, a.save_dir, with_optim=not a.no_optim, force=a.force)
        elif a.target_ckpt_format == "torch_dist":
            write_dist(src, a.save_dir, with_optim=not a.no_optim, force=a.force)
        else:
            par = src.saved.parallel
            tp = par.tensor_model_parallel_size if a.target_tensor_parallel_size is None \
                else a.target_tensor_parallel_size
            pp = par.pipeline_model_parallel_size if a.target_pipeline_parallel_size is None \
                else a.target_pipeline_parallel_size
            split = None if a.target_first is None and a.target_last is None else (a.target_first, a.target_last)
            write_sharded(src, a.save_dir, tp, pp, a.target_data_parallel_size, a.distributed,
                          with_optim=not a.no_optim, force=a.force, split=split,
                          virtual=target_chunks(a, src.saved.model.num_layers, pp))
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    print(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
