"""The test tiers of docs/testing.md's table and where the session keeps their sizes (tests/conftest.py
counts them at collection; tests/docs/test_testing_doc.py compares them with the table)."""
from typing import Callable, Optional

import pytest

TIERS: dict[str, Callable[[pytest.Item], bool]] = {
    "quick": lambda item: "gpu" not in item.keywords and "slow" not in item.keywords,
    "full CPU (CI)": lambda item: "gpu" not in item.keywords,
    "GPU": lambda item: "gpu" in item.keywords,
}
TIER_SIZES = pytest.StashKey[Optional[dict]]()
