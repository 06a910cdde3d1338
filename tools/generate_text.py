"""Sample text from a checkpoint (same as `megapar-generate-text`); the code is megapar/cli/generate_text.py."""
import sys
from megapar.cli.generate_text import main

if __name__ == "__main__":
    sys.exit(main())
