"""Cleanup, near-duplicate detection, grouping, removal and shuffle on the real corpora."""
import json

import numpy as np
import pytest
from standin_data import NON_ENGLISH, reference_gpt2, trunc63_documents

from data_prep.openwebtext import cleanup, find_duplicates, group_duplicates, merge, remove_duplicates, shuffle
from data_prep.openwebtext.fake_web import corpus_chunks, near_copy
from data_prep.openwebtext.minhash import char_ngrams, jaccard, permutations, signatures


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def clean(src, dst, gpt2_files, *extra):
    vocab, merges = gpt2_files
    return cleanup.main([str(src), str(dst), "--vocab-file", vocab, "--merge-file", merges, "--no-progress",
                         "--workers", "1", *extra])["counts"]


def test_cleanup_length_threshold_on_webtext_sample(real_data, gpt2_files, tmp_path):
    files = sorted((real_data / "corpora" / "webtext_gpt2_sample").glob("*.txt"))
    docs = [{"text": f.read_text(), "url": f.name} for f in files]
    counts = clean(write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "out.jsonl", gpt2_files)
    assert counts == {"documents": 9, "kept": 8, "removed:too_short": 1}  # 1.txt has 66 tokens
    kept = {d["url"] for d in read_jsonl(tmp_path / "out.jsonl")}
    assert "1.txt" not in kept and {"0.txt", "5.txt"} <= kept  # 138 and 161 tokens


def test_cleanup_language_on_standin_trunc63(gpt2_files, tmp_path):
    """63-token cuts of the shipped English texts with texts in German, French and Spanish among them."""
    english = trunc63_documents(reference_gpt2())
    docs = list(english)
    for i, text in enumerate(NON_ENGLISH):
        docs.insert(1 + i * len(english) // len(NON_ENGLISH), text)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in docs])
    counts = clean(src, tmp_path / "out.jsonl", gpt2_files, "--min-tokens", "1", "--workers", "2")
    assert counts == {"documents": len(docs), "kept": len(english), "removed:non_english": len(NON_ENGLISH)}
    assert [d["text"] for d in read_jsonl(tmp_path / "out.jsonl")] == english
    counts63 = clean(src, tmp_path / "out2.jsonl", gpt2_files)  # all are under 128 tokens
    assert counts63 == {"documents": len(docs), "removed:too_short": len(english),
                        "removed:non_english": len(NON_ENGLISH)}


def test_cleanup_language_on_trunc63(unshipped_data, gpt2_files, tmp_path):
    """The shipped texts are all English: the non-English documents are in this optional corpus."""
    src = unshipped_data("corpora/webtext_gpt2_trunc63/webtext.test.jsonl")
    counts = clean(src, tmp_path / "out.jsonl", gpt2_files, "--min-tokens", "1", "--workers", "2")
    assert counts == {"documents": 4723, "kept": 4707, "removed:non_english": 16}
    counts63 = clean(src, tmp_path / "out2.jsonl", gpt2_files)  # all are 63 tokens: none reaches 128
    assert counts63["removed:too_short"] == 4707 and "kept" not in counts63


def test_cleanup_fixes_unicode_and_counts_bad_lines(real_data, gpt2_files, tmp_path):
    emma = (real_data / "corpora" / "gutenberg_emma" / "austen-emma.txt").read_text()[:3000]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "The cafÃ© was \ufb01ne &amp; \u201cnice\u201d.\n" + emma}) + "\n"
                   + "not json\n" + json.dumps({"text": "12345"}) + "\n" + json.dumps({"url": "x"}) + "\n")
    counts = clean(src, tmp_path / "out.jsonl", gpt2_files)
    assert counts == {"documents": 4, "kept": 1, "fixed_text": 1, "removed:bad_json": 1,
                      "removed:non_english": 1, "removed:missing_text": 1}
    text = read_jsonl(tmp_path / "out.jsonl")[0]["text"]
    assert text.startswith('The café was fine & "nice".\n')


def test_minhash_estimates_jaccard(real_data):
    chunks = corpus_chunks(real_data / "corpora")[20:60]
    sig = signatures(chunks + [near_copy(c) for c in chunks], permutations(100, 1))
    same = (sig[:40] == sig[40:]).mean(axis=1)
    exact = np.array([jaccard(char_ngrams(c), char_ngrams(near_copy(c))) for c in chunks])
    assert np.abs(same - exact).mean() < 0.08 and exact.min() > 0.7
    assert (sig[:39] == sig[1:40]).mean() < 0.05  # distinct documents rarely agree


