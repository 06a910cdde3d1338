"""Every link to a section of a markdown file (`file.md#section`) in the code and the docs names a heading that
exists, with GitHub's anchors (lowercase; punctuation other than - and _ dropped; spaces become -)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def test_the_design_maps_questions_to_names_that_exist():
    """docs/design.md's "Where to look": in each row, `path: name` names a file that defines `name`,
    and each bare `name` after it is defined in that file too; a folder named exists."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Where to look", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for row in section.splitlines():
        path = None
        for token in re.findall(r"`([^`]+)`", row):
            m = re.fullmatch(r"(megapar/[\w/.]+)(?:: (\w+))?", token)
            if m:
                assert (ROOT / m.group(1)).exists(), m.group(1)
                path, name = m.group(1), m.group(2)
            elif re.fullmatch(r"\w+", token) and path and path.endswith(".py"):
                name = token
            else:
                continue
            if name:
                source = (ROOT / path).read_text()
                assert re.search(rf"^\s*(def|class) {name}\b", source, flags=re.M), f"{path} defines no {name}"
                checked += 1
    assert checked >= 20


def guide_toc(text: str) -> str:
    """The table of contents of a markdown text: a nested list linking every ## and ### heading outside code blocks
    (except the table's own heading)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    lines = []
    for level, head in re.findall(r"^(##+) (.+)$", text, flags=re.M):
        if len(level) <= 3 and head != "Contents":
            anchor = re.sub(r"[^\w\- ]", "", head.strip().lower()).replace(" ", "-")
            lines.append(f"{'  ' * (len(level) - 2)}- [{head}](#{anchor})")
    return "\n".join(lines) + "\n"


def test_guide_has_a_table_of_contents():
    """docs/guide.md opens with a table of contents that lists every section in order, each link to a heading."""
    text = (ROOT / "docs" / "guide.md").read_text()
    toc = text.split("## Contents\n\n", 1)[1].split("\n## ", 1)[0]
    assert toc.strip() == guide_toc(text).strip(), "docs/guide.md's Contents is stale: regenerate it from the headings"
