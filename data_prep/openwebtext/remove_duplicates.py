"""Step 9: remove group duplicates, keeping one document per group.

Loads the groups (``{"<index>": [id, ...]}`` lines), streams the data file, and drops every document whose
``--id-key`` (default ``url``) belongs to a group whose survivor was already written: the survivor is the group's
member that comes **first in the data file**. Other documents pass through, re-serialised with
``json.dumps(ensure_ascii=False)``; unparseable lines are counted ("bad_json") and skipped.

Upstream (Megatron remove_group_duplicates.py) quirk decisions:
* survivor = first member in set order (run-dependent) -> FIXED: first in data order, deterministic.
* hard-coded ``url`` key -> KEPT as the default of ``--id-key``.
* unparseable lines skipped silently -> counted.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, iter_jsonl, progress, report


def load_groups(path: Path) -> dict[str, int]:
    """id -> group index."""
    group_of: dict[str, int] = {}
    for line in iter_jsonl(path):
        for index, members in line.items():
            for ident in members:
                group_of[str(ident)] = int(index)
    return group_of


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", type=Path, help="group_duplicates output")
    parser.add_argument("input", type=Path, help="cleaned JSON lines")
    parser.add_argument("output", type=Path, help="deduplicated JSON lines")
    parser.add_argument("--id-key", default="url")
    add_common_args(parser)
    args = parser.parse_args(argv)
    for path in (args.groups, args.input):
        if not path.is_file():
            raise PipelineError(f"{path} not found; run group_duplicates / cleanup first")
    group_of = load_groups(args.groups)
    survivors: set[int] = set()
    counts: Counter = Counter()
    with atomic_write(args.output) as out:
        for doc in progress(iter_jsonl(args.input, counts), desc="remove", enabled=not args.no_progress):
            counts["documents"] += 1
            group = group_of.get(str(doc.get(args.id_key)))
            if group is not None and group in survivors:
                counts["removed:near_duplicate"] += 1
                continue
            if group is not None:
                survivors.add(group)
            counts["kept"] += 1
            out.write(dump_json_line(doc))
    return report("remove_duplicates", counts, args.summary)


if __name__ == "__main__":
    main()
