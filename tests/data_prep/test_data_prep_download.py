"""Download step against a local HTTP proxy (127.0.0.1) serving pages built from the real corpora."""
import json

import pytest

from data_prep.openwebtext import download
from data_prep.openwebtext.fake_web import FakeWeb

URLS = [f"http://news{i}.example.com/story/{i}.html" for i in range(40)]


@pytest.fixture(scope="module")
def web(real_data):
    with FakeWeb(URLS, real_data / "corpora", slow_s=2.5, big_bytes=300_000) as server:
        yield server


def run(tmp_path, web, *extra):
    url_file = tmp_path / "urls.txt"
    url_file.write_text("\n".join(URLS + ["http://unknown.example.com/gone"]) + "\n")
    return download.main(["--url-file", str(url_file), "--output-dir", str(tmp_path / "dl"), "--proxy", web.proxy,
                          "--timeout", "1", "--retries", "2", "--backoff", "0.05", "--max-bytes", "200000",
                          "--concurrency", "8", "--no-progress", *extra])


def test_download_kept_and_failures_by_reason(tmp_path, web):
    counts = run(tmp_path, web)["counts"]
    # i % 20: 0 -> 404, 2 -> PDF, 3 -> slow, 9 -> too large; 1 (redirect) and 8 (503 then OK) succeed.
    assert counts == {"kept": 32, "removed:http_404": 3, "removed:content_type": 2,
                      "removed:timeout": 2, "removed:too_large": 2}
    failures = [json.loads(line) for line in (tmp_path / "dl" / "failures.jsonl").read_text().splitlines()]
    assert {f["reason"] for f in failures} == {"http_404", "content_type", "timeout", "too_large"}
    docs = sorted((tmp_path / "dl" / "data").glob("*/*.json"))
    first = json.loads(docs[0].read_text())
    assert first["url"] == URLS[1] and "Home" not in first["text"] and len(first["text"]) > 200  # redirected
    assert docs[0].name.startswith("0000001-")


def test_download_resume_skips_finished(tmp_path, web):
    run(tmp_path, web)
    counts = run(tmp_path, web)["counts"]
    assert counts == {"skipped_done:kept": 32, "skipped_done:failed": 9}


def test_download_bad_flags(tmp_path, web):
    with pytest.raises(SystemExit):
        run(tmp_path, web, "--concurrency", "0")
