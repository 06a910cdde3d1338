"""Vectorised GPT sampling indices (document / sample / shuffle) and the blending index.

For the documents `docs` (sequence ids of one split) with token counts `sizes`:
  doc_idx     one random permutation of `docs` per epoch, concatenated (epochs enough for
              `num_samples` samples, so training never runs out of data)
  sample_idx  [S+1, 2] (position in doc_idx, token offset) of each sample boundary. Sample j covers
              global tokens [j*L, (j+1)*L] inclusive (L = seq_length, so L+1 tokens; consecutive
              samples share one token, as in Megatron), crossing document boundaries.
  shuffle_idx a random permutation of the S samples.
Everything is numpy (permutation, cumsum, searchsorted): seconds for billions of tokens
(docs/benchmarks/data_cpu_20261124.md#data).
"""
from __future__ import annotations

import numpy as np


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs with (epochs * tokens - 1) // seq_length >= num_samples."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; use more data or a different --split")
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_doc_idx(docs: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """One shuffled copy of `docs` per epoch, concatenated (int32 when the ids fit)."""
    dtype = np.int32 if docs.size == 0 or docs.max() < 2**31 - 1 else np.int64
    out = np.empty(docs.size * num_epochs, dtype=dtype)
    for e in range(num_epochs):
        out[e * docs.size:(e + 1) * docs.size] = rng.permutation(docs)
    return out


def build_sample_idx(doc_sizes: np.ndarray, seq_length: int) -> np.ndarray:
    """Sample boundaries over documents of `doc_sizes` (in doc_idx order): [S+1, 2] int array of
    (doc position, offset), S = (total_tokens - 1) // seq_length."""
    cum = np.zeros(doc_sizes.size + 1, dtype=np.int64)
    np.cumsum(doc_sizes, dtype=np.int64, out=cum[1:])
    num_samples = int((cum[-1] - 1) // seq_length)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(cum, starts, side="right") - 1  # last doc starting at or before the token
    big = doc_sizes.size >= 2**31 - 1 or (doc_sizes.size and int(doc_sizes.max()) >= 2**31 - 1)
    out = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    out[:, 0] = pos
    out[:, 1] = starts - cum[pos]
    return out


def build_shuffle_idx(num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.int32 if num_samples < 2**31 - 1 else np.int64
    return rng.permutation(num_samples).astype(dtype, copy=False)


def build_indices(docs: np.ndarray, sizes: np.ndarray, seq_length: int, num_samples: int,
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for sequence ids `docs` with token counts `sizes`
    (indexed by sequence id). num_samples <= 0 means one epoch. Deterministic in `seed`."""
    tokens_per_epoch = int(sizes[docs].sum(dtype=np.int64))
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, max(int(num_samples), 1))
    rng = np.random.RandomState(seed % 2**32)
    doc_idx = build_doc_idx(docs, epochs, rng)
    sample_idx = build_sample_idx(sizes[doc_idx], seq_length)
    shuffle_idx = build_shuffle_idx(sample_idx.shape[0] - 1, np.random.RandomState((seed + 1) % 2**32))
    return doc_idx, sample_idx, shuffle_idx


def build_blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Interleave datasets so that every prefix of the output follows `weights` as closely as
    possible (each dataset d is due at times (k + 0.5) / w_d; outputs are taken in time order).
    Returns (dataset_index [N] int16, dataset_sample_index [N] int64)."""
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be >= 0 with a positive sum, got {list(weights)}")
    w = w / w.sum()
    times, ids, ks = [], [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        k = np.arange(int(np.ceil(wd * num_samples)) + 1, dtype=np.int64)
        times.append((k + 0.5) / wd)
        ids.append(np.full(k.size, d, dtype=np.int16))
        ks.append(k)
    order = np.argsort(np.concatenate(times), kind="stable")[:num_samples]
    return np.concatenate(ids)[order], np.concatenate(ks)[order]
