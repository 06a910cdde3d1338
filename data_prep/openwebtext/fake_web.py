"""A local stand-in for the web, for offline tests and benchmarks of the download step.

``FakeWeb`` is an HTTP *proxy* on 127.0.0.1: point ``download --proxy`` at it and every ``http://`` URL is
answered locally. Page ``i`` (the URL's position in the list given to the server) is built from the real
corpora in ``tests/data/corpora`` (Emma paragraphs, Shakespeare blocks, WebText samples). By ``i % 20``:
0 -> 404; 1 -> 301 redirect to ``http://moved.example/<i>`` (then the page); 2 -> a PDF (non-HTML);
3 -> slow (sleeps ``slow_s`` before answering); 6 -> exact copy of page i-1; 7 -> near copy of page i-2
(a few words changed); 8 -> 503 on the first request, the page on a retry; 9 -> a body larger than
``big_bytes``; otherwise a distinct page. Unknown URLs get 404.
"""
from __future__ import annotations

import html
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit


def corpus_chunks(corpora: Path) -> list[str]:
    """Distinct multi-paragraph texts: WebText samples, then Emma (4 paragraphs) and Shakespeare (10 blocks)."""
    samples = [p.read_text(encoding="utf-8") for p in sorted((corpora / "webtext_gpt2_sample").glob("*.txt"))]
    emma = _blocks(corpora / "gutenberg_emma" / "austen-emma.txt", 4)
    shakespeare = _blocks(corpora / "tinyshakespeare" / "input.txt", 10)
    mixed = [doc for pair in zip(emma, shakespeare) for doc in pair]
    return samples + mixed


def _blocks(path: Path, per_chunk: int) -> list[str]:
    paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return ["\n\n".join(paras[i:i + per_chunk]) for i in range(0, len(paras) - per_chunk + 1, per_chunk)]


def near_copy(text: str) -> str:
    """The same text with a few words changed (Jaccard of char 5-grams stays well above 0.7)."""
    words = text.split(" ")
    for k in range(5, len(words), max(len(words) // 4, 6)):
        words[k] = words[k].upper()
    return " ".join(words) + "\n\nShare this story."


def page_html(title: str, text: str) -> bytes:
    paras = "".join(f"<p>{html.escape(p)}</p>\n" for p in text.split("\n\n"))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body><nav><a href='/'>Home</a> | <a href='/about'>About us</a></nav>"
            f"<article><h1>{html.escape(title)}</h1>\n{paras}</article>"
            f"<footer>Copyright 2005 Example Media. All rights reserved.</footer></body></html>").encode("utf-8")


class FakeWeb:
    """Start with ``with FakeWeb(urls, corpora) as web:``; ``web.proxy`` is the proxy URL."""

    def __init__(self, urls: list[str], corpora: Path, slow_s: float = 3.0, big_bytes: int = 300_000) -> None:
        self.index = {u: i for i, u in enumerate(dict.fromkeys(urls))}
        self.chunks = corpus_chunks(corpora)
        self.slow_s, self.big_bytes = slow_s, big_bytes
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.proxy = f"http://127.0.0.1:{self.server.server_address[1]}"

    def text(self, i: int) -> tuple[int, str]:
        """(source page number, text) of page ``i``; an exact copy has its source's title too."""
        kind = i % 20
        if kind == 6:
            return self.text(i - 1)
        if kind == 7:
            return i - 2, near_copy(self.text(i - 2)[1])
        return i, self.chunks[i % len(self.chunks)]

    def respond(self, url: str) -> tuple[int, dict, bytes]:
        """(status, headers, body) for one request URL."""
        parts = urlsplit(url)
        if parts.hostname == "moved.example":
            i = int(parts.path.strip("/"))
        elif url in self.index:
            i = self.index[url]
        else:
            return 404, {"Content-Type": "text/html"}, b"<html><body>Not found</body></html>"
        kind = i % 20
        page = lambda: page_html(f"Story {self.text(i)[0]}", self.text(i)[1])  # noqa: E731
        if parts.hostname != "moved.example":
            if kind == 0:
                return 404, {"Content-Type": "text/html"}, b"<html><body>Not found</body></html>"
            if kind == 1:
                return 301, {"Location": f"http://moved.example/{i}"}, b""
            if kind == 2:
                return 200, {"Content-Type": "application/pdf"}, b"%PDF-1.4\n" + b"0" * 1000
            if kind == 3:
                time.sleep(self.slow_s)
            if kind == 8:
                with self.lock:
                    first = url not in self.seen
                    self.seen.add(url)
                if first:
                    return 503, {"Content-Type": "text/html"}, b"busy"
            if kind == 9:
                return 200, {"Content-Type": "text/html"}, page() + b"<!--" + b"x" * self.big_bytes + b"-->"
        return 200, {"Content-Type": "text/html; charset=utf-8"}, page()

    def _handler(self):
        web = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                try:
                    status, headers, body = web.respond(self.path)
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args) -> None:
                pass

        return Handler

    def __enter__(self) -> "FakeWeb":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    """Serve the fake web for the URLs in a file until interrupted (manual runs and the driver demo)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url-file", type=Path, required=True)
    parser.add_argument("--corpora", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, help="write the proxy URL here once listening")
    args = parser.parse_args()
    urls = [u.strip() for u in args.url_file.read_text(encoding="utf-8").splitlines() if u.strip()]
    with FakeWeb(urls, args.corpora) as web:
        if args.port_file:
            args.port_file.write_text(web.proxy + "\n")
        print(web.proxy, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
