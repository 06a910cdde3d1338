"""What a DeepSpeed config becomes (same as `megapar-ds-config`); the code is megapar/cli/ds_config.py."""
import sys
from megapar.cli.ds_config import main

if __name__ == "__main__":
    sys.exit(main())
