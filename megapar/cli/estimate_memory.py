"""Predict peak GPU memory per pipeline stage for a training configuration.

    python tools/estimate_memory.py --world-size 4 --tensor-parallel 2 --pipeline-parallel 2 \
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
        --micro-batch-size 8 --global-batch-size 64 --bf16 [--use-distributed-optimizer] [--checkpoint-activations]

Takes the training flags (megapar/arguments.py, `--recipe NAME` too) plus --world-size and --vocab-size (true size,
default GPT-2's 50257); prints parameters, static memory (weights, fp32 grads, optimizer state),
activations, logits and the predicted peak per stage. Model: megapar/memory_estimate.py.
"""
import argparse
import sys

from megapar.arguments import ConfigError, build_parser, config_from_namespace
from megapar.memory_estimate import estimate, format_table
from megapar.recipes import expand_recipes
from megapar.model import set_vocab


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--world-size", type=int, default=1)
    pre.add_argument("--vocab-size", type=int, default=50257)
    known, rest = pre.parse_known_args(argv)
    parser = build_parser()
    parser.description = __doc__
    try:
        cfg = config_from_namespace(parser.parse_args(expand_recipes(rest)), known.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    set_vocab(cfg.model, known.vocab_size, cfg.parallel.tensor_model_parallel_size)
    p = cfg.parallel
    print(f"tp {p.tensor_model_parallel_size} x pp {p.pipeline_model_parallel_size} x dp {p.data_parallel_size}, "
          f"{cfg.num_microbatches} microbatches of {cfg.train.micro_batch_size}, {cfg.train.params_dtype_name}, "
          f"ZeRO-1 {'on' if p.use_distributed_optimizer else 'off'}, recompute {cfg.model.recompute_granularity}")
    print(format_table(estimate(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
