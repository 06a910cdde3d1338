"""Train a sentencepiece tokenizer (same as `megapar-train-tokenizer`); the code is megapar/cli/train_tokenizer.py."""
import sys
from megapar.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
