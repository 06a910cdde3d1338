"""Export a checkpoint to hugging face (same as `megapar-convert-to-hf`); the code is megapar/cli/convert_to_hf.py."""
import sys
from megapar.cli.convert_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
