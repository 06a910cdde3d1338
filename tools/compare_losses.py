"""Losses of two training logs side by side (same as `megapar-compare-losses`); code: megapar/cli/compare_losses.py."""
import sys
from megapar.cli.compare_losses import main

if __name__ == "__main__":
    sys.exit(main())
