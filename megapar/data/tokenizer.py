"""Tokenizers: GPT-2 BPE from local files, named tiktoken encodings, SentencePiece.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file="encoder.json", merge_file="vocab.bpe")
    tok.tokenize("Hello world")  # [15496, 995]
    tok.eod                      # 50256

Every tokenizer has `.vocab_size` (true, unpadded), `.eod`, `.tokenize(text) -> list[int]` and
`.detokenize(ids) -> str`.
Text is encoded as ordinary text: a literal "<|endoftext|>" inside a document is NOT the special
token (this matches Megatron's legacy GPT2BPETokenizer).
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "TikTokenizer")
ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer regex (tiktoken's r50k/gpt2 pattern).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(ValueError):
    """A tokenizer could not be built; the message names the file/flag and the fix."""


def _read_text(path: Optional[str], flag: str) -> str:
    """Read a tokenizer file as UTF-8, or raise one clear error naming the file and the flag."""
    if not path:
        raise TokenizerError(f"{flag} is required for this tokenizer type (got none)")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read {flag} {path!r}: {e.strerror or e}; "
                             f"pass an existing, readable file with {flag}") from None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode character -> raw byte map (inverse of bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def gpt2_mergeable_ranks(vocab_file: str, merge_file: str) -> tuple[dict[bytes, int], int]:
    """Build tiktoken ranks from GPT-2 `encoder.json` + `vocab.bpe`.

    Returns (ranks: token bytes -> id, eod id). Like Megatron, the merges are the lines from the
    second to the second-to-last '\\n'-separated line; a token is mergeable only if it is a
    single byte or the result of a listed merge, and its rank is its id in the vocab file.
    """
    vocab_text = _read_text(vocab_file, "--vocab-file")
    merges_text = _read_text(merge_file, "--merge-file")
    try:
        encoder = json.loads(vocab_text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"--vocab-file {vocab_file!r} is not valid JSON ({e}); "
                             "it should be GPT-2's encoder.json / gpt2-vocab.json") from None
    if ENDOFTEXT not in encoder:
        raise TokenizerError(f"--vocab-file {vocab_file!r} has no {ENDOFTEXT} token; "
                             "it should be GPT-2's encoder.json / gpt2-vocab.json")
    dec = _byte_decoder()

    def to_bytes(tok: str) -> bytes:
        return bytes(dec[c] for c in tok)

    ranks = {bytes([b]): encoder[c] for c, b in dec.items()}
    for lineno, line in enumerate(merges_text.split("\n")[1:-1], start=2):
        parts = line.split()
        if len(parts) != 2 or (parts[0] + parts[1]) not in encoder:
            raise TokenizerError(f"--merge-file {merge_file!r} line {lineno} is not a merge of two "
                                 f"tokens in --vocab-file: {line[:80]!r}")
        ranks[to_bytes(parts[0]) + to_bytes(parts[1])] = encoder[parts[0] + parts[1]]
    return ranks, encoder[ENDOFTEXT]


class _TiktokenBase:
    """Shared encode/decode on a tiktoken.Encoding (ordinary text, no special tokens)."""

    def __init__(self, enc, eod: int):
        self.enc = enc
        self.eod = eod
        self.vocab_size = enc.n_vocab

    def tokenize(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))


class GPT2BPETokenizer(_TiktokenBase):
    """GPT-2 byte-level BPE from local --vocab-file/--merge-file, encoded by tiktoken (no network)."""

    def __init__(self, vocab_file: str, merge_file: str):
        import tiktoken
        ranks, eod = gpt2_mergeable_ranks(vocab_file, merge_file)
        enc = tiktoken.Encoding(name=f"gpt2-local:{os.path.basename(vocab_file)}", pat_str=GPT2_PAT_STR,
                                mergeable_ranks=ranks, special_tokens={ENDOFTEXT: eod})
        super().__init__(enc, eod)


class TikTokenizer(_TiktokenBase):
    """A named tiktoken encoding (e.g. "gpt2"), from tiktoken's local cache or the network."""

    def __init__(self, name: str):
        import tiktoken
        try:
            enc = tiktoken.get_encoding(name)
        except Exception as e:  # network errors, unknown names, missing cache
            raise TokenizerError(
                f"cannot load tiktoken encoding {name!r} ({type(e).__name__}: {str(e)[:200]}); it must be "
                "in tiktoken's cache (TIKTOKEN_CACHE_DIR) or downloadable. Offline, use "
                "--tokenizer-type GPT2BPETokenizer --vocab-file encoder.json --merge-file vocab.bpe") from None
        eod = enc.eot_token if ENDOFTEXT in enc.special_tokens_set else enc.n_vocab - 1
        super().__init__(enc, eod)


class SentencePieceTokenizer:
    """A SentencePiece model from --tokenizer-model; eod is its </s> (eos) id."""

    def __init__(self, model_file: str):
        import sentencepiece as spm
        if not model_file or not os.path.isfile(model_file):
            raise TokenizerError(f"--tokenizer-model {model_file!r} does not exist; pass a SentencePiece "
                                 "model file (train one with tools/train_tokenizer.py)")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_file)
        except Exception as e:
            raise TokenizerError(f"--tokenizer-model {model_file!r} is not a SentencePiece model: {e}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(f"--tokenizer-model {model_file!r} has no eos piece; retrain it with eos_id >= 0")

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, tiktoken_name: Optional[str] = None):
    """Build the tokenizer named by --tokenizer-type from its files; see the module docstring."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tiktoken_name or tokenizer_model or "gpt2")
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
