"""Every link to a section of a markdown file (`file.md#section`) in the code and the docs names a heading that
exists, with GitHub's anchors (lowercase; punctuation other than - and _ dropped; spaces become -); every relative
markdown link in the docs names a file that exists; docs/performance.md indexes every dated benchmark file; the
README's file map names paths that exist."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
BENCHMARK_FILE = re.compile(r"[a-z0-9-]+(?:_[a-z0-9-]+)*_[a-z0-9-]+_\d{8}\.md")


def anchors(md: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", md.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def sources() -> list[Path]:
    """The code, the benchmarks, the tests (this file's examples aside) and the docs."""
    code = [*ROOT.glob("megapar/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/**/*.py")]
    return [*(p for p in code if p != Path(__file__).resolve()), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]


def target(src: Path, name: str) -> Path:
    """Where a link in src points: markdown links are relative to their file; code names paths from the root, and
    a bare `x.md` in code means docs/x.md."""
    if src.suffix == ".md":
        return (src.parent / name).resolve()
    return ROOT / name if "/" in name or name == "README.md" else ROOT / "docs" / name


def broken_links(files: list[Path] | None = None) -> list[str]:
    bad = []
    for src in sources() if files is None else files:
        for m in LINK.finditer(src.read_text()):
            md = target(src, m.group(1))
            if not md.is_file() or m.group(2) not in anchors(md):
                bad.append(f"{src.name if files else src.relative_to(ROOT)}: {m.group(0)}")
    return bad


def test_section_links_resolve():
    assert not broken_links(), "links to no heading:\n" + "\n".join(broken_links())


def test_relative_markdown_links_name_files_that_exist():
    bad = []
    for src in [*ROOT.glob("docs/**/*.md"), ROOT / "README.md"]:
        for m in MD_LINK.finditer(src.read_text()):
            if re.match(r"[a-z]+:", m.group(1)):
                continue
            if not (src.parent / m.group(1)).exists():
                bad.append(f"{src.relative_to(ROOT)}: {m.group(1)}")
    assert not bad, "links to no file:\n" + "\n".join(bad)


def test_a_broken_link_is_found(tmp_path):
    """The check can fail: a link to a heading that is not there, or into a file that is not there, is reported;
    a link to a heading of a sibling file, relative to the linking file, is not."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("# A real heading\n")
    doc = tmp_path / "sub" / "a.md"
    doc.write_text("[ok](../b.md#a-real-heading) [bad](../b.md#no-such-heading) [gone](c.md#a-real-heading)\n")
    assert broken_links([doc]) == ["a.md: ../b.md#no-such-heading", "a.md: c.md#a-real-heading"]


def test_anchors_follow_github():
    assert anchors(ROOT / "docs" / "performance.md") >= {"how-training-throughput-is-measured", "current-results",
                                                         "where-the-cost-models-defaults-come-from",
                                                         "the-layout-planner-on-paper", "benchmark-files"}
    assert "performance-log-predicted-vs-measured" in anchors(ROOT / "docs/benchmarks/log_h100_20261121.md")
    assert "gpt-3-13b-on-two-gpus-zero-3--cpu-offload-saved-and-resumed-2026-11-26" in anchors(
        ROOT / "docs/benchmarks/offload_h100_20261126.md")


def test_every_benchmark_file_is_named_by_theme_hardware_date_and_indexed():
    """docs/benchmarks/ holds `<theme>_<hardware>_<yyyymmdd>.md` files, each linked from performance.md's index."""
    index = (ROOT / "docs" / "performance.md").read_text().split("## Benchmark files", 1)[1]
    files = sorted(p.name for p in (ROOT / "docs" / "benchmarks").glob("*.md"))
    assert len(files) >= 20
    assert [f for f in files if not BENCHMARK_FILE.fullmatch(f)] == []
    assert [f for f in files if f"(benchmarks/{f})" not in index] == []
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


def file_map_paths(readme: str) -> list[str]:
    """The paths the README's file map names: top-level entries at column 0, megapar/'s at column 2
    (`errors.py, atomic.py` names two); description lines are indented further and name none."""
    block = readme.split("## File map", 1)[1].split("```", 2)[1]
    paths, parent = [], ""
    for line in block.splitlines():
        m = re.match(r"^( {0,2})([\w./-]+(?:, [\w./-]+)*)(?: {2,}|$)", line)
        if not m:
            continue
        if not m.group(1):
            parent = m.group(2) if m.group(2).endswith("/") else ""
            paths.append(m.group(2))
        else:
            paths += [parent + name for name in m.group(2).split(", ")]
    return paths


def test_the_readme_file_map_names_paths_that_exist():
    paths = file_map_paths((ROOT / "README.md").read_text())
    assert len(paths) > 20 and "megapar/pipeline/" in paths and "megapar/errors.py" in paths, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README.md's file map names paths that do not exist: {missing}"
