"""preprocess_data: byte equality with Megatron's outputs, edge documents, errors, atomicity."""
import gzip
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from standin_data import reference_gpt2, trunc63_documents

from megapar.data.indexed_dataset import IndexedDataset, validate
from megapar.data.preprocess import PreprocessConfig, PreprocessError, preprocess

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "preprocess_data.py")


def reference_sha256(source_md: Path) -> dict:
    """{(file stem, ext): sha256} parsed from the corpus' SOURCE.md."""
    text = source_md.read_text()
    out = {}
    for m in re.finditer(r"\| (webtext\.\w+)\.jsonl \| `([0-9a-f]{64})` .*?\| `([0-9a-f]{64})`", text):
        out[(m.group(1), ".bin")], out[(m.group(1), ".idx")] = m.group(2), m.group(3)
    assert len(out) == 4
    return out


def run(tmp_path, gpt2_files, lines_or_path, workers=1, **kw):
    inp = lines_or_path
    if isinstance(lines_or_path, list):
        inp = tmp_path / "in.jsonl"
        inp.write_text("".join(lines_or_path))
    cfg = PreprocessConfig(input=str(inp), output_prefix=str(tmp_path / "out"), vocab_file=gpt2_files[0],
                           merge_file=gpt2_files[1], append_eod=True, workers=workers, quiet=True, **kw)
    return preprocess(cfg), str(tmp_path / "out_text_document")


@pytest.mark.parametrize("stem,workers", [("webtext.test", 1), ("webtext.valid", 2)])
def test_byte_identical_to_megatron(tmp_path, unshipped_data, gpt2_files, stem, workers):
    """Megatron's own outputs are known for this (optional) corpus only; the writer of the stand-in test below
    reproduces them too."""
    ref = reference_sha256(unshipped_data("corpora/webtext_gpt2_trunc63/SOURCE.md"))
    src = unshipped_data(f"corpora/webtext_gpt2_trunc63/{stem}.jsonl")
    _, prefix = run(tmp_path, gpt2_files, src, workers=workers)
    written = megatron_files([json.loads(line)["text"] for line in src.read_text().splitlines()], reference_gpt2())
    for ext, independent in zip((".bin", ".idx"), written):
        assert hashlib.sha256(Path(prefix + ext).read_bytes()).hexdigest() == ref[(stem, ext)]
        assert hashlib.sha256(independent).hexdigest() == ref[(stem, ext)]
    assert validate(prefix)["num_sequences"] == (4723 if stem == "webtext.test" else 4724)


def megatron_files(texts: list[str], encoding) -> tuple[bytes, bytes]:
    """(.bin, .idx) of Megatron's preprocess_data.py --append-eod for these documents, written from tiktoken's
    ids by the format in SPECS.md ("Indexed dataset"): one sequence per document, uint16 ids."""
    seqs = [np.array(encoding.encode_ordinary(t) + [50256], dtype="<u2") for t in texts]
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2]).astype("<i8")
    doc_idx = np.arange(len(seqs) + 1, dtype="<i8")
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(seqs), len(doc_idx))
    idx = header + lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes()
    assert len(idx) == 34 + 12 * len(seqs) + 8 * len(doc_idx)
    return np.concatenate(seqs).tobytes(), idx


@pytest.mark.parametrize("workers", [1, 2])
def test_byte_identical_to_independent_megatron_writer(tmp_path, gpt2_files, workers):
    """63-token documents cut from the shipped corpora (exact duplicates included), against a writer of
    Megatron's format in this file (the Megatron hashes above need the optional corpus)."""
    texts = trunc63_documents(reference_gpt2())
    src = tmp_path / "trunc63.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _, prefix = run(tmp_path, gpt2_files, src, workers=workers)
    ref_bin, ref_idx = megatron_files(texts, reference_gpt2())
    assert Path(prefix + ".bin").read_bytes() == ref_bin
    assert Path(prefix + ".idx").read_bytes() == ref_idx
    assert validate(prefix)["num_sequences"] == len(texts) > 2000


