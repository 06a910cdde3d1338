"""Predict peak gpu memory (same as `megapar-estimate-memory`); the code is megapar/cli/estimate_memory.py."""
import sys
from megapar.cli.estimate_memory import main

if __name__ == "__main__":
    sys.exit(main())
