"""Every link to a section of a markdown file (`file.md#section`) in the code and the docs names a heading that
exists, with GitHub's anchors (lowercase; punctuation other than - and _ dropped; spaces become -)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"((?:docs/)?\w+\.md)#([\w-]+)")


def anchors(md: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", md.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def broken_links() -> list[str]:
    sources = [*ROOT.glob("megapar/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    bad = []
    for src in sources:
        for m in LINK.finditer(src.read_text()):
            name = m.group(1)
            md = ROOT / name if "/" in name or name == "README.md" or src.suffix == ".md" and src.parent == ROOT \
                else ROOT / "docs" / name
            if not md.is_file() or m.group(2) not in anchors(md):
                bad.append(f"{src.relative_to(ROOT)}: {m.group(0)}")
    return bad


def test_section_links_resolve():
    assert not broken_links(), "links to no heading:\n" + "\n".join(broken_links())


def test_anchors_follow_github():
    assert anchors(ROOT / "docs" / "performance.md") >= {"performance-log-predicted-vs-measured",
                                                         "where-the-cost-models-defaults-come-from", "data"}
