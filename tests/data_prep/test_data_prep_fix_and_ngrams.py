"""The two optional OpenWebText steps on the shipped real text (tests/data), offline:
cleanup_fix_dataset (the fix-up pass) and filter_ngrams (13-gram task decontamination, with an
evaluation file made here from a few of the sample's own sentences). Their bad inputs are fault
cases in tests/faults/test_faults_data.py; the driver runs them in test_data_prep_pipeline.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_prep.openwebtext import cleanup_fix_dataset, filter_ngrams
from data_prep.openwebtext.filter_ngrams import Settings, words_of


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def sample_docs(real_data) -> list[dict]:
    """The 9 WebText sample pages and 12 paragraphs-blocks of Emma, each a document with a url."""
    pages = sorted((real_data / "corpora" / "webtext_gpt2_sample").glob("*.txt"))
    docs = [{"text": p.read_text(), "url": f"webtext/{p.name}"} for p in pages]
    emma = (real_data / "corpora" / "gutenberg_emma" / "austen-emma.txt").read_text()
    blocks = [b.strip() for b in emma.split("\n\n") if len(b) > 1500][:12]
    return docs + [{"text": b, "url": f"emma/{i}"} for i, b in enumerate(blocks)]


# ---- cleanup_fix_dataset ---------------------------------------------------------------------------
def fix(src: Path, out: Path, *tasks: str, workers: int = 1) -> dict:
    return cleanup_fix_dataset.main(["--input-files", str(src), "--tasks", *tasks, "--output-path", str(out),
                                     "--workers", str(workers), "--no-progress"])["counts"]


def test_fix_filters_by_length_and_javascript(sample_docs, tmp_path):
    docs = sample_docs + [{"text": "Please enable JavaScript to view this page. " * 3, "url": "js"},
                          {"text": "Ceci est un petit texte en français, écrit pour le test de langue. " * 3,
                           "url": "fr"}]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    counts = fix(src, tmp_path / "out", "remove_512", "remove_256_javascript", workers=2)
    short = [d["url"] for d in docs if len(d["text"]) < 512]
    assert counts == {"documents": len(docs), "kept": len(docs) - len(short), "filtered:remove_512": len(short)}
    assert sorted(short) == ["fr", "js", "webtext/1.txt"]  # 312 chars; remove_512 comes first
    counts = fix(src, tmp_path / "out2", "remove_256_javascript", "remove_512_non_english")
    assert counts == {"documents": len(docs), "kept": len(docs) - 2, "filtered:remove_256_javascript": 1,
                      "filtered:remove_512_non_english": 1}
    kept = read_jsonl(tmp_path / "out2" / "docs_cleaned.jsonl")
    dropped = read_jsonl(tmp_path / "out2" / "docs_filtered.jsonl")
    assert [d["url"] for d in dropped] == ["js", "fr"]
    assert kept == [d for d in docs if d["url"] not in ("js", "fr")]  # untouched, in input order


def test_fix_ftfy_then_general_cleaning(tmp_path):
    docs = [{"text": "The cafÃ© was \ufb01ne.  Really   fine\n\nand good.\nEnd of line", "id": 1},
            {"text": "Plain text.\nNext line stays after a full stop.", "id": 2}]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    (tmp_path / "in.jsonl").open("a").write("not json\n" + json.dumps({"url": "no text"}) + "\n")
    counts = fix(src, tmp_path / "out", "general_cleaning", "ftfy_fix_text")
    assert counts == {"documents": 4, "kept": 2, "fixed_text": 1, "cleaned_text": 1, "filtered:bad_json": 1,
                      "filtered:missing_text": 1}
    out = read_jsonl(tmp_path / "out" / "in_cleaned.jsonl")
    # ftfy (mojibake, ligature) and then general cleaning: space runs and newlines after a word -> one space
    assert out[0] == {"text": "The café was fine. Really fine and good.\nEnd of line", "id": 1}
    assert out[1] == docs[1]  # a newline after punctuation survives
    assert (tmp_path / "out" / "in_filtered.jsonl").read_text().splitlines()[0] == "not json"


def test_fix_output_is_the_same_for_any_worker_count(sample_docs, tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", sample_docs)
    fix(src, tmp_path / "one", "remove_512", "general_cleaning", workers=1)
    fix(src, tmp_path / "two", "remove_512", "general_cleaning", workers=2)
    for name in ("d_cleaned.jsonl", "d_filtered.jsonl"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


# ---- filter_ngrams ---------------------------------------------------------------------------------
def sentence_from(text: str, words: int = 20) -> str:
    """`words` consecutive words from the middle of `text`, as the text has them."""
    w, spans = words_of(text)
    mid = len(w) // 2
    return text[spans[mid][0]:spans[mid + words - 1][1]]


def decontaminate(src: Path, out: Path, eval_file: Path, *extra: str) -> dict:
    return filter_ngrams.main([str(src), str(out), "--decontaminate-with", str(eval_file), "--no-progress",
                               *extra])["counts"]


def all_ngrams(text: str, n: int = 13) -> set[str]:
    w = words_of(text)[0]
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def test_overlaps_are_cut_and_unrelated_docs_untouched(sample_docs, tmp_path):
    contaminated = {"webtext/2.txt", "webtext/9.txt", "emma/3"}
    leaked = [sentence_from(d["text"]) for d in sample_docs if d["url"] in contaminated]
    eval_file = write_jsonl(tmp_path / "lambada_test.jsonl", [{"text": s} for s in leaked]
                            + [{"text": "Too short to count."}])
    src = write_jsonl(tmp_path / "docs.jsonl", sample_docs)
    counts = decontaminate(src, tmp_path / "out.jsonl", eval_file)
    assert counts["documents"] == len(sample_docs) and counts["kept"] == len(sample_docs) - 3
    assert counts["eval_ngrams"] == 3 * (20 - 13 + 1) and counts["eval_ngrams_too_common"] == 0
    assert counts.get("trimmed", 0) + counts.get("split", 0) + counts.get("removed:no_piece_left", 0) == 3

    out_lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    in_lines = src.read_text(encoding="utf-8").splitlines()
    untouched = [line for line in in_lines if json.loads(line)["url"] not in contaminated]
    assert [line for line in out_lines if "split_id" not in json.loads(line)] == untouched  # byte-identical
    eval_grams = set().union(*(all_ngrams(s) for s in leaked))
    pieces = [json.loads(line) for line in out_lines if "split_id" in json.loads(line)]
    assert pieces and {p["url"] for p in pieces} <= contaminated
    originals = {d["url"]: d["text"] for d in sample_docs}
    for p in pieces:
        assert not all_ngrams(p["text"]) & eval_grams  # the overlaps are gone
        assert p["text"] in originals[p["url"]] and len(p["text"]) > 200
        assert p["split_id"].startswith("lambada_test-")
    for s in leaked:
        assert s not in (tmp_path / "out.jsonl").read_text(encoding="utf-8")


def test_common_ngrams_are_kept_and_too_many_splits_drop_the_document(sample_docs, tmp_path):
    doc = sample_docs[2]  # webtext/2.txt, 4,413 characters
    phrase = sentence_from(doc["text"], 13)
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"text": phrase}])
    copies = [{**doc, "url": f"copy{i}"} for i in range(3)]
    src = write_jsonl(tmp_path / "docs.jsonl", copies)
    counts = decontaminate(src, tmp_path / "out.jsonl", eval_file, "--key-threshold", "3")
    assert counts["eval_ngrams_too_common"] == 1 and counts["kept"] == 3  # in 3 documents: common phrasing
    counts = decontaminate(src, tmp_path / "out2.jsonl", eval_file, "--key-threshold", "4", "--splits-count", "1")
    assert "kept" not in counts and counts["removed:too_many_splits"] == 3  # each cut in 2 pieces
    assert (tmp_path / "out2.jsonl").read_text() == ""


def test_cut_widens_to_sentence_ends():
    text = "A" * 300 + ". Start here. " + "x " * 10 + "MATCH" + " y" * 10 + ". After the end. " + "B" * 300
    start = text.index("MATCH")
    # 25 characters either side land inside "Start here." and "After the end.": both sentences go too
    before, after = filter_ngrams.cut_around(text, start, start + 5, margin=25)
    assert before == "A" * 300 + "."
    assert after == " " + "B" * 300
    s = Settings()
    s.remove_char_each_side = 25
    assert filter_ngrams.pieces_of(text, filter_ngrams.Matcher({"match"}), s) == [before, after]
    s.filter_text_char_len = 301  # both pieces have 301 characters: "longer than" keeps neither
    assert filter_ngrams.pieces_of(text, filter_ngrams.Matcher({"match"}), s) == []
