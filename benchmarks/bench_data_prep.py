"""Benchmark every OpenWebText data-prep step on the real corpora (replicated) and print a docs/s table.

    python benchmarks/bench_data_prep.py --docs 100000 [--workers 2] [--download-docs 2000] [--only-optional]

Documents are built from real text (shared/data/corpora): each is 2-8 random paragraphs (Emma, Shakespeare,
WebText) drawn with a fixed seed, so documents are distinct but realistic; 2% are exact and 2% near copies.
URL steps use the real Pushshift dumps replicated (URLs made distinct with a query suffix). The download step
runs against the local fake web (data_prep/openwebtext/fake_web.py) through 127.0.0.1. The optional steps run
on the same documents: cleanup_fix_dataset with all five tasks, filter_ngrams against an evaluation file of the
4,723 WebText test passages (63 tokens each; they are also among the paragraphs the documents are made of, so
overlaps are found and cut). --only-optional times just those two.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_prep.openwebtext.fake_web import FakeWeb, corpus_chunks, near_copy

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


def paragraphs() -> list[str]:
    corpora = DATA / "corpora"
    paras = [p for c in corpus_chunks(corpora) for p in c.split("\n\n") if len(p) > 80]
    for name in ("webtext.test.jsonl", "webtext.valid.jsonl"):
        for line in (corpora / "webtext_gpt2_trunc63" / name).read_text().splitlines():
            paras.append(json.loads(line)["text"])
    return paras


def make_docs(path: Path, n: int) -> None:
    rng, paras = random.Random(0), paragraphs()
    with open(path, "w", encoding="utf-8") as out:
        recent: list[str] = []
        for i in range(n):
            r = rng.random()
            if recent and r < 0.02:
                text = rng.choice(recent)
            elif recent and r < 0.04:
                text = near_copy(rng.choice(recent))
            else:
                text = "\n\n".join(rng.choice(paras) for _ in range(rng.randint(2, 8)))
                recent = (recent + [text])[-1000:]
            out.write(json.dumps({"text": text, "url": f"http://bench.example.com/{i}"}) + "\n")


def make_dumps(folder: Path, copies: int) -> int:
    folder.mkdir(parents=True)
    lines = []
    for dump in sorted((DATA / "openwebtext_urls" / "pushshift_dumps").glob("*.xz")):
        lines += lzma.decompress(dump.read_bytes()).decode().splitlines()
    out = []
    for k in range(copies):
        for line in lines:
            sub = json.loads(line)
            sub["url"] = f"{sub['url']}{'&' if '?' in sub['url'] else '?'}copy={k}"
            out.append(json.dumps(sub))
    (folder / "RS_2005-07.xz").write_bytes(lzma.compress(("\n".join(out) + "\n").encode(), preset=1))
    return len(out)


def timed(step: str, args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", f"data_prep.openwebtext.{step}", *args, "--no-progress"], check=True,
                   cwd=ROOT, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def optional_steps(tmp: Path, docs: Path, n: int, w: list[str]) -> list[tuple[str, int, float]]:
    """cleanup_fix_dataset (all tasks) and filter_ngrams (WebText test passages as the evaluation set)."""
    tasks = ["remove_512", "remove_256_javascript", "remove_512_non_english", "ftfy_fix_text", "general_cleaning"]
    fix = timed("cleanup_fix_dataset", ["--input-files", str(docs), "--tasks", *tasks, "--output-path",
                                        str(tmp / "fixed"), *w])
    eval_file = DATA / "corpora" / "webtext_gpt2_trunc63" / "webtext.test.jsonl"
    ngrams = timed("filter_ngrams", [str(docs), str(tmp / "decontaminated.jsonl"), "--decontaminate-with",
                                     str(eval_file)])
    return [("cleanup_fix_dataset (5 tasks)", n, fix), ("filter_ngrams (4,723 evaluation passages)", n, ngrams)]


def count(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--dump-copies", type=int, default=100, help="replicas of the 1,182 real submissions")
    parser.add_argument("--download-docs", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only-optional", action="store_true", help="time only cleanup_fix_dataset and filter_ngrams")
    args = parser.parse_args()
    vocab, merges = str(DATA / "gpt2" / "encoder.json"), str(DATA / "gpt2" / "vocab.bpe")
    w = ["--workers", str(args.workers)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.only_optional:
            make_docs(tmp / "docs.jsonl", args.docs)
            rows = optional_steps(tmp, tmp / "docs.jsonl", args.docs, w)
            report(rows, (tmp / "docs.jsonl").stat().st_size / args.docs, args.workers)
            return
        subs = make_dumps(tmp / "dumps", args.dump_copies)
        rows.append(("extract_urls", subs,
                     timed("extract_urls", ["--psdir", str(tmp / "dumps"), "--outdir", str(tmp / "u")])))
        n = count(next((tmp / "u").iterdir()))
        rows.append(("dedup_urls", n,
                     timed("dedup_urls", ["--input-dir", str(tmp / "u"), "--output-dir", str(tmp / "d")])))
        rows.append(("blacklist_urls", n,
                     timed("blacklist_urls", [str(tmp / "d"), "--output", str(tmp / "clean.txt")])))
        urls = [f"http://bench{i}.example.com/p" for i in range(args.download_docs)]
        (tmp / "dl_urls.txt").write_text("\n".join(urls) + "\n")
        with FakeWeb(urls, DATA / "corpora", slow_s=0.0, big_bytes=10) as web:
            rows.append(("download (local)", len(urls), timed("download", [
                "--url-file", str(tmp / "dl_urls.txt"), "--output-dir", str(tmp / "dl"), "--proxy", web.proxy,
                "--concurrency", "16", "--timeout", "30"])))
        rows.append(("merge", len(urls), timed("merge", [str(tmp / "dl"), "--output", str(tmp / "m.jsonl")])))
        make_docs(tmp / "docs.jsonl", args.docs)
        rows.append(("cleanup", args.docs, timed("cleanup", [str(tmp / "docs.jsonl"), str(tmp / "c.jsonl"),
                                                             "--vocab-file", vocab, "--merge-file", merges, *w])))
        nc = count(tmp / "c.jsonl")
        rows.append(("find_duplicates", nc, timed("find_duplicates", [str(tmp / "c.jsonl"), "--output",
                                                                      str(tmp / "p.jsonl"), *w])))
        rows.append(("group_duplicates", count(tmp / "p.jsonl"),
                     timed("group_duplicates", [str(tmp / "p.jsonl"), str(tmp / "g.jsonl")])))
        rows.append(("remove_duplicates", nc, timed("remove_duplicates", [str(tmp / "g.jsonl"), str(tmp / "c.jsonl"),
                                                                          str(tmp / "r.jsonl")])))
        nr = count(tmp / "r.jsonl")
        rows.append(("shuffle", nr, timed("shuffle", [str(tmp / "r.jsonl"), str(tmp / "s.jsonl")])))
        rows += optional_steps(tmp, tmp / "docs.jsonl", args.docs, w)
        size = (tmp / "docs.jsonl").stat().st_size / args.docs
    report(rows, size, args.workers)
    lsh = next(r for r in rows if r[0] == "find_duplicates")
    print(f"\nfind_duplicates: 1M documents estimated at {lsh[2] * 1_000_000 / lsh[1] / 60:.1f} min (linear "
          f"scaling of the measured run; band sorting is O(N log N), a small share)")


def report(rows: list[tuple[str, int, float]], doc_bytes: float, workers: int) -> None:
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, workers={workers}; "
          f"documents avg {doc_bytes:,.0f} bytes\n")
    print("| step | items | seconds | items/s |\n|---|---:|---:|---:|")
    for step, items, secs in rows:
        print(f"| {step} | {items:,} | {secs:.1f} | {items / secs:,.0f} |")


if __name__ == "__main__":
    main()
