"""Rank parallel layouts by predicted step time (same as `megapar-plan-layout`); code: megapar/cli/plan_layout.py."""
import sys
from megapar.cli.plan_layout import main

if __name__ == "__main__":
    sys.exit(main())
