"""End to end: Pushshift dumps -> local fake web -> scripts/prepare_openwebtext.sh -> validated .bin/.idx.

The dumps are built by the test (tests/standin_data.py: every URL rule hit, counts from the construction); the
real ones (not shipped) run the end-to-end counts too. Fully offline: downloads go through a proxy on 127.0.0.1
that serves pages built from the real corpora (see data_prep/openwebtext/fake_web.py). Also checks that killing
the driver mid-download and re-running it gives byte-identical outputs to an uninterrupted run.
"""
import json
import shutil
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from standin_data import expected_counts, write_pushshift_dumps

from data_prep.openwebtext import blacklist_urls, dedup_urls, extract_urls
from data_prep.openwebtext.fake_web import FakeWeb

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_openwebtext.sh"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Two months of submissions in the real dumps' format (tests/standin_data.py)."""
    return write_pushshift_dumps(tmp_path_factory.mktemp("pushshift"))


@pytest.fixture(scope="module")
def real_dumps(unshipped_data):
    """The real Pushshift dumps (not shipped: tests/data/SOURCE.md)."""
    return unshipped_data("openwebtext_urls/pushshift_dumps")


def serve(dumps, corpora, tmp):
    """The fake web, indexed by the URL list the driver will produce (steps 1-3 are deterministic)."""
    extract_urls.main(["--psdir", str(dumps), "--outdir", str(tmp / "u"), "--no-progress"])
    dedup_urls.main(["--input-dir", str(tmp / "u"), "--output-dir", str(tmp / "d"), "--no-progress"])
    blacklist_urls.main([str(tmp / "d"), "--output", str(tmp / "clean.txt"), "--no-progress"])
    urls = (tmp / "clean.txt").read_text().splitlines()
    return FakeWeb(urls, corpora, slow_s=4.0, big_bytes=300_000)


@pytest.fixture(scope="module")
def web(dumps, real_data, tmp_path_factory):
    with serve(dumps, real_data / "corpora", tmp_path_factory.mktemp("urls")) as server:
        yield server


@pytest.fixture(scope="module")
def real_web(real_dumps, real_data, tmp_path_factory):
    with serve(real_dumps, real_data / "corpora", tmp_path_factory.mktemp("real_urls")) as server:
        yield server


def driver_cmd(dumps, gpt2_files, out, proxy):
    return ["bash", str(SCRIPT), "--dumps", str(dumps),
            "--output", str(out), "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1], "--proxy", proxy,
            "--timeout", "2", "--retries", "1", "--backoff", "0.05", "--max-bytes", "200000",
            "--concurrency", "24", "--workers", "2", "--no-progress"]


def drive(dumps, gpt2_files, web, out):
    subprocess.run(driver_cmd(dumps, gpt2_files, out, web.proxy), check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="module")
def full_run(dumps, gpt2_files, web, tmp_path_factory):
    return drive(dumps, gpt2_files, web, tmp_path_factory.mktemp("owt_full"))


@pytest.fixture(scope="module")
def real_full_run(real_dumps, gpt2_files, real_web, tmp_path_factory):
    return drive(real_dumps, gpt2_files, real_web, tmp_path_factory.mktemp("owt_real"))


def summary(out, step):
    return json.loads((out / "summaries" / f"{step}.json").read_text())["counts"]


def fake_web_download_counts(n: int) -> dict:
    """The download step's counts for n URLs on the fake web: by i % 20, 0 -> 404, 2 -> PDF, 3 -> slow (past
    --timeout), 9 -> too large; the others (redirects and a 503 then the page included) are kept."""
    removed = {key: sum(i % 20 == k for i in range(n)) for k, key in
               ((0, "removed:http_404"), (2, "removed:content_type"), (3, "removed:timeout"), (9, "removed:too_large"))}
    return {"kept": n - sum(removed.values()), **removed}


def check_later_steps(out, downloaded: int, min_near_duplicates: int) -> None:
    """cleanup .. binarisation of a finished driver run: counts add up, the dataset is valid, GPT-2 EOD ends
    each document, every document has >= 128 tokens."""
    from megapar.data.indexed_dataset import IndexedDataset
    from megapar.data.validate import validate

    cleaned = summary(out, "cleanup")
    assert cleaned["documents"] == downloaded and cleaned["kept"] + cleaned["removed:too_short"] == downloaded
    removed = summary(out, "remove_duplicates")
    # pages i%20 == 6 (exact copy of i-1) and 7 (near copy of i-2) must go
    assert removed["removed:near_duplicate"] >= min_near_duplicates and removed["documents"] == cleaned["kept"]
    final = [json.loads(line) for line in (out / "openwebtext.jsonl").read_text().splitlines()]
    assert len(final) == removed["kept"] and len({d["text"] for d in final}) == len(final)
    stats = validate(str(out / "openwebtext_text_document"))
    assert stats["num_documents"] == len(final)
    ds = IndexedDataset(str(out / "openwebtext_text_document"))
    assert len(ds) == len(final) and all(int(ds[i][-1]) == 50256 for i in range(len(ds)))
    assert min(int(n) for n in ds.sizes) >= 129  # >= 128 tokens + EOD


