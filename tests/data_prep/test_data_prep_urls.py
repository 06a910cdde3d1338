"""URL stages of the OpenWebText pipeline (extract, cross-month dedup, blacklist) on Pushshift dumps built by the
test (tests/standin_data.py: every rule hit on purpose, counts from the construction) and on the real ones."""
import bz2
import json
import lzma

import pytest
from standin_data import expected_counts, raw_urls, submissions, write_pushshift_dumps

from data_prep.openwebtext import blacklist_urls, dedup_urls, extract_urls
from data_prep.openwebtext.url_rules import megatron_bad_reason


@pytest.fixture(scope="module")
def dumps(unshipped_data):
    """The real Pushshift dumps (not shipped: tests/data/SOURCE.md)."""
    return unshipped_data("openwebtext_urls/pushshift_dumps")


@pytest.fixture(scope="module")
def standin_dumps(tmp_path_factory):
    """Two months of submissions in the real dumps' format, built by tests/standin_data.py."""
    return write_pushshift_dumps(tmp_path_factory.mktemp("pushshift"))


def test_extract_counts_on_standin_dumps(standin_dumps, tmp_path):
    summary = extract_urls.main(["--psdir", str(standin_dumps), "--outdir", str(tmp_path), "--no-progress"])
    assert summary["counts"] == expected_counts()["extract"]
    june = (tmp_path / "RS_v2_2005-06.xz.goodlinks.txt").read_text().splitlines()
    assert june == [s.url for s in submissions()["2005-06"] if s.extract == "kept"]  # raw, in dump order
    again = extract_urls.main(["--psdir", str(standin_dumps), "--outdir", str(tmp_path), "--no-progress"])
    assert again["counts"] == {"dumps_skipped_done": 2}  # resume: finished dumps are skipped


def test_url_stages_in_turn_on_standin_dumps(standin_dumps, tmp_path):
    """extract -> dedup (across months: another spelling of a URL is a duplicate) -> Megatron's blacklist."""
    expected = expected_counts()
    extract_urls.main(["--psdir", str(standin_dumps), "--outdir", str(tmp_path / "u"), "--no-progress"])
    dedup = dedup_urls.main(["--input-dir", str(tmp_path / "u"), "--output-dir", str(tmp_path / "d"),
                             "--no-progress"])
    assert dedup["counts"] == expected["dedup"]
    black = blacklist_urls.main([str(tmp_path / "d"), "--output", str(tmp_path / "clean.txt"), "--no-progress"])
    assert black["counts"] == expected["blacklist"]
    clean = [s.url.replace("&amp;", "&") for month in submissions().values() for s in month
             if s.extract == "kept" and s.dedup == "kept" and s.megatron is None]
    assert (tmp_path / "clean.txt").read_text().splitlines() == clean


def test_blacklist_counts_on_standin_urls(tmp_path):
    """The unfiltered URL list of the stand-in dumps through Megatron's blacklist alone."""
    urls = raw_urls()
    (tmp_path / "urls.txt").write_text("\n".join(urls) + "\n")
    summary = blacklist_urls.main([str(tmp_path / "urls.txt"), "--output", str(tmp_path / "clean.txt"),
                                   "--no-progress"])
    assert summary["counts"] == expected_counts()["blacklist_raw"]
    fate = {s.url: s.megatron for month in submissions().values() for s in month}
    assert (tmp_path / "clean.txt").read_text().splitlines() == list(dict.fromkeys(u for u in urls
                                                                                   if fate[u] is None))


def test_extract_counts_on_real_dumps(dumps, tmp_path):
    summary = extract_urls.main(["--psdir", str(dumps), "--outdir", str(tmp_path), "--no-progress"])
    # 1,182 submissions; 840 have score >= 3 (SOURCE.md); jcpeterson's list drops 7 by domain, 7 by extension.
    assert summary["counts"] == {"submissions": 1182, "kept": 826, "removed:low_karma": 342,
                                 "removed:domain": 7, "removed:extension": 7, "dumps_done": 2}
    june = (tmp_path / "RS_v2_2005-06.xz.goodlinks.txt").read_text().splitlines()
    assert len(june) == 81 and all(u.startswith("http://") for u in june)
    again = extract_urls.main(["--psdir", str(dumps), "--outdir", str(tmp_path), "--no-progress"])
    assert again["counts"] == {"dumps_skipped_done": 2}  # resume: finished dumps are skipped


