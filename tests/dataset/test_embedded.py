"""Embedded offline dataset: stdlib docstrings -> tokenizer -> .bin/.idx, cached and idempotent."""
import json
import os

import numpy as np

from megapar.data.embedded import collect_stdlib_docs, prepare_embedded_dataset
from megapar.data.indexed_dataset import IndexedDataset, validate
from megapar.data.tokenizer import build_tokenizer


def test_collect_is_deterministic_and_bounded():
    a = collect_stdlib_docs(max_bytes=200_000)
    b = collect_stdlib_docs(max_bytes=200_000)
    assert a == b and len(a) > 50
    assert sum(len(d.encode()) for d in a) <= 200_000
    assert len(set(a)) == len(a)
    assert sum(" the " in d for d in a) > len(a) // 3  # English prose


def test_sentencepiece_default_offline_and_cached(tmp_path, capsys):
    info = prepare_embedded_dataset(str(tmp_path), max_bytes=300_000, vocab_size=2000)
    out = capsys.readouterr().out
    assert all(line.startswith("> ") for line in out.strip().splitlines())
    assert info["tokenizer_type"] == "SentencePieceTokenizer" and os.path.isfile(info["tokenizer_model"])
    summary = validate(info["data_prefix"])
    assert summary["num_documents"] == info["num_docs"] and summary["num_tokens"] == info["num_tokens"]
    tok = build_tokenizer(info["tokenizer_type"], tokenizer_model=info["tokenizer_model"])
    assert tok.vocab_size == info["vocab_size"] <= 2000
    ds = IndexedDataset(info["data_prefix"])
    first = json.loads(open(info["corpus"]).readline())["text"]
    assert ds[0][-1] == tok.eod and tok.detokenize(ds[0][:-1]) == first
    mtime = os.path.getmtime(info["data_prefix"] + ".bin")
    again = prepare_embedded_dataset(str(tmp_path), max_bytes=300_000, vocab_size=2000)
    assert again == info and "reusing" in capsys.readouterr().out
    assert os.path.getmtime(info["data_prefix"] + ".bin") == mtime
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_gpt2_when_files_given(tmp_path, gpt2_files):
    info = prepare_embedded_dataset(str(tmp_path), *gpt2_files, max_bytes=100_000)
    assert info["tokenizer_type"] == "GPT2BPETokenizer" and info["vocab_file"] == gpt2_files[0]
    ds = IndexedDataset(info["data_prefix"])
    assert ds.dtype == np.uint16 and ds[0][-1] == 50256
    missing = prepare_embedded_dataset(str(tmp_path / "m"), str(tmp_path / "nope.json"), gpt2_files[1],
                                       max_bytes=100_000, vocab_size=1000)
    assert missing["tokenizer_type"] == "SentencePieceTokenizer"  # falls back when files are absent
