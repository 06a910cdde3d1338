"""End to end: real Pushshift dumps -> local fake web -> scripts/prepare_openwebtext.sh -> validated .bin/.idx.

Fully offline: downloads go through a proxy on 127.0.0.1 that serves pages built from the real corpora
(see data_prep/openwebtext/fake_web.py). Also checks that killing the driver mid-download and re-running it
gives byte-identical outputs to an uninterrupted run.
"""
import json
import shutil
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from data_prep.openwebtext import blacklist_urls, dedup_urls, extract_urls
from data_prep.openwebtext.fake_web import FakeWeb

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_openwebtext.sh"


@pytest.fixture(scope="module")
def dumps(unshipped_data):
    """The real Pushshift dumps (not shipped: tests/data/SOURCE.md)."""
    return unshipped_data("openwebtext_urls/pushshift_dumps")


@pytest.fixture(scope="module")
def web(dumps, real_data, tmp_path_factory):
    """The fake web, indexed by the URL list the driver will produce (steps 1-3 are deterministic)."""
    tmp = tmp_path_factory.mktemp("urls")
    extract_urls.main(["--psdir", str(dumps), "--outdir", str(tmp / "u"), "--no-progress"])
    dedup_urls.main(["--input-dir", str(tmp / "u"), "--output-dir", str(tmp / "d"), "--no-progress"])
    blacklist_urls.main([str(tmp / "d"), "--output", str(tmp / "clean.txt"), "--no-progress"])
    urls = (tmp / "clean.txt").read_text().splitlines()
    with FakeWeb(urls, real_data / "corpora", slow_s=4.0, big_bytes=300_000) as server:
        yield server


def driver_cmd(dumps, gpt2_files, out, proxy):
    return ["bash", str(SCRIPT), "--dumps", str(dumps),
            "--output", str(out), "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1], "--proxy", proxy,
            "--timeout", "2", "--retries", "1", "--backoff", "0.05", "--max-bytes", "200000",
            "--concurrency", "24", "--workers", "2", "--no-progress"]


@pytest.fixture(scope="module")
def full_run(dumps, gpt2_files, web, tmp_path_factory):
    out = tmp_path_factory.mktemp("owt_full")
    subprocess.run(driver_cmd(dumps, gpt2_files, out, web.proxy), check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def summary(out, step):
    return json.loads((out / "summaries" / f"{step}.json").read_text())["counts"]


def test_end_to_end_counts_and_valid_dataset(full_run):
    from megapar.data.indexed_dataset import IndexedDataset
    from megapar.data.validate import validate

    assert summary(full_run, "extract_urls")["kept"] == 826
    assert summary(full_run, "blacklist_urls") == {"urls": 826, "kept": 824, "removed:domain": 2}
    dl = summary(full_run, "download")
    # 824 URLs; by i % 20: 0 -> 404, 2 -> PDF, 3 -> slow, 9 -> too large (42, 42, 42, 41 of them), plus 3
    # URLs that urllib3 re-encodes on the wire, so the fake web does not recognise them (404).
    assert dl == {"kept": 654, "removed:http_404": 45, "removed:content_type": 42,
                  "removed:timeout": 42, "removed:too_large": 41}
    cleaned = summary(full_run, "cleanup")
    assert cleaned["documents"] == 654 and cleaned["kept"] + cleaned["removed:too_short"] == 654
    removed = summary(full_run, "remove_duplicates")
    # pages i%20 == 6 (exact copy of i-1) and 7 (near copy of i-2) must go: at least 2 per 20 cleaned pages.
    assert removed["removed:near_duplicate"] >= 70 and removed["documents"] == cleaned["kept"]
    final = [json.loads(line) for line in (full_run / "openwebtext.jsonl").read_text().splitlines()]
    assert len(final) == removed["kept"] and len({d["text"] for d in final}) == len(final)
    stats = validate(str(full_run / "openwebtext_text_document"))
    assert stats["num_documents"] == len(final)
    ds = IndexedDataset(str(full_run / "openwebtext_text_document"))
    assert len(ds) == len(final) and all(int(ds[i][-1]) == 50256 for i in range(len(ds)))
    assert min(int(n) for n in ds.sizes) >= 129  # >= 128 tokens + EOD


@pytest.mark.slow  # --quick skips it (a second full driver run)
def test_interrupted_then_resumed_run_matches(dumps, gpt2_files, web, full_run, tmp_path):
    out = tmp_path / "owt"
    proc = subprocess.Popen(driver_cmd(dumps, gpt2_files, out, web.proxy), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "download" / "data").glob("*/*.json"))) < 150:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group
    proc.wait()
    assert not (out / "merged.jsonl").exists()
    subprocess.run(driver_cmd(dumps, gpt2_files, out, web.proxy), check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert summary(out, "download").get("skipped_done:kept", 0) >= 150
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
