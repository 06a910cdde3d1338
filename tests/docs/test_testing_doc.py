"""docs/testing.md's tier table gives each tier's size: checked against what this session collected."""
import re

import pytest

from tiers import TIER_SIZES
from data_dirs import ROOT


def documented_sizes() -> dict[str, int]:
    """tier -> the test count in docs/testing.md's table (`| tier | command | selection | tests | time |`)."""
    rows = {}
    for line in (ROOT / "docs" / "testing.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d[\d,]*", cells[3]):
            rows[cells[0]] = int(cells[3].replace(",", ""))
    return rows


def test_the_tier_table_counts_the_tests(request):
    sizes = request.config.stash.get(TIER_SIZES, None)
    if sizes is None:
        pytest.skip("the session did not collect the whole suite (run it without file arguments)")
    documented = documented_sizes()
    assert set(documented) == set(sizes), f"docs/testing.md's tier table names {sorted(documented)}"
    wrong = {tier: (documented[tier], n) for tier, n in sizes.items() if documented[tier] != n}
    assert not wrong, "docs/testing.md's tier table: " + "; ".join(
        f"{tier} says {doc} tests, the suite has {n}" for tier, (doc, n) in wrong.items()) + ": update the cells"
