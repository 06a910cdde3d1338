"""Json lines to .bin/.idx (same as `megapar-preprocess-data`); the code is megapar/cli/preprocess_data.py."""
import sys
from megapar.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
