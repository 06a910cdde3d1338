"""GPT pretraining datasets over `.bin/.idx` data: splits, epochs, shuffling, blending, caching.

    train, valid, test = build_train_valid_test_datasets(
        ["0.7", "owt_text_document", "0.3", "wiki_text_document"], "949,50,1",
        seq_length=1024, seed=1234, train_valid_test_num_samples=(800_000, 8_000, 800))
    train[consumed_samples + k]   # np.int64 array of seq_length + 1 tokens

`--split 949,50,1` splits each dataset's documents into contiguous ranges. A dataset is a
deterministic map index -> sample that holds at least the requested number of samples; indexing
past len() wraps around, so training never runs out of data, and resuming at consumed_samples
gives exactly the next samples. Indices are cached as .npy in cache_dir (--data-cache-path) or, as
Megatron-Core does without it, in PREFIX/cache/GPTDataset_indices/ (a folder named like the data
prefix, beside its .bin/.idx), named by a hash of every input that changes them; with
torch.distributed initialised, global rank 0 builds them while the other ranks wait at a barrier.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
from typing import Optional, Sequence

import numpy as np

from ..atomic import atomic_write
from ..errors import MegaparError, size_text
from .indexed_dataset import (DatasetNotFoundError, IndexedDataset, IndexedDatasetError, data_file_path,
                              index_file_path)
from .sample_index import build_blending_indices, build_indices

INDEX_VERSION = 1  # bump when the index algorithm changes
START_SAMPLE_TOKENS = 1 << 20  # token ids read per --data-path file at training start (check_token_ids)


class DatasetError(MegaparError, ValueError):
    """The training data cannot be used as given (empty corpus, empty training split); the
    message names the prefix or flag and the fix."""


def _log(msg: str) -> None:
    if _dist_rank()[1] == 0:  # once per job, not once per rank
        print(f" > {msg}", flush=True)


def parse_split(split: str, size: int) -> list[int]:
    """'949,50,1' (or '949/50/1') -> 4 document boundaries [0, a, b, size] (Megatron's rounding)."""
    msg = f"--split {split!r} must be up to 3 non-negative numbers with a positive sum, e.g. 949,50,1"
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        raise DatasetError(msg) from None
    if not parts or any(p < 0 for p in parts) or sum(parts) <= 0 or len(parts) > 3:
        raise DatasetError(msg)
    parts = (parts + [0.0, 0.0])[:3]
    total = sum(parts)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / total * float(size))))
    diff = bounds[-1] - size
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def parse_data_path(data_path: Sequence[str] | str) -> tuple[list[str], Optional[list[float]]]:
    """[PREFIX] | [W1, P1, W2, P2, ...] | [P1, P2, ...] -> (prefixes, weights or None)."""
    items = data_path.split() if isinstance(data_path, str) else list(data_path)
    if not items:
        raise DatasetError("--data-path is empty; pass PREFIX or W1 PREFIX1 W2 PREFIX2 ...")

    def is_num(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False
    if len(items) % 2 == 0 and all(is_num(w) for w in items[0::2]):
        for w, prefix in zip(items[0::2], items[1::2]):
            if not (math.isfinite(float(w)) and float(w) > 0):
                raise DatasetError(f"--data-path weight {w} of {prefix} must be a positive number (the weights are "
                                   f"relative shares of the blend); drop the prefix to leave it out")
        return items[1::2], [float(w) for w in items[0::2]]
    if any(is_num(s) for s in items):
        raise DatasetError(f"--data-path {items} mixes weights and prefixes; use W1 PREFIX1 W2 PREFIX2 ...")
    return items, None


# ---- cache -----------------------------------------------------------------------------------
def _dist_rank() -> tuple[bool, int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return True, dist.get_rank()
    except ImportError:
        pass
    return False, 0


def check_cache_dir(cache_dir: Optional[str]) -> None:
    """A --data-cache-path that is given must be a folder this process can write into (found at
    start by writing a file there, not from permission bits); DatasetError otherwise. Without the
    flag, indices are cached in default_cache_dir, or in the temporary folder when that is read-only."""
    if cache_dir is None:
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".megapar_write_check_", dir=cache_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise DatasetError(f"--data-cache-path {cache_dir} is not a writable folder ({e.strerror or e}); the dataset "
                           f"indices are cached there: give a writable folder, or drop --data-cache-path to cache "
                           f"them in PREFIX/cache/GPTDataset_indices beside the data") from None


def default_cache_dir(prefix: str) -> str:
    """Where the indices of data PREFIX are cached without --data-cache-path: Megatron-Core's
    PREFIX/cache/GPTDataset_indices, so a run leaves one folder beside PREFIX.bin/.idx."""
    return os.path.join(os.path.abspath(prefix), "cache", "GPTDataset_indices")


def _cache_dir(prefix: str, cache_dir: Optional[str]) -> str:
    d = cache_dir or default_cache_dir(prefix)
    try:
        os.makedirs(d, exist_ok=True)
        writable = os.access(d, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        alt = os.path.join(tempfile.gettempdir(), "megapar_index_cache")
        _log(f"{d} is not writable; caching dataset indices in {alt} (--data-cache-path chooses the folder)")
        os.makedirs(alt, exist_ok=True)
        return alt
    return d


def _save_atomic(path: str, arr: np.ndarray) -> None:
    with atomic_write(path, "wb") as f:
        np.save(f, arr)


def _cached_indices(indexed: IndexedDataset, name: str, lo: int, hi: int, num_samples: int,
                    seq_length: int, seed: int, cache_dir: Optional[str]) -> tuple[np.ndarray, ...]:
    """Load (doc_idx, sample_idx, shuffle_idx) from the cache, building them first if needed
    (by global rank 0 only when torch.distributed is initialised)."""
    sizes = indexed.sequence_lengths
    h = hashlib.sha256(json.dumps([INDEX_VERSION, lo, hi, int(num_samples), seq_length, seed]).encode())
    h.update(np.ascontiguousarray(sizes[lo:hi]).tobytes())
    key = h.hexdigest()[:16]
    base = os.path.join(_cache_dir(indexed.prefix, cache_dir), f"{os.path.basename(indexed.prefix)}_{name}_{key}")
    paths = [f"{base}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")]

    def build() -> None:
        _log(f"building {name} indices for {indexed.prefix} (documents [{lo}, {hi}), {num_samples} samples, "
             f"seq_length {seq_length}, seed {seed})")
        arrays = build_indices(np.arange(lo, hi, dtype=np.int64), sizes, seq_length, num_samples, seed)
        try:
            for p, a in zip(paths, arrays):
                _save_atomic(p, a)
        except OSError as e:  # a full disk, a file-size limit: none of the three is left half a set
            for p in paths:
                with contextlib.suppress(OSError):
                    os.unlink(p)
            need = sum(a.nbytes for a in arrays)
            why = e.strerror or "a write was cut short: the disk is full or a file-size limit was reached"  # numpy's
            raise DatasetError(f"cannot write the dataset indices into {os.path.dirname(base)} ({why}; they need "
                               f"about {size_text(need)}): free space there, or give --data-cache-path a folder "
                               f"with room") from None

    is_dist, rank = _dist_rank()
    if rank == 0 and not all(os.path.isfile(p) for p in paths):
        build()
    if is_dist:
        import torch.distributed as dist
        dist.barrier()
        if not all(os.path.isfile(p) for p in paths):  # cache not on a shared filesystem
            build()
    return tuple(np.load(p, mmap_mode="r") for p in paths)


# ---- datasets --------------------------------------------------------------------------------
class GPTDataset:
    """Samples of seq_length + 1 tokens from documents [lo, hi) of one indexed dataset."""

    def __init__(self, indexed: IndexedDataset, name: str, lo: int, hi: int, num_samples: int,
                 seq_length: int, seed: int, cache_dir: Optional[str] = None, vocab_size: Optional[int] = None):
        self.indexed, self.name, self.seq_length, self.vocab_size = indexed, name, seq_length, vocab_size
        self.doc_idx, self.sample_idx, self.shuffle_idx = _cached_indices(
            indexed, name, lo, hi, num_samples, seq_length, seed, cache_dir)

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, idx: int) -> np.ndarray:
        j = int(self.shuffle_idx[int(idx) % len(self)])
        d0, o0 = (int(x) for x in self.sample_idx[j])
        d1, o1 = (int(x) for x in self.sample_idx[j + 1])
        get, docs = self.indexed.get, self.doc_idx
        if d0 == d1:
            parts = [get(int(docs[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(docs[d0]), o0)] + [get(int(docs[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(docs[d1]), 0, o1 + 1))
        sample = np.concatenate(parts).astype(np.int64)
        if self.vocab_size is not None:
            self._check_ids(sample, d0, d1)
        return sample

    def _check_ids(self, sample: np.ndarray, d0: int, d1: int) -> None:
        """Every id of `sample` indexes a row of the embedding table. The start check (check_token_ids)
        reads only windows of a large .bin; this covers every sample trained on, at the cost of a max
        and a min per sample, and names the file where the embedding lookup would only say IndexError."""
        hi, lo = int(sample.max()), int(sample.min())
        if hi < self.vocab_size and lo >= 0:
            return
        p, v = self.indexed.prefix, self.vocab_size
        docs = f"document {int(self.doc_idx[d0])}" + (f" to {int(self.doc_idx[d1])}" if d1 != d0 else "")
        raise IndexedDatasetError(
            f"--data-path {p}: token id {hi if hi >= v else lo} in {docs} ({self.name} split) is outside the "
            f"tokenizer's vocabulary of {v} ids: this .bin was made with another tokenizer (or is damaged); re-run "
            f"tools/preprocess_data.py with this run's tokenizer files, or train with the tokenizer that made it "
            f"(python -m megapar.data.validate {p} --vocab-size {v} finds every such id)")


class BlendedDataset:
    """Datasets mixed by weights: sample i comes from dataset_index[i] (prefix-exact proportions)."""

    def __init__(self, datasets: list, weights: Sequence[float], num_samples: int):
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = build_blending_indices(np.asarray(weights), num_samples)

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> np.ndarray:
        i = int(idx) % len(self)
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def _epoch_samples(indexed: IndexedDataset, lo: int, hi: int, seq_length: int) -> int:
    return max(int((int(indexed.sequence_lengths[lo:hi].sum(dtype=np.int64)) - 1) // seq_length), 0)


def _build_split(sets: list[IndexedDataset], weights: Optional[list[float]], bounds: list[tuple[int, int]],
                 name: str, num_samples: int, seq_length: int, seed: int, cache_dir: Optional[str],
                 vocab_size: Optional[int] = None):
    """One split over one or more datasets (None if the split is empty everywhere)."""
    live = [i for i, (lo, hi) in enumerate(bounds) if hi > lo and _epoch_samples(sets[i], lo, hi, seq_length) > 0]
    if not live:
        return None
    if len(sets) == 1:
        (lo, hi), = bounds
        return GPTDataset(sets[0], name, lo, hi, num_samples, seq_length, seed, cache_dir, vocab_size)
    if weights is None:  # blend by size
        w = np.array([float(sets[i].sequence_lengths[slice(*bounds[i])].sum(dtype=np.int64)) for i in live])
    else:
        w = np.array([weights[i] for i in live])
    n = num_samples if num_samples > 0 else sum(_epoch_samples(sets[i], *bounds[i], seq_length) for i in live)
    blend = BlendedDataset([], w, n)
    counts = np.bincount(blend.dataset_index, minlength=len(live))
    blend.datasets = [GPTDataset(sets[i], name, *bounds[i], int(max(counts[j], 1)), seq_length, seed, cache_dir,
                                 vocab_size) for j, i in enumerate(live)]
    return blend


def check_datasets(data_path: Sequence[str] | str) -> list[dict]:
    """Check every --data-path pair before training, without reading any token: the .idx header
    and size, lengths, pointers monotonic and consistent, document index, the .bin size the index
    implies (megapar.data.validate), and that the corpus is not empty. Raises IndexedDatasetError
    or DatasetError, one line naming the prefix and the problem; returns the validate() summaries."""
    from .validate import validate
    prefixes, _ = parse_data_path(data_path)
    out = []
    for p in prefixes:
        try:
            summary = validate(p)
        except DatasetNotFoundError as e:
            raise DatasetNotFoundError(f"--data-path {p}: {e}") from None
        except IndexedDatasetError as e:
            raise IndexedDatasetError(f"--data-path {p}: {e}; rebuild the pair with "
                                      "tools/preprocess_data.py (check it: python -m megapar.data.validate "
                                      f"{p})") from None
        if summary["num_tokens"] == 0:
            raise DatasetError(f"--data-path {p}: empty corpus ({summary['num_documents']} documents, 0 tokens); "
                               "preprocess a non-empty input or drop this prefix")
        out.append(summary)
    return out


BIN_SAMPLES, BIN_SAMPLE_BYTES = 64, 1 << 16  # fingerprint(): evenly spaced blocks of the .bin that are hashed


def fingerprint(data_path: Sequence[str] | str, hash_files: bool = True) -> list[tuple]:
    """What this rank reads for each --data-path prefix: (prefix, .idx size, .bin size, sha256 of the
    .idx and of BIN_SAMPLES evenly spaced blocks of the .bin -- or None without `hash_files`, for a
    rank whose host's first rank hashes the same files). The .idx holds every document's length and
    offset, so two copies made apart differ there; the sampled .bin blocks catch copies of one index
    whose tokens differ, without reading the whole corpus at every start. An unreadable file gives
    (prefix, its error)."""
    out: list[tuple] = []
    for p in parse_data_path(data_path)[0]:
        idx, data = index_file_path(p), data_file_path(p)
        try:
            sizes = (os.path.getsize(idx), os.path.getsize(data))
            out.append((p, *sizes, _digest(idx, data, sizes[1]) if hash_files else None))
        except OSError as e:
            out.append((p, f"cannot read {e.filename or p}: {e.strerror or e}"))
    return out


def _digest(idx: str, data: str, bin_size: int) -> str:
    h = hashlib.sha256()
    with open(idx, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    with open(data, "rb") as f:
        for start in np.linspace(0, max(bin_size - BIN_SAMPLE_BYTES, 0), BIN_SAMPLES).astype(np.int64):
            f.seek(int(start))
            h.update(f.read(BIN_SAMPLE_BYTES))
    return h.hexdigest()


def check_same_data(prints: Sequence[tuple[str, list]]) -> None:
    """Every rank reads the same data: `prints` holds each rank's (host, fingerprint()), in rank order.
    Ranks that read different copies (node-local files that differ) would train on mismatched tokens
    without a sign; DatasetError names the first rank and file that differ from rank 0's, in one line."""
    host0, ref = prints[0]
    fix = ("the ranks would train on different tokens; give every node the same files (copy them from one place, "
           "compare with sha256sum) or put them on a shared file system")
    for rank, (host, mine) in enumerate(prints):
        for entry, entry0 in zip(mine, ref):
            p, where = entry[0], f"rank {rank} (host {host})"
            if len(entry) == 2 or len(entry0) == 2:
                bad, why = (where, entry[1]) if len(entry) == 2 else (f"rank 0 (host {host0})", entry0[1])
                raise DatasetError(f"--data-path {p}: {bad} {why}; every rank reads the same files: copy them "
                                   f"there or put them on a shared file system")
            (_, idx_size, bin_size, digest), (_, idx_size0, bin_size0, digest0) = entry, entry0
            if idx_size != idx_size0:
                diff = f"{index_file_path(p)} of {idx_size} bytes, rank 0 (host {host0}) one of {idx_size0} bytes"
            elif bin_size != bin_size0:
                diff = f"{data_file_path(p)} of {bin_size} bytes, rank 0 (host {host0}) one of {bin_size0} bytes"
            elif None not in (digest, digest0) and digest != digest0:
                diff = (f"{index_file_path(p)} and {data_file_path(p)} of the same sizes as rank 0's (host {host0}) "
                        f"but other contents (sha256 {digest[:12]} vs {digest0[:12]})")
            else:
                continue
            raise DatasetError(f"--data-path {p}: {where} reads {diff}: {fix}")


def check_token_ids(data_path: Sequence[str] | str, vocab_size: int, sample_tokens: int = START_SAMPLE_TOKENS) -> None:
    """At training start: a sample of about `sample_tokens` token ids of each --data-path .bin is
    below the tokenizer's `vocab_size` (a larger id would index past the embedding table mid-run).
    IndexedDatasetError naming the file, the id and the fix."""
    from .validate import check_token_ids as check
    prefixes, _ = parse_data_path(data_path)
    for p in prefixes:
        try:
            ids = check(p, vocab_size, sample_tokens)
        except IndexedDatasetError as e:
            raise IndexedDatasetError(f"--data-path {p}: {e} (a sampled check at start; python -m "
                                      f"megapar.data.validate {p} --vocab-size {vocab_size} reads every token)"
                                      ) from None
        _log(f"token ids of {p} < {vocab_size}: {ids['mode']} check ({ids['checked']} of {ids['tokens']} tokens)")


def _check_splits(out: list, split: str, seq_length: int, num_samples: tuple[int, int, int]) -> None:
    """An empty training split is an error; an empty validation split while evaluation is asked
    for is a warning (printed once, rank 0)."""
    if out[0] is None and num_samples[0] > 0:
        raise DatasetError(f"--split {split!r} leaves no training sample of --seq-length {seq_length} "
                           "(the training documents hold fewer than seq_length + 1 tokens); give training a "
                           "larger share or use more data")
    if out[1] is None and num_samples[1] > 0 and _dist_rank()[1] == 0:
        print(f"warning: --split {split!r} leaves no validation sample of --seq-length {seq_length}: "
              "evaluation is skipped (give validation a share, e.g. --split 949,50,1, or set --eval-iters 0)",
              file=sys.stderr, flush=True)


def build_train_valid_test_datasets(data_path: Sequence[str] | str, split: str, seq_length: int, seed: int,
                                    train_valid_test_num_samples: tuple[int, int, int],
                                    cache_dir: Optional[str] = None, vocab_size: Optional[int] = None):
    """(train, valid, test) datasets (None for an empty split); see the module docstring. Training
    checks every pair first (check_datasets, at the start of pretrain). With `vocab_size`, reading a
    sample with a token id outside [0, vocab_size) raises IndexedDatasetError naming the prefix."""
    prefixes, weights = parse_data_path(data_path)
    sets = [IndexedDataset(p) for p in prefixes]
    splits = [parse_split(split, len(ds)) for ds in sets]
    out = []
    for s, name in enumerate(("train", "valid", "test")):
        bounds = [(b[s], b[s + 1]) for b in splits]
        out.append(_build_split(sets, weights, bounds, name, int(train_valid_test_num_samples[s]),
                                seq_length, seed, cache_dir, vocab_size))
    for name, ds in zip(("train", "valid", "test"), out):
        _log(f"{name}: {len(ds) if ds is not None else 0} samples")
    _check_splits(out, split, seq_length, train_valid_test_num_samples)
    return tuple(out)


def samples_from(dataset, consumed_samples: int, count: int) -> np.ndarray:
    """[count, seq_length + 1] int64: the samples the run sees after `consumed_samples` (resume)."""
    return np.stack([dataset[consumed_samples + k] for k in range(count)])


if __name__ == "__main__":  # quick look: python -m megapar.data.gpt_dataset PREFIX
    if sys.argv[1:2] in (["-h"], ["--help"]) or len(sys.argv) < 2:
        print("usage: python -m megapar.data.gpt_dataset PREFIX [PREFIX...]\n"
              "Builds the train split (949,50,1; seq 128, seed 1234) of the .bin/.idx data at PREFIX and prints its "
              "length and first tokens.")
        sys.exit(0 if len(sys.argv) > 1 else 2)
    tr, _, _ = build_train_valid_test_datasets(sys.argv[1:], "949,50,1", 128, 1234, (100, 10, 10))
    print(len(tr), tr[0][:16])
