"""Data generated from fixed seeds for tiny training runs that need no external files: GPT-2 BPE files
over the 256 byte tokens (plus 8 merges and <|endoftext|>) and a corpus of random tokens."""
import json
import os

import numpy as np


def byte_gpt2_files(d: str) -> tuple[str, str]:
    """GPT-2 BPE files with the 256 byte tokens, 8 merges and <|endoftext|> (265 tokens)."""
    from megapar.data.tokenizer import _byte_decoder
    chars = sorted(_byte_decoder(), key=lambda c: _byte_decoder()[c])
    merges = [("t", "h"), ("th", "e"), ("a", "n"), ("i", "n"), ("e", "r"), ("o", "n"), ("Ġ", "t"), ("r", "e")]
    encoder = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        encoder[a + b] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    vocab, merge = os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt")
    with open(vocab, "w") as f:
        json.dump(encoder, f)
    with open(merge, "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab, merge


def random_corpus(prefix: str, vocab: int = 265, docs: int = 64) -> None:
    from megapar.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
    rng = np.random.default_rng(7)
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for _ in range(docs):
        builder.add_document(rng.integers(0, vocab, size=int(rng.integers(20, 120))))
    builder.finalize(index_file_path(prefix))
