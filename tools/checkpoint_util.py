"""Reshard a checkpoint (same as `megapar-checkpoint-util`); the code is megapar/cli/checkpoint_util.py."""
import sys
from megapar.cli.checkpoint_util import main

if __name__ == "__main__":
    sys.exit(main())