def test_end_to_end_counts_and_valid_dataset(full_run):
    expected = expected_counts()
    assert summary(full_run, "extract_urls") == expected["extract"]
    assert summary(full_run, "dedup_urls") == expected["dedup"]
    assert summary(full_run, "blacklist_urls") == expected["blacklist"]
    n = expected["blacklist"]["kept"]
    dl = fake_web_download_counts(n)
    assert summary(full_run, "download") == dl
    copies = sum(i % 20 in (6, 7) for i in range(n))
    check_later_steps(full_run, dl["kept"], min_near_duplicates=copies * 4 // 5)


def test_end_to_end_counts_on_real_dumps(real_full_run):
    assert summary(real_full_run, "extract_urls")["kept"] == 826
    assert summary(real_full_run, "blacklist_urls") == {"urls": 826, "kept": 824, "removed:domain": 2}
    dl = fake_web_download_counts(824)  # and 3 more 404s: URLs that urllib3 re-encodes on the wire, so the fake
    dl["kept"] -= 3  # web does not recognise them
    dl["removed:http_404"] += 3
    assert summary(real_full_run, "download") == dl
    check_later_steps(real_full_run, dl["kept"], min_near_duplicates=70)


def test_interrupted_then_resumed_run_matches(dumps, gpt2_files, web, full_run, tmp_path):
    out = tmp_path / "owt"
    proc = subprocess.Popen(driver_cmd(dumps, gpt2_files, out, web.proxy), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "download" / "data").glob("*/*.json"))) < 80:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group
    proc.wait()
    assert not (out / "merged.jsonl").exists()
    subprocess.run(driver_cmd(dumps, gpt2_files, out, web.proxy), check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert summary(out, "download").get("skipped_done:kept", 0) >= 80
    for name in ("openwebtext.jsonl", "openwebtext_text_document.bin", "openwebtext_text_document.idx"):
        assert (out / name).read_bytes() == (full_run / name).read_bytes(), name
    assert not list(out.rglob("*.tmp"))  # no temp files left behind


def test_driver_rejects_missing_vocab(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT), "--dumps", str(tmp_path), "--output", str(tmp_path),
                          "--vocab-file", str(tmp_path / "nope.json"), "--merge-file", "x"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "vocab-file" in res.stderr


AFTER_CLEANUP = ("near_duplicates.jsonl", "duplicate_groups.jsonl", "deduplicated.jsonl", "openwebtext.jsonl",
                 "openwebtext_text_document.bin", "openwebtext_text_document.idx")


def test_driver_runs_the_optional_fix_and_decontamination_steps(dumps, gpt2_files, web, full_run, tmp_path):
    """A copy of the full run's output up to cleanup, resumed with --fix-tasks and --decontaminate-with
    (an evaluation file of 20-word passages from three cleaned pages): the new steps run, the
    overlaps are gone from the final corpus, and a re-run skips every step."""
    from data_prep.openwebtext.filter_ngrams import words_of
    from megapar.data.validate import validate

    out = tmp_path / "owt"
    shutil.copytree(full_run, out)
    for name in AFTER_CLEANUP:
        (out / name).unlink()
    cleaned = [json.loads(line) for line in (out / "cleaned.jsonl").read_text().splitlines()]
    leaked = []
    for doc in cleaned[10:13]:
        words, spans = words_of(doc["text"])
        leaked.append(doc["text"][spans[len(words) // 2][0]:spans[len(words) // 2 + 19][1]])
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"text": s}) + "\n" for s in leaked))
    cmd = [*driver_cmd(dumps, gpt2_files, out, web.proxy), "--fix-tasks", "remove_512,general_cleaning",
           "--decontaminate-with", str(eval_file)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fixed = summary(out, "cleanup_fix_dataset")
    assert fixed["documents"] == len(cleaned) and fixed["kept"] == summary(out, "remove_duplicates")["documents"]
    decontaminated = summary(out, "filter_ngrams")
    assert decontaminated["eval_ngrams"] == 3 * 8 and decontaminated["kept"] < decontaminated["documents"]
    final = (out / "openwebtext.jsonl").read_text()
    assert all(s not in final for s in leaked)
    assert validate(str(out / "openwebtext_text_document"))["num_documents"] == len(final.splitlines())
    before = {p: p.read_bytes() for p in out.glob("*.jsonl")}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "[filter_ngrams] done already" in again.stderr
    assert "[cleanup_fix_dataset] done already" in again.stderr
    assert {p: p.read_bytes() for p in out.glob("*.jsonl")} == before


def test_driver_refuses_an_optional_step_asked_for_too_late(dumps, gpt2_files, full_run, tmp_path):
    """Asking for --fix-tasks on an output whose later steps were done without it would not apply it."""
    out = tmp_path / "owt"
    shutil.copytree(full_run, out, ignore=shutil.ignore_patterns("download"))
    res = subprocess.run(["bash", str(SCRIPT), "--dumps", str(dumps),
                          "--output", str(out), "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1],
                          "--fix-tasks", "remove_512", "--no-progress"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "error: --fix-tasks was not given when" in res.stderr, res.stderr[-2000:]
    assert not (out / "fixed").exists()
