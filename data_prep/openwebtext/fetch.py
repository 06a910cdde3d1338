"""One URL -> (text, None) or (None, failure reason): HTTP with timeouts, retries, size cap, type check, extraction."""
from __future__ import annotations

import time
from dataclasses import dataclass

import urllib3

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
HTML_TYPES = ("text/html", "application/xhtml+xml")


@dataclass(frozen=True)
class FetchConfig:
    timeout: float = 10.0          # seconds per request (connect, read, and whole body)
    retries: int = 2               # extra attempts after a retryable failure
    backoff: float = 1.0           # sleep backoff * 2**attempt between attempts
    max_bytes: int = 5 << 20       # size cap for one page
    max_redirects: int = 5
    proxy: str | None = None       # e.g. http://127.0.0.1:8080 (tests serve pages through a local proxy)
    user_agent: str = "megapar-openwebtext/1.0"


class FetchFailure(Exception):
    """A failed fetch; ``reason`` is the summary key, ``retryable`` whether another attempt may help."""

    def __init__(self, reason: str, retryable: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.retryable = reason, retryable


def make_pool(cfg: FetchConfig, size: int) -> urllib3.PoolManager:
    """A thread-safe connection pool (through ``cfg.proxy`` if set)."""
    headers = {"User-Agent": cfg.user_agent, "Accept": "text/html,application/xhtml+xml;q=0.9,*/*;q=0.1"}
    if cfg.proxy:
        return urllib3.ProxyManager(cfg.proxy, num_pools=size, maxsize=size, headers=headers)
    return urllib3.PoolManager(num_pools=size, maxsize=size, headers=headers)


def read_capped(resp: urllib3.BaseHTTPResponse, cfg: FetchConfig, deadline: float) -> bytes:
    """Read the body in chunks, failing on the size cap or the overall deadline (slow drips)."""
    length = resp.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > cfg.max_bytes:
        raise FetchFailure("too_large")
    chunks, size = [], 0
    for chunk in resp.stream(64 << 10):
        size += len(chunk)
        if size > cfg.max_bytes:
            raise FetchFailure("too_large")
        if time.monotonic() > deadline:
            raise FetchFailure("timeout", retryable=True)
        chunks.append(chunk)
    return b"".join(chunks)


def fetch_once(pool: urllib3.PoolManager, url: str, cfg: FetchConfig) -> bytes:
    """One attempt: GET ``url`` following redirects; returns the HTML body or raises FetchFailure."""
    deadline = time.monotonic() + cfg.timeout
    retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=cfg.max_redirects,
                            raise_on_redirect=True)
    try:
        resp = pool.request("GET", url, preload_content=False, retries=retries,
                            timeout=urllib3.Timeout(connect=cfg.timeout, read=cfg.timeout))
    except urllib3.exceptions.MaxRetryError as exc:
        reason = exc.reason
        if isinstance(reason, urllib3.exceptions.TimeoutError):
            raise FetchFailure("timeout", retryable=True) from None
        if isinstance(reason, urllib3.exceptions.ResponseError):
            raise FetchFailure("too_many_redirects") from None
        raise FetchFailure("connection_error", retryable=True) from None
    except urllib3.exceptions.TimeoutError:
        raise FetchFailure("timeout", retryable=True) from None
    except (urllib3.exceptions.HTTPError, ValueError):
        raise FetchFailure("connection_error", retryable=True) from None
    try:
        if resp.status != 200:
            raise FetchFailure(f"http_{resp.status}", retryable=resp.status in RETRYABLE_STATUS)
        ctype = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype and ctype not in HTML_TYPES:
            raise FetchFailure("content_type")
        try:
            return read_capped(resp, cfg, deadline)
        except (urllib3.exceptions.HTTPError, OSError):
            raise FetchFailure("timeout", retryable=True) from None
    finally:
        resp.release_conn()


def fetch_html(pool: urllib3.PoolManager, url: str, cfg: FetchConfig) -> bytes:
    """``fetch_once`` with up to ``cfg.retries`` retries and exponential backoff on retryable failures."""
    for attempt in range(cfg.retries + 1):
        try:
            return fetch_once(pool, url, cfg)
        except FetchFailure as failure:
            if not failure.retryable or attempt == cfg.retries:
                raise
            time.sleep(cfg.backoff * 2**attempt)
    raise AssertionError("unreachable")


def extract_text(html: bytes, url: str) -> str:
    """Main text of an HTML page via trafilatura (boilerplate, menus and comments removed)."""
    import trafilatura

    text = trafilatura.extract(html, url=url, include_comments=False, include_tables=False,
                               deduplicate=False, favor_precision=False)
    return (text or "").strip()
