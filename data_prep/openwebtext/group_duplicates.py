"""Step 8: group near-duplicates into connected components.

Reads ``find_duplicates`` lines ``{"<main id>": [{"<other id>": sim}, ...]}``; for each, the main id and every
other id with ``sim >= --threshold`` (default 0.7, upstream's) are one candidate group; candidate groups sharing
an id are merged transitively (union-find). Writes one line ``{"<group index>": [id, id, ...]}`` per group with
more than one member; groups are numbered 0, 1, ... in order of their first id's appearance, members listed in
order of first appearance. Prints "out of N ids, K are unique and R should be removed".

Upstream (Megatron group_duplicate_url.py) quirk decisions:
* threshold 0.7 (README's "0.9" is stale; 2020 script used 0.9) -> KEPT 0.7 (``--threshold`` to change).
* transitive merging (A~B, B~C puts A and C together even when A, C differ) -> KEPT: that is what upstream removes.
* member order = Python set order (run-dependent; decided which member survived) -> FIXED: first-appearance
  order here, and ``remove_duplicates`` keeps the member that comes first in the data file.
* group numbering with empty absorbed groups -> FIXED: dense numbering of surviving groups.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, iter_jsonl, progress, report


class UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def groups_from_pairs(path: Path, threshold: float, counts: Counter, show: bool) -> list[list[str]]:
    """Connected components (size > 1) in first-appearance order."""
    uf = UnionFind()
    for line in progress(iter_jsonl(path, counts), desc="group", unit="line", enabled=show):
        for main, others in line.items():
            uf.find(main)
            for entry in others if isinstance(others, list) else []:
                for other, sim in entry.items():
                    if float(sim) >= threshold:
                        uf.union(main, other)
    members: dict[str, list[str]] = {}
    for ident in uf.parent:  # dict order = first appearance
        members.setdefault(uf.find(ident), []).append(ident)
    counts["ids"] = len(uf.parent)
    return [m for m in members.values() if len(m) > 1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="find_duplicates output")
    parser.add_argument("output", type=Path, help="groups JSON lines")
    parser.add_argument("--threshold", type=float, default=0.7, help="join pairs with similarity >= this")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if not args.input.is_file():
        raise PipelineError(f"input {args.input} not found; run find_duplicates first")
    counts: Counter = Counter()
    groups = groups_from_pairs(args.input, args.threshold, counts, not args.no_progress)
    with atomic_write(args.output) as out:
        for index, members in enumerate(groups):
            out.write(dump_json_line({str(index): members}))
    counts["groups"] = len(groups)
    counts["to_remove"] = sum(len(g) - 1 for g in groups)
    print(f"out of {counts['ids']} ids, only {counts['ids'] - counts['to_remove']} are unique and "
          f"{counts['to_remove']} should be removed")
    return report("group_duplicates", counts, args.summary)


if __name__ == "__main__":
    main()
