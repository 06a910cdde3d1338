"""Data pipeline speed benchmark; prints a markdown table.

    python benchmarks/bench_data.py [--mb 32] [--workers 1 2] [--index-tokens 10e9]

1. preprocess_data.py end to end (subprocess wall time, incl. start-up) on English web text:
   the WebText documents of ../shared/data/corpora repeated to --mb megabytes of JSON lines,
   GPT-2 BPE from ../shared/data/gpt2, --append-eod, for each --workers value.
2. GPT sample-index build (doc/sample/shuffle) for a synthetic dataset of --index-tokens tokens
   (document lengths uniform in 1..2000, seq_length 1024, one epoch of samples).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from megapar.data.sample_index import build_indices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")


def make_corpus(path: str, mb: float) -> int:
    """Write about `mb` MB of WebText JSON lines to `path`; return its size in bytes."""
    src = os.path.join(DATA, "corpora", "webtext_gpt2_trunc63")
    lines = []
    for name in ("webtext.test.jsonl", "webtext.valid.jsonl"):
        with open(os.path.join(src, name), "rb") as f:
            lines.extend(ln for ln in f if ln.strip())
    block = b"".join(lines)
    with open(path, "wb") as f:
        for _ in range(max(1, int(mb * 1e6 / len(block) + 0.5))):
            f.write(block)
    return os.path.getsize(path)


def bench_preprocess(corpus: str, size: int, workers: int, tmp: str) -> float:
    """Seconds for one end-to-end preprocess_data.py run."""
    g = os.path.join(DATA, "gpt2")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", os.path.join(tmp, f"w{workers}"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", os.path.join(g, "encoder.json"), "--merge-file", os.path.join(g, "vocab.bpe"),
           "--append-eod", "--workers", str(workers), "--log-interval", "0"]
    t = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - t


def bench_index(tokens: float, seq_length: int = 1024) -> tuple[float, int, int]:
    rng = np.random.RandomState(0)
    sizes = rng.randint(1, 2001, size=int(tokens / 1000.5)).astype(np.int32)
    t = time.time()
    _, sample_idx, _ = build_indices(np.arange(sizes.size), sizes, seq_length,
                                     int(sizes.sum(dtype=np.int64) // seq_length) - 1, 1234)
    return time.time() - t, sizes.size, sample_idx.shape[0] - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=32)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--index-tokens", type=float, default=10e9)
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, numpy {np.__version__}")
    print("| benchmark | size | time (s) | throughput |\n|---|---|---|---|")
    if os.path.isdir(DATA):
        with tempfile.TemporaryDirectory() as tmp:
            corpus = os.path.join(tmp, "webtext.jsonl")
            size = make_corpus(corpus, args.mb)
            hashes = set()
            for w in args.workers:
                sec = bench_preprocess(corpus, size, w, tmp)
                with open(os.path.join(tmp, f"w{w}_text_document.bin"), "rb") as f:
                    hashes.add(hash(f.read()))
                print(f"| preprocess_data.py --workers {w} (GPT-2 BPE, end to end) | {size / 1e6:.1f} MB | "
                      f"{sec:.2f} | {size / 1e6 / sec:.1f} MB/s |", flush=True)
            assert len(hashes) == 1, "outputs differ between --workers values"
    else:
        print(f"| preprocess_data.py | skipped: {DATA} not found | | |")
    sec, docs, samples = bench_index(args.index_tokens)
    print(f"| GPT index build (doc+sample+shuffle), seq 1024 | {args.index_tokens / 1e9:.0f}B tokens, "
          f"{docs / 1e6:.0f}M docs, {samples / 1e6:.1f}M samples | {sec:.2f} | "
          f"{args.index_tokens / 1e9 / sec:.1f} B tokens/s |")


if __name__ == "__main__":
    main()
