"""LSH banding over on-disk signatures and exact verification of candidate pairs.

Band b of a signature (rows ``b*r .. b*r+r-1``) is hashed to one uint64; documents with equal band keys share a
bucket. Buckets come from an argsort of the N keys per band (O(N log N) time, O(N) memory), never from
pairwise comparison. Each bucket is verified exactly on character 5-gram sets (see ``verify_bucket``).
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .minhash import jaccard, mix64


def band_keys(sig: np.ndarray, band: int, rows: int, block: int = 1 << 18) -> np.ndarray:
    """uint64 key of one band for every row of ``sig`` (a memmap is read in blocks)."""
    keys = np.empty(sig.shape[0], dtype=np.uint64)
    for start in range(0, sig.shape[0], block):
        part = np.asarray(sig[start:start + block, band * rows:(band + 1) * rows], dtype=np.uint64)
        h = np.full(part.shape[0], np.uint64(band + 1), dtype=np.uint64)
        for col in range(rows):
            h = mix64(h ^ part[:, col])
        keys[start:start + block] = h
    return keys


def buckets(keys: np.ndarray) -> Iterator[np.ndarray]:
    """Sorted document indices of every bucket with >= 2 members."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    change = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [len(keys)]))
    for s, e in zip(starts[(ends - starts) >= 2], ends[(ends - starts) >= 2]):
        yield np.sort(order[s:e])


def verify_bucket(members: np.ndarray, ngrams: Callable[[int], np.ndarray], threshold: float, mode: str,
                  max_rounds: int, done: dict[tuple[int, int], float]) -> Iterator[tuple[int, list[tuple[int, float]]]]:
    """Yield (main, [(other, similarity), ...]) for the bucket's similar pairs.

    Round: main = the remaining member earliest in the file; every other remaining member is compared with it;
    those with similarity > ``threshold`` are recorded and leave the bucket; then main leaves. Rounds repeat
    until <= 1 member is left or ``max_rounds`` (-1 = no limit) is reached. Pairs already compared in another
    band (``done``: pair -> similarity) are not compared or reported again (a known-similar one just leaves).
    """
    remaining = [int(m) for m in members]
    rounds = 0
    while len(remaining) > 1 and (max_rounds < 0 or rounds < max_rounds):
        main, rest = remaining[0], remaining[1:]
        hits, keep = [], []
        for other in rest:
            pair = (main, other)
            if pair in done:
                if done[pair] <= threshold:
                    keep.append(other)
                continue
            sim = done[pair] = jaccard(ngrams(main), ngrams(other), mode)
            (hits.append((other, sim)) if sim > threshold else keep.append(other))
        if hits:
            yield main, hits
        remaining = keep
        rounds += 1
