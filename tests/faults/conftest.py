"""Prints the fault-injection table (tests/faults/harness.py) at the end of the session."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `from harness import refused`

from harness import ROWS, table  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if ROWS:
        terminalreporter.write_sep("-", "fault injection")
        terminalreporter.write_line(table())