@pytest.fixture(params=["standin", "trunc63"])
def dup_corpus(request, real_data, tmp_path):
    """Short web-like documents with exact duplicates (63-token cuts of the shipped texts, 2 exact-duplicate extra
    copies; or the optional trunc63 test split, 2 too) + near copies of 30 Emma/Shakespeare chunks."""
    if request.param == "standin":  # cuts of distinct paragraphs: none is a near copy of another
        web, slack = trunc63_documents(reference_gpt2()), 0
    else:  # a few real web pages are near copies of others (3 of 4,721)
        slack = 5
        lines = request.getfixturevalue("unshipped_data")("corpora/webtext_gpt2_trunc63/webtext.test.jsonl")
        web = [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    docs = [{"text": text, "url": f"web/{i}"} for i, text in enumerate(web)]
    chunks = corpus_chunks(real_data / "corpora")[100:160]
    docs += [{"text": c, "url": f"chunk/{i}"} for i, c in enumerate(chunks)]
    docs += [{"text": near_copy(c), "url": f"near/{i}"} for i, c in enumerate(chunks[:30])]
    return write_jsonl(tmp_path / "docs.jsonl", docs), docs, slack


def test_exact_and_near_duplicates_removed_distinct_kept(dup_corpus, tmp_path):
    src, docs, slack = dup_corpus
    pairs, groups, out = tmp_path / "pairs.jsonl", tmp_path / "groups.jsonl", tmp_path / "dedup.jsonl"
    find_duplicates.main([str(src), "--output", str(pairs), "--workers", "2", "--no-progress"])
    group_duplicates.main([str(pairs), str(groups), "--no-progress"])
    counts = remove_duplicates.main([str(groups), str(src), str(out), "--no-progress"])["counts"]
    kept = [d["url"] for d in read_jsonl(out)]
    texts = [d["text"] for d in read_jsonl(out)]
    assert len(set(texts)) == len(texts)  # every exact duplicate removed, first copy kept
    assert not any(u.startswith("near/") for u in kept)  # every near copy removed
    assert {f"chunk/{i}" for i in range(60)} <= set(kept)  # originals (first in file) survive
    unique = len({d["text"] for d in docs if d["url"].startswith("web/")})
    assert sum(u.startswith("web/") for u in kept) >= unique - slack  # distinct web docs kept
    assert counts["removed:near_duplicate"] == len(docs) - len(kept)
    again = tmp_path / "pairs2.jsonl"
    find_duplicates.main([str(src), "--output", str(again), "--workers", "1", "--no-progress"])
    assert again.read_bytes() == pairs.read_bytes()  # deterministic, independent of --workers


def test_merge_and_shuffle(tmp_path):
    (tmp_path / "d" / "0000").mkdir(parents=True)
    for i in range(50):
        write_jsonl(tmp_path / "d" / "0000" / f"{i:07d}.json", [{"url": f"u{i % 45}", "text": f"doc {i}"}])
    (tmp_path / "d" / "bad.json").write_text("{broken\n")
    counts = merge.main([str(tmp_path / "d"), "--output", str(tmp_path / "m.jsonl"), "--no-progress"])["counts"]
    assert counts == {"files": 51, "kept": 45, "removed:duplicate_url": 5, "removed:bad_json": 1}
    shuffle.main([str(tmp_path / "m.jsonl"), str(tmp_path / "s1.jsonl"), "--no-progress"])
    shuffle.main([str(tmp_path / "m.jsonl"), str(tmp_path / "s2.jsonl"), "--no-progress", "--id-prefix", "owt"])
    assert (tmp_path / "s1.jsonl").read_bytes() == (tmp_path / "s2.jsonl").read_bytes()
    out = read_jsonl(tmp_path / "s1.jsonl")
    assert [d["adlr_id"] for d in out] == [f"owt-{n:010d}" for n in range(1, 46)]
    assert sorted(d["url"] for d in out) == sorted(d["url"] for d in read_jsonl(tmp_path / "m.jsonl"))
    assert [d["url"] for d in out] != [d["url"] for d in read_jsonl(tmp_path / "m.jsonl")]
