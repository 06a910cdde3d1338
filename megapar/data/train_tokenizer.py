"""Train a SentencePiece BPE model on a user's text, offline and deterministically.

    train_sentencepiece(["corpus.txt"], "out/spm", vocab_size=8000)  # -> "out/spm.model"

Inputs are plain-text files (one sentence/paragraph per line). The model has byte fallback (any
text encodes), unk=0, eos (</s>, the end-of-document token)=1, no bos/pad, and no text
normalisation, so detokenize(tokenize(text)) == text for ordinary text.
"""
from __future__ import annotations

import os
from typing import Sequence

from .tokenizer import TokenizerError


def train_sentencepiece(inputs: Sequence[str], model_prefix: str, vocab_size: int = 8000,
                        model_type: str = "bpe", num_threads: int = 1, quiet: bool = True) -> str:
    """Train and atomically write `model_prefix`.model (+ .vocab); return the .model path."""
    import sentencepiece as spm
    for p in inputs:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"tokenizer training input {p!r} not found")
    tmp_prefix = f"{model_prefix}.tmp{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        _train(spm, inputs, tmp_prefix, vocab_size, model_type, num_threads, quiet)
    except RuntimeError as e:  # sentencepiece's own refusal, e.g. a vocabulary smaller than the characters
        for ext in (".vocab", ".model"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
        reason = str(e).split("] ", 1)[-1].split(" Increase ")[0].strip()   # its own words, not its flags
        raise TokenizerError(f"SentencePiece cannot train on {', '.join(inputs)}: {reason}") from None
    for ext in (".vocab", ".model"):  # .model last: it is what readers look for
        os.replace(tmp_prefix + ext, model_prefix + ext)
    return model_prefix + ".model"


def _train(spm, inputs: Sequence[str], tmp_prefix: str, vocab_size: int, model_type: str, num_threads: int,
           quiet: bool) -> None:
    spm.SentencePieceTrainer.train(
        input=",".join(inputs), model_prefix=tmp_prefix, vocab_size=vocab_size, model_type=model_type,
        character_coverage=1.0, byte_fallback=True, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, input_sentence_size=0, shuffle_input_sentence=False,
        hard_vocab_limit=False, max_sentence_length=1 << 16, num_threads=num_threads, minloglevel=2 if quiet else 0)
