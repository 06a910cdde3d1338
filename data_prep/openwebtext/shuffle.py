"""Step 10: shuffle documents (seeded, out-of-core) and add ids ``"adlr_id": "<prefix>-<n:010d>"``.

Two passes with bounded memory: every line goes to one of K temporary bucket files chosen by a seeded RNG
(K = input size / ``--bucket-mb``), then each bucket is loaded, permuted with the same RNG and written out in bucket
order, with ``adlr_id`` n = 1, 2, ... in output order. Same input + ``--seed`` -> byte-identical output.

Upstream quirk decisions:
* ``shuf`` (unseeded, whole file in memory) -> FIXED: seeded, reproducible, out-of-core.
* add_id.py crashed without ``--id-prefix`` -> FIXED: default prefix ``owt``.
* ids 1-based ``{prefix}-{n:010d}``, ``json.dumps(ensure_ascii=False)`` -> KEPT.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, open_text, progress, report


def scatter(path: Path, tmp: Path, num_buckets: int, rng: np.random.Generator, show: bool) -> list[Path]:
    files = [tmp / f"bucket{i:05d}.jsonl" for i in range(num_buckets)]
    handles = [open(f, "w", encoding="utf-8", newline="\n") for f in files]
    try:
        with open_text(path) as lines:
            for line in progress(lines, desc="shuffle: scatter", enabled=show):
                if line.strip():
                    handles[int(rng.integers(num_buckets))].write(line if line.endswith("\n") else line + "\n")
    finally:
        for handle in handles:
            handle.close()
    return files


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--id-prefix", default="owt", help="adlr_id prefix")
    parser.add_argument("--bucket-mb", type=int, default=256, help="max bucket size held in memory")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if not args.input.is_file():
        raise PipelineError(f"input {args.input} not found; run remove_duplicates first")
    rng = np.random.default_rng(args.seed)
    num_buckets = max(1, -(-args.input.stat().st_size // (args.bucket_mb << 20)))
    counts: Counter = Counter(buckets=num_buckets)
    tmp = Path(tempfile.mkdtemp(prefix=".shuffle.", dir=args.output.parent))
    try:
        files = scatter(args.input, tmp, num_buckets, rng, not args.no_progress)
        with atomic_write(args.output) as out:
            for path in files:
                lines = path.read_text(encoding="utf-8").splitlines()
                for i in rng.permutation(len(lines)):
                    doc = json.loads(lines[i])
                    counts["kept"] += 1
                    doc["adlr_id"] = f"{args.id_prefix}-{counts['kept']:010d}"
                    out.write(dump_json_line(doc))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report("shuffle", counts, args.summary)


if __name__ == "__main__":
    main()
