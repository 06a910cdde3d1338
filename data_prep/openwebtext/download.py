"""Step 4: download pages and extract their main text, concurrently and resumably.

URL ``i`` (0-based line of ``--url-file``, stripped) gets the id ``fid = f"{i:07d}-{sha256(url)}"`` and one result
file under ``<output-dir>/data/<i // 10000:04d>/``: ``<fid>.json`` = ``{"url": ..., "text": ...}`` on success,
or ``<fid>.fail`` = ``{"url": ..., "reason": ...}``. Both are written atomically, so a re-run skips every URL that
already has a result (``--retry-failed`` re-tries the ``.fail`` ones) and never sees a half-written file.
At the end ``<output-dir>/failures.jsonl`` lists every failed URL with its reason (this and earlier runs).

Per URL: the Megatron blacklist is re-checked ("excluded"); GET with ``--concurrency`` threads, a per-request
``--timeout`` (connect, read and whole body), up to ``--retries`` retries with exponential backoff for timeouts,
connection errors, 429 and 5xx; up to 5 redirects; pages over ``--max-bytes`` ("too_large") or not
``text/html``/``application/xhtml+xml`` ("content_type") are refused; text is extracted with trafilatura;
empty text is "no_content". Failure reasons: excluded, timeout, connection_error, http_<code>,
too_many_redirects, content_type, too_large, no_content, extract_error.

Upstream (eukaryote31 download.py + scrapers.py) quirk decisions:
* id scheme ``{i:07d}-{sha256}`` (README's ``{domain}-{sha256}`` is stale) -> KEPT.
* newspaper3k scraper (unmaintained, no longer installs) -> REPLACED by trafilatura; bs4/raw scrapers dropped.
* no timeout by default (a hung server blocks a worker forever) -> FIXED: 10 s default, retries with backoff.
* no size cap or content-type check (PDFs/binaries went to newspaper) -> FIXED.
* failures only as a ``success=0`` sqlite row without reason -> FIXED: a reason per URL + failures.jsonl.
* tar chunks / sqlite ``metadata.db`` in the CWD / ``<url_file>.ckpt`` -> DROPPED: per-URL result files are the
  checkpoint; merge reads them.
* empty-text documents were skipped -> KEPT ("no_content").
"""
from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator

from .fetch import FetchConfig, FetchFailure, extract_text, fetch_html, make_pool
from .io import PipelineError, add_common_args, atomic_write, dump_json_line, open_text, progress, report
from .url_rules import megatron_bad_reason


def result_base(output_dir: Path, index: int, url: str) -> Path:
    """Result path without suffix for URL number ``index``."""
    fid = f"{index:07d}-{hashlib.sha256(url.encode('utf-8', 'surrogatepass')).hexdigest()}"
    return output_dir / "data" / f"{index // 10000:04d}" / fid


def download_one(pool, url: str, base: Path, cfg: FetchConfig) -> str:
    """Fetch, extract and record one URL; returns "kept" or the failure reason."""
    reason = megatron_bad_reason(url)
    text = ""
    if reason:
        reason = "excluded"
    else:
        try:
            html = fetch_html(pool, url, cfg)
            try:
                text = extract_text(html, url)
            except Exception:  # trafilatura/lxml on hostile HTML: record, never crash the run
                reason = "extract_error"
            if not text and not reason:
                reason = "no_content"
        except FetchFailure as failure:
            reason = failure.reason
    if reason:
        with atomic_write(base.with_suffix(".fail")) as out:
            out.write(dump_json_line({"url": url, "reason": reason}))
        return reason
    with atomic_write(base.with_suffix(".json")) as out:
        out.write(dump_json_line({"url": url, "text": text}))
    base.with_suffix(".fail").unlink(missing_ok=True)
    return "kept"


def pending_urls(url_file: Path, output_dir: Path, max_urls: int, retry_failed: bool,
                 counts: Counter) -> Iterator[tuple[str, Path]]:
    """Yield (url, result base) for URLs without a finished result; counts the skipped ones."""
    with open_text(url_file) as lines:
        for index, line in enumerate(lines):
            if 0 <= max_urls <= index:
                break
            url = line.strip()
            if not url:
                continue
            base = result_base(output_dir, index, url)
            if base.with_suffix(".json").exists():
                counts["skipped_done:kept"] += 1
            elif base.with_suffix(".fail").exists() and not retry_failed:
                counts["skipped_done:failed"] += 1
            else:
                yield url, base


def run_downloads(args, cfg: FetchConfig, counts: Counter) -> None:
    """Bounded-window thread pool over the pending URLs."""
    pool = make_pool(cfg, args.concurrency)
    window = 4 * args.concurrency
    bar = progress(desc="download", unit="url", enabled=not args.no_progress)
    with ThreadPoolExecutor(args.concurrency) as executor:
        running: set[Future] = set()
        for url, base in pending_urls(args.url_file, args.output_dir, args.max_urls, args.retry_failed, counts):
            running.add(executor.submit(download_one, pool, url, base, cfg))
            if len(running) >= window:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                tally(done, counts, bar)
        tally(wait(running).done, counts, bar)
    bar.close()


def tally(done: set[Future], counts: Counter, bar) -> None:
    for future in done:
        outcome = future.result()
        counts["kept" if outcome == "kept" else f"removed:{outcome}"] += 1
        bar.update(1)


def write_failures(output_dir: Path) -> None:
    """Collect every ``.fail`` record (sorted by id) into ``failures.jsonl`` atomically."""
    with atomic_write(output_dir / "failures.jsonl") as out:
        for path in sorted((output_dir / "data").glob("*/*.fail")):
            record = json.loads(path.read_text(encoding="utf-8"))
            record["id"] = path.stem
            out.write(dump_json_line(record))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url-file", type=Path, required=True, help="one URL per line (blacklist_urls output)")
    parser.add_argument("--output-dir", type=Path, required=True, help="result folder (data/ + failures.jsonl)")
    parser.add_argument("--concurrency", type=int, default=16, help="simultaneous downloads (threads)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (connect/read/body)")
    parser.add_argument("--retries", type=int, default=2, help="retries for timeouts, connection errors, 429/5xx")
    parser.add_argument("--backoff", type=float, default=1.0, help="first retry delay in s; doubles per retry")
    parser.add_argument("--max-bytes", type=int, default=5 << 20, help="skip pages larger than this")
    parser.add_argument("--max-urls", type=int, default=-1, help="only the first N URLs (-1 = all)")
    parser.add_argument("--proxy", default=None, help="HTTP proxy URL for every request (tests use a local one)")
    parser.add_argument("--retry-failed", action="store_true", help="re-try URLs recorded as failed")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.timeout <= 0:
        raise PipelineError("--concurrency must be >= 1 and --timeout > 0; fix the flag values")
    cfg = FetchConfig(timeout=args.timeout, retries=args.retries, backoff=args.backoff,
                      max_bytes=args.max_bytes, proxy=args.proxy)
    counts: Counter = Counter()
    run_downloads(args, cfg, counts)
    write_failures(args.output_dir)
    return report("download", counts, args.summary)


if __name__ == "__main__":
    main()
