"""The real data shipped in tests/data is what tests/data/SOURCE.md says it is (path, size, SHA-256), and
nothing is shipped that SOURCE.md does not account for."""
import hashlib
import re

from data_dirs import SHIPPED

OWN_FILES = {"SOURCE.md", "golden_checkpoint.pt"}  # the project's own files


def test_every_shipped_file_matches_its_source_entry():
    rows = re.findall(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|$", (SHIPPED / "SOURCE.md").read_text(), re.M)
    assert len(rows) == 13
    for rel, size, sha in rows:
        data = (SHIPPED / rel).read_bytes()
        assert len(data) == int(size) and hashlib.sha256(data).hexdigest() == sha, rel
    shipped = {str(p.relative_to(SHIPPED)) for p in SHIPPED.rglob("*") if p.is_file()}
    assert shipped - OWN_FILES == {rel for rel, _, _ in rows}