def test_extract_reads_bz2_and_zst_like_xz(standin_dumps, tmp_path):
    zstandard = pytest.importorskip("zstandard")
    raw = lzma.decompress((standin_dumps / "RS_v2_2005-06.xz").read_bytes())
    src = tmp_path / "src"
    src.mkdir()
    (src / "RS_2005-06.bz2").write_bytes(bz2.compress(raw))
    (src / "RS_2005-07.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    extract_urls.main(["--psdir", str(src), "--outdir", str(tmp_path / "out"), "--no-progress"])
    a = (tmp_path / "out" / "RS_2005-06.bz2.goodlinks.txt").read_text()
    b = (tmp_path / "out" / "RS_2005-07.zst.goodlinks.txt").read_text()
    assert a == b and len(a.splitlines()) == expected_counts()["june_kept"]


def test_dedup_normalisation_and_month_order(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    (src / "RS_2011-02.bz2.goodlinks.txt").write_text(
        "http://a.com/x?b=2&a=1\nhttp://A.com/y\nhttp://new.com/z?q=1&amp;r=2\n")
    (src / "RS_2011-01.bz2.goodlinks.txt").write_text("http://a.com/x?a=1&b=2\nhttp://a.com/y")  # no final \n
    summary = dedup_urls.main(["--input-dir", str(src), "--output-dir", str(out), "--no-progress"])
    assert summary["counts"] == {"urls": 5, "kept": 3, "removed:duplicate": 2}
    assert (out / "RS_2011-01.bz2.deduped.txt").read_text() == "http://a.com/x?a=1&b=2\nhttp://a.com/y\n"
    assert (out / "RS_2011-02.bz2.deduped.txt").read_text() == "http://new.com/z?q=1&r=2\n"  # unescaped


def test_blacklist_reference_counts(unshipped_data, tmp_path):
    urls = unshipped_data("openwebtext_urls/RS_v2_2005-06_07.urls.txt")
    out = tmp_path / "clean.txt"
    summary = blacklist_urls.main([str(urls), "--output", str(out), "--no-progress"])
    assert summary["counts"] == {"urls": 1182, "kept": 1162, "removed:domain": 10, "removed:extension": 10}
    assert out.read_text().splitlines() == [u for u in urls.read_text().splitlines()
                                            if megatron_bad_reason(u) is None]


@pytest.mark.parametrize("url,reason", [
    ("http://maps.google.co.uk/x", "domain"), ("http://i.redd.it/abc", "domain"),
    ("http://example.com/a.7z", "extension"), ("http://example.com/logo.ai", "extension"),
    ("http://example.com/doc.pdf#page=2", "extension"), ("https://x.ai/", None),
    ("http:/a", "short"), ("http://localhost/page", "malformed"), ("http://my_host.com/", "malformed"),
    ("http://example.com/story.html?id=1", None),
])
def test_blacklist_rules(url, reason):
    assert megatron_bad_reason(url) == reason


def test_blacklist_duplicates_and_missing_input(tmp_path):
    (tmp_path / "a.txt").write_text("http://example.com/1\nhttp://example.com/1\n\n")
    summary = blacklist_urls.main([str(tmp_path), "--output", str(tmp_path / "o.out"), "--no-progress"])
    assert summary["counts"] == {"urls": 3, "kept": 1, "removed:duplicate": 1, "removed:short": 1}
    with pytest.raises(SystemExit):
        blacklist_urls.main([str(tmp_path / "nope"), "--output", str(tmp_path / "x")])
    assert not json.dumps(summary).count("malformed")
