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

import collections
import json
import os
from typing import Optional, Sequence

from ..errors import MegaparError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "TikTokenizer")
ENDOFTEXT = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257   # GPT-2's BPE vocabulary: what the estimator and the planner assume by default
# GPT-2's pre-tokenizer regex (tiktoken's r50k/gpt2 pattern).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(MegaparError, ValueError):
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


def _load_vocab(vocab_file: str) -> dict[str, int]:
    """--vocab-file as a JSON object token -> unique non-negative int id, with every byte token
    and <|endoftext|>; raise TokenizerError naming the file and what is wrong otherwise."""
    hint = "it should be GPT-2's encoder.json / gpt2-vocab.json"
    try:
        encoder = json.loads(_read_text(vocab_file, "--vocab-file"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"--vocab-file {vocab_file!r} is not valid JSON ({e}); {hint}") from None
    if not isinstance(encoder, dict):
        raise TokenizerError(f"--vocab-file {vocab_file!r} is a JSON {type(encoder).__name__}, not an object "
                             f"mapping token -> id; {hint}")
    bad = next(((k, v) for k, v in encoder.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0), None)
    if bad is not None:
        raise TokenizerError(f"--vocab-file {vocab_file!r} maps {bad[0]!r} to {bad[1]!r}, not a non-negative "
                             f"integer id; {hint}")
    if len(set(encoder.values())) != len(encoder):
        dup = collections.Counter(encoder.values()).most_common(1)[0][0]
        raise TokenizerError(f"--vocab-file {vocab_file!r} gives id {dup} to more than one token "
                             f"(ids must be unique); {hint}")
    if ENDOFTEXT not in encoder:
        raise TokenizerError(f"--vocab-file {vocab_file!r} has no {ENDOFTEXT} token; {hint}")
    missing = [c for c in _byte_decoder() if c not in encoder]
    if missing:
        raise TokenizerError(f"--vocab-file {vocab_file!r} lacks {len(missing)} of the 256 byte-level tokens "
                             f"(e.g. {missing[0]!r}); {hint}")
    return encoder


def _merge_lines(merge_file: str) -> list[tuple[int, str]]:
    """(line number, line) of the merges in --merge-file. Like Megatron, the first line (the
    `#version` header) and the last '\\n'-separated piece are dropped; a first line that is neither
    a `#` comment nor a pair means the file is not a merges file (e.g. encoder.json), an error."""
    text = _read_text(merge_file, "--merge-file")
    lines = text.split("\n")
    first = lines[0]
    if not first.strip():
        raise TokenizerError(f"--merge-file {merge_file!r} is empty or starts with a blank line; it should be "
                             "GPT-2's vocab.bpe / gpt2-merges.txt ('#version: 0.2' then one 'a b' pair a line)")
    if not first.startswith("#") and len(first.split()) != 2:
        raise TokenizerError(f"--merge-file {merge_file!r} is not a BPE merges file: line 1 is neither a "
                             f"'#version' header nor a pair of tokens ({first[:60]!r}); it should be GPT-2's "
                             "vocab.bpe / gpt2-merges.txt (did you swap --vocab-file and --merge-file?)")
    return list(enumerate(lines[1:-1], start=2))


def gpt2_mergeable_ranks(vocab_file: str, merge_file: str) -> tuple[dict[bytes, int], int]:
    """Build tiktoken ranks from GPT-2 `encoder.json` + `vocab.bpe`.

    Returns (ranks: token bytes -> id, eod id). Like Megatron, the merges are the lines from the
    second to the second-to-last '\\n'-separated line; a token is mergeable only if it is a
    single byte or the result of a listed merge, and its rank is its id in the vocab file.
    Both files are checked (format, unique ids, every merge result in the vocab) and a mismatch
    raises TokenizerError naming the file and flag.
    """
    encoder = _load_vocab(vocab_file)
    merges = _merge_lines(merge_file)
    dec = _byte_decoder()
    ranks = {bytes([b]): encoder[c] for c, b in dec.items()}
    for lineno, line in merges:
        parts = line.split()
        if len(parts) != 2 or (parts[0] + parts[1]) not in encoder:
            raise TokenizerError(f"--merge-file {merge_file!r} line {lineno} is not a merge of two "
                                 f"tokens in --vocab-file {vocab_file!r}: {line[:80]!r}; the two files must "
                                 "come from the same tokenizer")
        try:
            ranks[bytes(dec[c] for c in parts[0] + parts[1])] = encoder[parts[0] + parts[1]]
        except KeyError as e:
            raise TokenizerError(f"--merge-file {merge_file!r} line {lineno} has the character {e.args[0]!r}, "
                                 "which is not a GPT-2 byte-level character; it should be GPT-2's vocab.bpe") from None
    if not merges and len(encoder) > 257:
        raise TokenizerError(f"--merge-file {merge_file!r} has no merges but --vocab-file {vocab_file!r} has "
                             f"{len(encoder)} tokens: tokenization would be character-level; pass the merges "
                             "file that belongs to the vocabulary")
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