def test_cli_gzip_and_workers_give_identical_bytes(tmp_path, real_data, gpt2_files):
    play = (real_data / "corpora" / "tinyshakespeare" / "input.txt").read_text()[:250_000]
    gz = tmp_path / "test.jsonl.gz"  # one speech a document
    gz.write_bytes(gzip.compress("".join(json.dumps({"text": s}) + "\n" for s in play.split("\n\n")).encode()))
    outs = []
    for w in (1, 3):
        prefix = tmp_path / f"w{w}"
        r = subprocess.run([sys.executable, TOOL, "--input", str(gz), "--output-prefix", str(prefix),
                            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0],
                            "--merge-file", gpt2_files[1], "--append-eod", "--workers", str(w),
                            "--log-interval", "100"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "MB/s" in r.stderr and "ETA" in r.stderr
        outs.append([Path(f"{prefix}_text_document{e}").read_bytes() for e in (".bin", ".idx")])
    assert outs[0] == outs[1]


def test_empty_whitespace_and_literal_eod_documents(tmp_path, gpt2_files):
    docs = ["a", "", "   ", "b<|endoftext|>", "\n"]
    lines = [json.dumps({"text": d}) + "\n" for d in docs] + ["\n", "  \n"]  # blank lines are skipped
    res, prefix = run(tmp_path, gpt2_files, lines)
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 4]  # "" adds a boundary, no sequence
    assert [x.tolist() for x in ds] == [[64, 50256], [220, 220, 220, 50256],
                                       [65, 27, 91, 437, 1659, 5239, 91, 29, 50256], [198, 50256]]
    assert res["text"]["num_docs"] == 5


def test_multiple_json_keys(tmp_path, gpt2_files):
    lines = [json.dumps({"text": "Hello world", "title": "Hi"}) + "\n"]
    res, _ = run(tmp_path, gpt2_files, lines, json_keys=["text", "title"])
    assert IndexedDataset(str(tmp_path / "out_title_document"))[0].tolist() == [17250, 50256]
    assert res["text"]["num_tokens"] == 3


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_line_stops_with_line_number_and_no_outputs(tmp_path, gpt2_files, workers):
    lines = [json.dumps({"text": "fine"}) + "\n"] * 5 + ['{"text": "broken\n'] + [json.dumps({"text": "x"}) + "\n"]
    with pytest.raises(PreprocessError, match=r"in\.jsonl:6: malformed line"):
        run(tmp_path, gpt2_files, lines, workers=workers)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no partial or temporary outputs


def test_missing_key_and_lone_surrogate_are_errors(tmp_path, gpt2_files):
    with pytest.raises(PreprocessError, match=r":2: .*missing key 'text'"):
        run(tmp_path, gpt2_files, ['{"text": "a"}\n', '{"body": "b"}\n'])
    with pytest.raises(PreprocessError, match=r":1: malformed"):
        run(tmp_path, gpt2_files, ['{"text": "a\\ud800b"}\n'])


def test_skip_bad_lines_counts(tmp_path, gpt2_files):
    lines = ['{"text": "a"}\n', "not json\n", '{"text": 5}\n', '{"text": "b"}\n']
    res, prefix = run(tmp_path, gpt2_files, lines, skip_bad_lines=True)
    assert res["bad_lines"] == 2
    assert [x.tolist() for x in IndexedDataset(prefix)] == [[64, 50256], [65, 50256]]


def test_cli_worker_error_fails_fast(tmp_path, gpt2_files):
    inp = tmp_path / "bad.jsonl"
    inp.write_text(json.dumps({"text": "ok " * 50}) + "\n" + "{oops\n")
    r = subprocess.run([sys.executable, TOOL, "--input", str(inp), "--output-prefix", str(tmp_path / "o"),
                        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0],
                        "--merge-file", gpt2_files[1], "--workers", "2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "bad.jsonl:2: malformed line" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]
    r = subprocess.run([sys.executable, TOOL, "--input", str(inp), "--output-prefix", str(tmp_path / "o"),
                        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "missing.json"),
                        "--merge-file", gpt2_files[1]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--vocab-file" in r.stderr and "missing.json" in r.stderr


def test_sentencepiece_tokenizer_uses_uint16(tmp_path):
    from megapar.data.train_tokenizer import train_sentencepiece
    txt = tmp_path / "t.txt"
    txt.write_text("\n".join(f"line {i} of some english text about dogs and cats" for i in range(200)) + "\n")
    model = train_sentencepiece([str(txt)], str(tmp_path / "spm"), vocab_size=300)
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "dogs and cats"}) + "\n")
    cfg = PreprocessConfig(input=str(tmp_path / "in.jsonl"), output_prefix=str(tmp_path / "sp"),
                           tokenizer_type="SentencePieceTokenizer", tokenizer_model=model, append_eod=True,
                           quiet=True)
    preprocess(cfg)
    ds = IndexedDataset(str(tmp_path / "sp_text_document"))
    assert ds.dtype == np.uint16 and ds[0][-1] == 1
