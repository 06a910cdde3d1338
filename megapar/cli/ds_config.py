"""What a DeepSpeed config becomes in megapar, without starting a run.

    megapar-ds-config ds_config.json [--world-size N] [training flags]
    megapar-ds-config --table                                  (docs/guide.md's table of every key)

Prints the lines a run prints at start (megapar/config/deepspeed/read.py): the flags the config sets, what
each "auto" resolves to with these training flags at this world size, the keys accepted without
acting on them; then the layout and batch. A config megapar refuses ends, after what was read, in
the one `error:` line a run would end with (every refusal, joined by "; "), exit status 2.
"""
import sys
from typing import Optional

from megapar.config.build import build_config
from megapar.config.deepspeed.read import key_table
from megapar.config.overlays import add_deepspeed, parse_flags
from megapar.config.settings import ConfigError
from megapar.errors import OneLineErrorParser


def main(argv: Optional[list[str]] = None) -> int:
    """`megapar-ds-config FILE [--world-size N] [megapar flags]`: what the config becomes."""
    pre = OneLineErrorParser(prog="megapar-ds-config",
                             description="Print what a DeepSpeed config becomes in megapar: the flags it sets, what "
                                         "each \"auto\" resolves to, the keys noted and those refused; no run starts. "
                                         "Other arguments are megapar's training flags (the command line you would "
                                         "train with).")
    pre.add_argument("config", metavar="FILE", nargs="?", help="a DeepSpeed ds_config.json")
    pre.add_argument("--world-size", type=int, default=1, help="processes (GPUs) of the run, for the batch triple")
    pre.add_argument("--table", action="store_true", help="print the table of every key docs/guide.md carries")
    known, rest = pre.parse_known_args(argv)
    if known.table:
        print(key_table())
        return 0
    try:
        if known.config is None:
            raise ConfigError("give the DeepSpeed config to read: megapar-ds-config FILE [--world-size N]")
        if known.world_size < 1:
            raise ConfigError(f"--world-size {known.world_size} must be >= 1")
        given = parse_flags(rest)   # recipes and the command line
        s = add_deepspeed(given, known.config, strict=False)
        if s.problems:  # what was read, then every refusal in the one error line a run would end with
            for line in s.summary():
                print(line)
            s.check()
        cfg = build_config(given, known.world_size, assume_gpus=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in s.summary(cfg):
        print(line)
    print(f"> megapar: tensor {cfg.parallel.tensor_model_parallel_size} x pipeline "
          f"{cfg.parallel.pipeline_model_parallel_size} x data {cfg.parallel.data_parallel_size}; global batch "
          f"{cfg.train.global_batch_size} = micro batch {cfg.train.micro_batch_size} x {cfg.num_microbatches} "
          f"microbatches x data {cfg.parallel.data_parallel_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
