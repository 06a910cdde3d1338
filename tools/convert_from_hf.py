"""Import a Hugging Face GPT-2 model (same as `megapar-convert-from-hf`); the code is megapar/cli/convert_from_hf.py."""
import sys
from megapar.cli.convert_from_hf import main

if __name__ == "__main__":
    sys.exit(main())
