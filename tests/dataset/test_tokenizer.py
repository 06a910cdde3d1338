"""Tokenizers: GPT-2 BPE from local files equals tiktoken's gpt2 encoding on real corpora."""
import json

import pytest
from standin_data import NON_ENGLISH, corpus_documents, trunc63_documents

from megapar.data.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", *gpt2_files)


@pytest.fixture(scope="module")
def reference_encoding(gpt2_files, gpt2):
    """tiktoken's gpt2 encoding, built offline by tiktoken's own loader (not megapar's) from the same files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # read the files as they are; write no cache
        ranks = data_gym_to_mergeable_bpe_ranks(gpt2_files[1], gpt2_files[0])
    return tiktoken.Encoding("gpt2-ref", pat_str=gpt2.enc._pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def test_types_exported():
    assert TOKENIZER_TYPES == ("GPT2BPETokenizer", "SentencePieceTokenizer", "TikTokenizer")


def test_gpt2_basics(gpt2):
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and gpt2.eod == 50256
    assert gpt2.detokenize([15496, 995]) == "Hello world"


def test_literal_endoftext_is_ordinary_text(gpt2):
    assert gpt2.tokenize("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_ids_equal_tiktoken_gpt2_on_real_corpora(real_data, gpt2, reference_encoding):
    corpora = real_data / "corpora"
    texts = [p.read_text() for p in sorted((corpora / "webtext_gpt2_sample").glob("*.txt"))]
    texts.append((corpora / "tinyshakespeare" / "input.txt").read_text())
    texts.append((corpora / "gutenberg_emma" / "austen-emma.txt").read_text())
    for t in texts:
        assert gpt2.tokenize(t) == reference_encoding.encode_ordinary(t)
        assert gpt2.detokenize(gpt2.tokenize(t)) == t
    assert [len(gpt2.tokenize(t)) for t in texts] == [138, 66, 1024, 1024, 161, 1024, 725, 618, 1024, 338025, 223075]


def test_ids_equal_tiktoken_gpt2_on_corpus_documents(gpt2, reference_encoding):
    """The shipped corpora cut into 9,602 documents (web pages, paragraphs, speeches), 63-token cuts of them as
    the optional trunc63 corpus has, and texts in German, French and Spanish."""
    cuts = trunc63_documents(reference_encoding)
    texts = corpus_documents() + cuts + NON_ENGLISH
    assert len(texts) > 12_000
    for t in texts:
        assert gpt2.tokenize(t) == reference_encoding.encode_ordinary(t)
        assert gpt2.detokenize(gpt2.tokenize(t)) == t
    assert all(len(gpt2.tokenize(t)) == 63 for t in cuts)


def test_ids_equal_tiktoken_gpt2_on_webtext_trunc63(unshipped_data, gpt2, reference_encoding):
    """9,447 more web documents, a few of them not English (optional data)."""
    texts = []
    for name in ("webtext.test.jsonl", "webtext.valid.jsonl"):
        with open(unshipped_data(f"corpora/webtext_gpt2_trunc63/{name}")) as f:
            texts += [json.loads(line)["text"] for line in f]
    for t in texts:
        assert gpt2.tokenize(t) == reference_encoding.encode_ordinary(t)
    assert all(gpt2.detokenize(gpt2.tokenize(t)) == t for t in texts[:500])
    assert all(len(gpt2.tokenize(t)) == 63 for t in texts[:100])  # the corpus' own invariant


def test_missing_vocab_file_names_file_and_flag(tmp_path, gpt2_files):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match=r"--vocab-file.*nope\.json"):
        build_tokenizer("GPT2BPETokenizer", missing, gpt2_files[1])
    with pytest.raises(TokenizerError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", gpt2_files[0], None)


def test_unknown_type_and_bad_tiktoken_name():
    with pytest.raises(TokenizerError, match="unknown --tokenizer-type"):
        build_tokenizer("BertWordPiece")
    with pytest.raises(TokenizerError, match="--vocab-file"):
        build_tokenizer("TikTokenizer", tiktoken_name="no_such_encoding_xyz")


def test_sentencepiece_train_and_roundtrip(tmp_path):
    from megapar.data.train_tokenizer import train_sentencepiece
    text = tmp_path / "t.txt"
    lines = [f"The quick brown fox {i} jumps over the lazy dog number {i * 7}." for i in range(300)]
    text.write_text("\n".join(lines) + "\n")
    model = train_sentencepiece([str(text)], str(tmp_path / "spm"), vocab_size=400)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert 300 <= tok.vocab_size <= 400 and tok.eod == 1
    s = "Hello  world,\n  ünïcödé 😀 tabs\there"
    assert tok.detokenize(tok.tokenize(s)) == s
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "missing.model"))
