"""GPT dataset: boundaries across documents, determinism, caching, blending, never exhausting, resume."""
import json
import os

import numpy as np
import pytest

from megapar.data.gpt_dataset import (GPTDataset, build_train_valid_test_datasets, parse_data_path,
                                      parse_split, samples_from)
from megapar.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megapar.data.sample_index import build_blending_indices, build_sample_idx

SEQ = 16


def make_dataset(prefix, num_docs=60, seed=0, base=0):
    """Documents whose tokens encode (doc id, position): token = base + 100 * doc + pos % 100."""
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for d in range(num_docs):
        n = int(rng.randint(1, 40))
        b.add_document(base + 100 * d + np.arange(n) % 100)
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def stream(ds: GPTDataset) -> np.ndarray:
    """All tokens of the dataset's documents in doc_idx order."""
    return np.concatenate([ds.indexed.get(int(d)) for d in ds.doc_idx]).astype(np.int64)


def test_parse_split_and_data_path():
    assert parse_split("949,50,1", 1000) == [0, 949, 999, 1000]
    assert parse_split("100,0,0", 7) == [0, 7, 7, 7]
    assert parse_split("2/1", 9) == [0, 6, 9, 9]
    with pytest.raises(ValueError, match="--split"):
        parse_split("a,b", 10)
    assert parse_data_path(["p"]) == (["p"], None)
    assert parse_data_path("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="mixes"):
        parse_data_path(["0.3", "a", "b"])


def test_samples_cross_document_boundaries(tmp_path):
    p = make_dataset(tmp_path / "d")
    train, valid, test = build_train_valid_test_datasets([p], "8,1,1", SEQ, 1234, (200, 10, 10))
    flat = stream(train)
    crossings = 0
    for i in range(len(train)):
        s = train[i]
        j = int(train.shuffle_idx[i])
        assert s.dtype == np.int64 and s.shape == (SEQ + 1,)
        assert np.array_equal(s, flat[j * SEQ:j * SEQ + SEQ + 1])
        crossings += len(set((s // 100).tolist())) > 1
    assert crossings > len(train) // 2
    docs = lambda ds: set(int(d) for d in ds.doc_idx)  # noqa: E731
    assert docs(train) == set(range(48)) and docs(valid) == set(range(48, 54)) and docs(test) == set(range(54, 60))


def test_sample_idx_vectorised_matches_loop():
    rng = np.random.RandomState(3)
    sizes = rng.randint(0, 30, size=500)
    got = build_sample_idx(sizes, 7)
    cum = np.concatenate([[0], np.cumsum(sizes)])
    for j in range(0, got.shape[0], 13):
        d, o = got[j]
        assert cum[d] + o == 7 * j and 0 <= o < sizes[d]


def test_never_exhausts_and_wraps(tmp_path):
    p = make_dataset(tmp_path / "d", num_docs=10)
    one_epoch = (int(IndexedDataset(p).sizes.sum()) - 1) // SEQ
    train, _, _ = build_train_valid_test_datasets([p], "1,0,0", SEQ, 1, (10 * one_epoch, 0, 0))
    assert len(train) >= 10 * one_epoch
    for i in range(len(train) + 50):  # past the end: wraps, never raises
        assert train[i].shape == (SEQ + 1,)
    counts = np.bincount(train.doc_idx, minlength=10)
    assert (counts == counts[0]).all()  # every document equally often (whole epochs)


def test_deterministic_and_cached(tmp_path, capsys):
    p = make_dataset(tmp_path / "d")
    a = build_train_valid_test_datasets([p], "949,50,1", SEQ, 7, (300, 5, 5), cache_dir=str(tmp_path / "c1"))
    b = build_train_valid_test_datasets([p], "949,50,1", SEQ, 7, (300, 5, 5), cache_dir=str(tmp_path / "c2"))
    assert np.array_equal(samples_from(a[0], 0, 100), samples_from(b[0], 0, 100))
    capsys.readouterr()
    c = build_train_valid_test_datasets([p], "949,50,1", SEQ, 7, (300, 5, 5), cache_dir=str(tmp_path / "c1"))
    assert "building" not in capsys.readouterr().out  # reused the cache
    assert np.array_equal(samples_from(a[0], 0, 50), samples_from(c[0], 0, 50))
    d = build_train_valid_test_datasets([p], "949,50,1", SEQ, 8, (300, 5, 5), cache_dir=str(tmp_path / "c1"))
    assert not np.array_equal(samples_from(a[0], 0, 50), samples_from(d[0], 0, 50))  # seed is in the key
    assert not [f for f in os.listdir(tmp_path / "c1") if ".tmp" in f]
    assert len(os.listdir(tmp_path / "c1")) == 12  # 2 seeds x 3 splits x 3 arrays
    default = build_train_valid_test_datasets([p], "1,0,0", SEQ, 7, (10, 0, 0))
    assert default[1] is None and default[2] is None
    cache = tmp_path / "d" / "cache" / "GPTDataset_indices"  # Megatron-Core's default: PREFIX/cache/...
    assert sorted(f.split("_")[-2] for f in os.listdir(cache)) == ["doc", "sample", "shuffle"]
    assert sorted(os.listdir(tmp_path)) == ["c1", "c2", "d", "d.bin", "d.idx"]  # nothing else beside the data


def test_resume_from_consumed_samples(tmp_path):
    p = make_dataset(tmp_path / "d")
    run1, _, _ = build_train_valid_test_datasets([p], "1,0,0", SEQ, 3, (400, 0, 0))
    seen = samples_from(run1, 0, 120)
    run2, _, _ = build_train_valid_test_datasets([p], "1,0,0", SEQ, 3, (400, 0, 0))  # "restarted job"
    assert np.array_equal(samples_from(run2, 100, 20), seen[100:120])


def test_blending_proportions_exact_on_every_prefix():
    w = np.array([0.2, 0.5, 0.3])
    ds_idx, ds_sample = build_blending_indices(w, 10_000)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[ds_idx], axis=0)
    expected = np.outer(np.arange(1, 10_001), w)
    assert np.abs(counts - expected).max() <= 1.0
    for d in range(3):  # each dataset's samples are used in order, once
        assert np.array_equal(ds_sample[ds_idx == d], np.arange((ds_idx == d).sum()))


def test_blended_dataset(tmp_path):
    a = make_dataset(tmp_path / "a", base=0)
    b = make_dataset(tmp_path / "b", seed=1, base=1_000_000)
    train, valid, _ = build_train_valid_test_datasets(["0.25", a, "0.75", b], "90,10,0", SEQ, 5, (400, 40, 0))
    assert len(train) == 400 and len(valid) == 40
    from_b = np.array([train[i][0] >= 1_000_000 for i in range(400)])
    assert from_b.sum() == 300
    assert all(((train[i] >= 1_000_000) == from_b[i]).all() for i in range(400))  # no mixing inside a sample


def _dist_body(rank, world_size, prefix, cache):
    ds, _, _ = build_train_valid_test_datasets([prefix], "1,0,0", SEQ, 11, (200, 0, 0), cache_dir=cache)
    return samples_from(ds, 0, 50)


def test_indices_identical_across_processes(tmp_path):
    from distributed import run_distributed
    p = make_dataset(tmp_path / "d")
    cache = str(tmp_path / "cache")
    results = run_distributed(_dist_body, world_size=2, args=(p, cache))
    local, _, _ = build_train_valid_test_datasets([p], "1,0,0", SEQ, 11, (200, 0, 0), cache_dir=str(tmp_path / "c2"))
    assert np.array_equal(results[0], results[1])
    assert np.array_equal(results[0], samples_from(local, 0, 50))
    assert len([f for f in os.listdir(cache)]) == 3


def test_real_data(tmp_path, real_data, gpt2_files):
    from megapar.data.preprocess import PreprocessConfig, preprocess
    play = (real_data / "corpora" / "tinyshakespeare" / "input.txt").read_text()
    src = tmp_path / "play.jsonl"  # one speech a document
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in play.split("\n\n")))
    preprocess(PreprocessConfig(input=str(src), output_prefix=str(tmp_path / "wt"), vocab_file=gpt2_files[0],
                                merge_file=gpt2_files[1], append_eod=True, quiet=True))
    train, valid, test = build_train_valid_test_datasets([str(tmp_path / "wt_text_document")], "949,50,1",
                                                         1024, 1234, (1000, 10, 10))
    assert len(train) >= 1000 and train[999].shape == (1025,)
    assert (train[0] == 50256).sum() >= 10  # speeches of about 50 tokens: an eod every few dozen tokens
