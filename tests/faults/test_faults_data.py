"""Fault injection for tokenizer files and .bin/.idx data: real files, real processes, on CPU.

Each case runs `tools/preprocess_data.py` or `python -m megapar.pretrain_gpt2` (1 layer, 1 step)
on a broken input and checks with `refused` that it stops before doing any work, with one
`error:` line naming the file and the problem, and leaves every file as it was.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness import ROOT, ROWS, Row, refused, run

sys.path.insert(0, str(ROOT / "tests"))
from synthetic_data import byte_gpt2_files, random_corpus  # noqa: E402

TRAIN = ["python", "-m", "megapar.pretrain_gpt2", "--num-layers", "1", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1",
         "--split", "1,0,0", "--make-vocab-size-divisible-by", "32", "--attention-backend", "torch",
         "--tokenizer-type", "GPT2BPETokenizer"]
PREPROCESS = ["python", "tools/preprocess_data.py", "--tokenizer-type", "GPT2BPETokenizer", "--append-eod"]


@pytest.fixture
def files(tmp_path) -> dict:
    """A byte-level GPT-2 vocabulary, a random corpus of it, and a small JSON-lines input."""
    vocab, merges = byte_gpt2_files(str(tmp_path))
    random_corpus(str(tmp_path / "corpus"))
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"the other {i} then"}) + "\n" for i in range(20)))
    return {"vocab": vocab, "merges": merges, "prefix": str(tmp_path / "corpus"), "jsonl": str(jsonl)}


def train_cmd(files: dict, prefix: str | None = None, vocab: str | None = None, merges: str | None = None) -> list:
    return TRAIN + ["--data-path", prefix or files["prefix"], "--vocab-file", vocab or files["vocab"],
                    "--merge-file", merges or files["merges"]]


def preprocess_cmd(files: dict, out: Path, inp: str | None = None, vocab: str | None = None,
                   merges: str | None = None) -> list:
    return PREPROCESS + ["--input", inp or files["jsonl"], "--output-prefix", str(out),
                         "--vocab-file", vocab or files["vocab"], "--merge-file", merges or files["merges"]]


def test_training_on_good_files_runs(files, tmp_path):
    """The control: the same command with intact files trains (the cases below differ in one file)."""
    out = run(train_cmd(files))
    assert out.rc == 0, out.output[-3000:]
    assert "warning:" not in out.output


def test_a_start_that_fails_leaves_no_empty_save_folder(files, tmp_path):
    """A run refused after it took its --save folder (a missing dataset) removes the folder it made."""
    refused(train_cmd(files, prefix=str(tmp_path / "missing")) + ["--save", tmp_path / "new_save"],
            fault_class="data files", case="missing dataset with a new --save folder", expect="not found",
            watch=[tmp_path], allow_new=[])
    assert not (tmp_path / "new_save").exists()


# ---- tokenizer files ---------------------------------------------------------------------------
def test_wrong_format_merge_file_in_preprocess(files, tmp_path):
    refused(preprocess_cmd(files, tmp_path / "out", merges=files["vocab"]), fault_class="tokenizer",
            case="preprocess: --merge-file is the vocab JSON", expect=["--merge-file", files["vocab"],
                                                                       "not a BPE merges file"], watch=[tmp_path])


def test_wrong_format_merge_file_in_training(files, tmp_path):
    refused(train_cmd(files, merges=files["vocab"]), fault_class="tokenizer",
            case="training: --merge-file is the vocab JSON", expect=["--merge-file", "not a BPE merges file"],
            watch=[tmp_path])


def test_real_gpt2_files_swapped(files, tmp_path, gpt2_files):
    vocab, merges = gpt2_files  # (encoder.json, vocab.bpe) shipped in tests/data
    refused(preprocess_cmd(files, tmp_path / "out", vocab=merges, merges=vocab),
            fault_class="tokenizer", case="preprocess: GPT-2's vocab.bpe / encoder.json swapped",
            expect=["--vocab-file", "vocab.bpe", "not valid JSON"], watch=[tmp_path])


@pytest.mark.parametrize("content,expect", [('{"a": 0, "b": ', "not valid JSON"),
                                            ('["a", "b"]', "not an object"),
                                            ('{"a": 0, "b": 0}', "more than one token")])
def test_malformed_vocab_json(files, tmp_path, content, expect):
    bad = tmp_path / "bad_vocab.json"
    bad.write_text(content)
    refused(preprocess_cmd(files, tmp_path / "out", vocab=str(bad)), fault_class="tokenizer",
            case=f"--vocab-file malformed ({expect})", expect=["--vocab-file", str(bad), expect], watch=[tmp_path])


def test_merges_not_matching_vocab(files, tmp_path, gpt2_files):
    """GPT-2's real merges with the small byte-level vocabulary: the first merge's result is missing."""
    refused(train_cmd(files, merges=gpt2_files[1]), fault_class="tokenizer",
            case="training: --merge-file from another tokenizer", expect=["--merge-file", "vocab.bpe", "line 3",
                                                                          "not a merge of two tokens"],
            watch=[tmp_path])


def test_train_tokenizer_vocab_smaller_than_the_characters(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 20)
    refused(["python", "-m", "megapar.cli.train_tokenizer", "--input", text, "--model-prefix", tmp_path / "spm",
             "--vocab-size", "5"], fault_class="tokenizer", case="train_tokenizer --vocab-size below its characters",
            expect=["SentencePiece cannot train", "5 vs", "pass a larger --vocab-size"], watch=[tmp_path])


def test_bad_sentencepiece_model(files, tmp_path):
    bad = tmp_path / "tok.model"
    bad.write_bytes(b"not a protobuf \x00\x01\x02" * 10)
    refused(PREPROCESS[:2] + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(bad),
                              "--input", files["jsonl"], "--output-prefix", str(tmp_path / "out")],
            fault_class="tokenizer", case="--tokenizer-model is not a SentencePiece model",
            expect=["--tokenizer-model", str(bad), "not a SentencePiece model"], watch=[tmp_path])


# ---- .bin/.idx data --------------------------------------------------------------------------
def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_bin_a_few_bytes_short(files, tmp_path):
    bin_path = files["prefix"] + ".bin"
    _truncate(bin_path, os.path.getsize(bin_path) - 4)
    refused(train_cmd(files), fault_class="data", case=".bin 4 bytes shorter than its .idx",
            expect=[bin_path, "truncated", "index says"], watch=[tmp_path])


def test_bin_cut_in_half(files, tmp_path):
    bin_path = files["prefix"] + ".bin"
    _truncate(bin_path, os.path.getsize(bin_path) // 2)
    refused(train_cmd(files), fault_class="data", case=".bin cut in half", expect=[bin_path, "truncated"],
            watch=[tmp_path])


def test_idx_of_another_corpus(files, tmp_path):
    other = str(tmp_path / "other")
    random_corpus(other, docs=40)
    shutil.copy(other + ".idx", files["prefix"] + ".idx")
    refused(train_cmd(files), fault_class="data", case=".idx of another corpus", expect=[files["prefix"], "index says"],
            watch=[tmp_path])


def test_pointers_not_monotonic(files, tmp_path):
    """Two byte pointers swapped in the .idx (sizes unchanged)."""
    idx = Path(files["prefix"] + ".idx")
    raw = bytearray(idx.read_bytes())
    n = int(np.frombuffer(raw[18:26], "<u8")[0])
    ptr = np.frombuffer(raw, "<i8", n, 34 + 4 * n).copy()
    ptr[[1, 2]] = ptr[[2, 1]]
    raw[34 + 4 * n:34 + 12 * n] = ptr.tobytes()
    idx.write_bytes(bytes(raw))
    refused(train_cmd(files), fault_class="data", case=".idx pointers not monotonic",
            expect=[str(idx), "byte pointer of sequence 1"], watch=[tmp_path])


def test_empty_corpus_in_training(files, tmp_path):
    from megapar.data.indexed_dataset import IndexedDatasetBuilder
    empty = str(tmp_path / "empty")
    IndexedDatasetBuilder(empty + ".bin").finalize(empty + ".idx")
    refused(train_cmd(files, prefix=empty), fault_class="data", case="training on an empty corpus",
            expect=[empty, "empty corpus"], watch=[tmp_path])


def test_corpus_smaller_than_one_sample(files, tmp_path):
    from megapar.data.indexed_dataset import IndexedDatasetBuilder
    tiny = str(tmp_path / "tiny")
    b = IndexedDatasetBuilder(tiny + ".bin")
    b.add_document(list(range(10)))
    b.finalize(tiny + ".idx")
    refused(train_cmd(files, prefix=tiny), fault_class="data", case="corpus shorter than one --seq-length sample",
            expect=["--split", "no training sample", "--seq-length 32"], watch=[tmp_path])


def _put_token(prefix: str, position: int, token_id: int) -> None:
    """Overwrite one token of PREFIX.bin (uint16), as a corpus made with a larger vocabulary holds."""
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[position] = token_id
    tokens.flush()
    del tokens


def test_token_id_beyond_the_vocabulary_in_training(files, tmp_path):
    """Before: an IndexError in the embedding mid-run that named no file (the byte-level vocabulary
    has 265 ids, padded to an embedding table of 288 rows; id 300 has no row)."""
    _put_token(files["prefix"], 1000, 300)
    refused(train_cmd(files), fault_class="data", case="a token id >= the tokenizer's vocabulary in the .bin",
            expect=[files["prefix"] + ".bin", "token id 300 at token 1000", "vocabulary of 265 ids", "sampled check"],
            watch=[tmp_path])


def test_validator_checks_token_ids_fully_or_sampled(files, tmp_path):
    """`python -m megapar.data.validate` with the tokenizer's files reads every token (full); with
    --sample-tokens a sample, and it says which."""
    validate = ["python", "-m", "megapar.data.validate", files["prefix"]]
    tokenizer = ["--vocab-file", files["vocab"], "--merge-file", files["merges"]]
    good = run([*validate, *tokenizer])
    assert good.rc == 0 and "all < 265 (full:" in good.output, good.output
    sampled = run([*validate, "--vocab-size", "265", "--sample-tokens", "640"])
    assert sampled.rc == 0 and "all < 265 (sampled: 640 of" in sampled.output, sampled.output
    _put_token(files["prefix"], 1000, 300)
    bad = run([*validate, *tokenizer])
    assert bad.rc == 2 and "token id 300 at token 1000" in bad.output and "Traceback" not in bad.output, bad.output
    ROWS.append(Row("data", "validate with the tokenizer: a token id >= the vocabulary (full read)", True, True))
    unchecked = run(validate)
    assert unchecked.rc == 0 and "not checked" in unchecked.output, unchecked.output


# ---- naming the data: a prefix without the suffix preprocess_data adds, the validator's command line ---------
VALIDATE = ["python", "-m", "megapar.data.validate"]


def _as_preprocessed(files: dict, tmp_path: Path) -> str:
    """The corpus renamed as tools/preprocess_data.py names it for --output-prefix TMP/mydata; returns that."""
    for ext in (".bin", ".idx"):
        os.rename(files["prefix"] + ext, str(tmp_path / f"mydata_text_document{ext}"))
    return str(tmp_path / "mydata")


def test_data_path_without_the_document_suffix_names_it(files, tmp_path):
    given = _as_preprocessed(files, tmp_path)
    out = refused(train_cmd(files, prefix=given), fault_class="data",
                  case="--data-path mydata whose files are mydata_text_document.bin/.idx",
                  expect=[f"--data-path {given}", f"did you mean {given}_text_document?"], watch=[tmp_path])
    assert out.rc == 2


@pytest.mark.parametrize("case", ["no argument", "prefix without _text_document", "prefix with .bin",
                                  "no such prefix", "--vocab-size 0"])
def test_validator_refuses_bad_input_in_one_line(files, tmp_path, case):
    """Every mistake: one `error:` line, exit 2 (as every tool); a near miss names the prefix that exists."""
    given = _as_preprocessed(files, tmp_path)
    real = given + "_text_document"
    argv, expect = {
        "no argument": ([], "the following arguments are required: PREFIX"),
        "prefix without _text_document": ([given], [f"{given}.idx not found", f"did you mean {real}?"]),
        "prefix with .bin": ([real + ".bin"], f"did you mean {real}? (the prefix, without .bin/.idx)"),
        "no such prefix": ([str(tmp_path / "other")], ["other.idx not found", "without .bin/.idx"]),
        "--vocab-size 0": ([real, "--vocab-size", "0"], "--vocab-size 0 must be >= 1"),
    }[case]
    out = refused(VALIDATE + argv, fault_class="data", case=f"validate: {case}", expect=expect, watch=[tmp_path])
    assert out.rc == 2 and not out.stdout, out.output


def test_validator_help_and_a_good_pair(files, tmp_path):
    real = _as_preprocessed(files, tmp_path) + "_text_document"
    helped = run(VALIDATE + ["--help"])
    assert helped.rc == 0 and helped.stdout.startswith("usage: python -m megapar.data.validate"), helped.output
    assert "PREFIX" in helped.stdout and "--vocab-size" in helped.stdout
    good = run(VALIDATE + [real])
    assert good.rc == 0 and good.stdout.startswith(f"{real}: OK "), good.output


BLEND_CASES = [("-1", "negative"), ("0", "zero"), ("nan", "not a number")]


@pytest.mark.parametrize("weight,what", BLEND_CASES, ids=[w for _, w in BLEND_CASES])
def test_bad_blend_weight_is_refused_before_any_process(files, tmp_path, weight, what):
    cmd = ["bash", "scripts/pretrain_gpt2.sh", *train_cmd(files)[3:]]
    cmd[cmd.index("--data-path") + 1:cmd.index("--data-path") + 2] = [weight, files["prefix"], "1", files["prefix"]]
    out = refused(cmd, fault_class="data", case=f"--data-path blend weight {weight} ({what})",
                  expect=[f"--data-path weight {weight} of {files['prefix']}", "must be a positive number"],
                  watch=[tmp_path])
    assert out.rc == 2 and "torch.distributed" not in out.output


def _read_only(path: Path):
    """Make folder `path` read-only for this user, root included (chattr +i; chmod for others);
    returns the undo, or skips where neither works."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    pytest.skip("cannot make a folder read-only for root here (no chattr +i)")


@pytest.mark.parametrize("sub", ["", "new"], ids=["the folder", "a folder to create inside it"])
def test_read_only_data_cache_path(files, tmp_path, sub):
    cache = tmp_path / "cache"
    cache.mkdir()
    undo = _read_only(cache)
    try:
        target = cache / sub if sub else cache
        refused(train_cmd(files) + ["--data-cache-path", str(target)], fault_class="data",
                case=f"read-only --data-cache-path ({'a folder to create inside' if sub else 'the folder itself'})",
                expect=[f"--data-cache-path {target} is not a writable folder"], watch=[tmp_path])
    finally:
        undo()


def test_empty_corpus_in_preprocess(files, tmp_path):
    inp = tmp_path / "empty.jsonl"
    inp.write_text("\n  \n")
    refused(preprocess_cmd(files, tmp_path / "out", inp=str(inp)), fault_class="data",
            case="preprocess: input with no documents", expect=[str(inp), "no documents", "--allow-empty"],
            watch=[tmp_path])
    out = run(preprocess_cmd(files, tmp_path / "out", inp=str(inp)) + ["--allow-empty"])
    assert out.rc == 0, out.output


def test_split_without_validation_warns_once(files, tmp_path):
    out = run(train_cmd(files) + ["--eval-iters", "1", "--eval-interval", "1"])
    assert out.rc == 0, out.output[-3000:]
    warnings = [line for line in out.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no validation sample" in warnings[0], out.output[-3000:]


# ---- preprocess progress and interruption ------------------------------------------------------
def _big_input(path: Path, mb: float) -> None:
    line = json.dumps({"text": "the other then there " * 40}) + "\n"
    path.write_text(line * int(mb * 1e6 / len(line)))


def test_progress_percentage_grows(files, tmp_path):
    inp = tmp_path / "big.jsonl"
    _big_input(inp, 3)
    out = run(preprocess_cmd(files, tmp_path / "out", inp=str(inp)) + ["--workers", "2", "--log-interval", "500"])
    assert out.rc == 0, out.output[-3000:]
    pcts = [float(line.split("|")[1].strip().rstrip("%")) for line in out.stderr.splitlines()
            if line.startswith("Processed")]
    assert len(pcts) >= 3 and pcts[0] < 50 and pcts == sorted(pcts) and pcts[-1] == 100.0, out.stderr


def _descendants(pid: int) -> list[int]:
    """PIDs of every live process whose parent chain leads to `pid` (from /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_preprocess_killed_leaves_no_workers_and_no_outputs(files, tmp_path, sig):
    inp = tmp_path / "big.jsonl"
    _big_input(inp, 8)
    before = sorted(os.listdir(tmp_path))
    cmd = [sys.executable if c == "python" else c for c in preprocess_cmd(files, tmp_path / "out", inp=str(inp))]
    p = subprocess.Popen(cmd + ["--workers", "2", "--log-interval", "200"], cwd=ROOT, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    workers: list[int] = []
    try:
        first = p.stderr.readline()  # a progress line: the workers are running
        assert first.startswith("Processed"), first + p.stderr.read()
        workers = _descendants(p.pid)
        assert len(workers) >= 2, workers
        p.send_signal(sig)
        rest = p.communicate(timeout=60)[1]
        deadline = time.time() + 10
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
    finally:  # never leave this test's processes behind, whatever failed
        for pid in [p.pid] + workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        p.wait()
    errors = [line for line in rest.splitlines() if line.startswith("error:")]
    new_files = sorted(set(os.listdir(tmp_path)) - set(before))
    ROWS.append(Row("data", f"preprocess --workers 2 killed by {sig.name}",
                    p.returncode != 0 and len(errors) == 1 and "Traceback" not in rest and not left,
                    not new_files))
    assert p.returncode != 0
    assert not left, f"workers {left} left running after {sig.name}"
    assert "Traceback" not in rest, rest
    assert len(errors) == 1 and "interrupted" in errors[0], rest
    assert not new_files, new_files  # no partial or temporary outputs


# ---- OpenWebText optional steps: the evaluation file of filter_ngrams, the fix-up tasks --------------
FILTER_NGRAMS = ["python", "-m", "data_prep.openwebtext.filter_ngrams", "--no-progress"]
PASSAGE = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"
EVAL_CASES = {  # case -> (evaluation file lines or None for no file, expected fragments with {eval} for its path)
    "missing file": (None, ["--decontaminate-with {eval}: no such file"]),
    "malformed JSON line": ([json.dumps({"text": PASSAGE}), "", '{"text": "unterminated'],
                            ["{eval}:3: not a JSON line"]),
    "line without text": ([json.dumps({"text": PASSAGE}), json.dumps({"question": PASSAGE})],
                          ['{eval}:2: no string "text"']),
    "no text long enough": ([json.dumps({"text": "too short"})], ["nothing to decontaminate against"]),
}


def _eval_file(tmp_path: Path, lines) -> Path:
    path = tmp_path / "eval" / "lambada_test.jsonl"
    if lines is not None:
        path.parent.mkdir()
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_bad_evaluation_file(files, tmp_path, case):
    lines, expect = EVAL_CASES[case]
    ev = _eval_file(tmp_path, lines)
    refused([*FILTER_NGRAMS, files["jsonl"], tmp_path / "out.jsonl", "--decontaminate-with", ev],
            fault_class="OpenWebText steps", case=f"filter_ngrams: evaluation file, {case}",
            expect=[e.format(eval=ev) for e in expect], watch=[tmp_path])


def test_bad_ngram_sizes(files, tmp_path):
    ev = _eval_file(tmp_path, [json.dumps({"text": PASSAGE})])
    refused([*FILTER_NGRAMS, files["jsonl"], tmp_path / "out.jsonl", "--decontaminate-with", ev,
             "--min-ngram-size", "14"], fault_class="OpenWebText steps",
            case="filter_ngrams: --min-ngram-size 14 above --max-ngram-size 13",
            expect="--min-ngram-size 14 is larger than --max-ngram-size 13", watch=[tmp_path])


def test_cleanup_fix_dataset_missing_input(tmp_path):
    refused(["python", "-m", "data_prep.openwebtext.cleanup_fix_dataset", "--input-files", tmp_path / "nope.jsonl",
             "--tasks", "remove_512", "--output-path", tmp_path / "out", "--no-progress"],
            fault_class="OpenWebText steps", case="cleanup_fix_dataset: missing input file",
            expect="--input-files", watch=[tmp_path])


@pytest.mark.parametrize("case", ["malformed evaluation file", "unknown fix task"])
def test_driver_refuses_bad_optional_step_flags_before_any_work(gpt2_files, tmp_path, case):
    (tmp_path / "dumps").mkdir()
    out = tmp_path / "owt"
    if case == "unknown fix task":
        extra, expect = ["--fix-tasks", "remove_512,remove_1024"], "--fix-tasks: unknown task 'remove_1024'"
    else:
        ev = _eval_file(tmp_path, ["not json"])
        extra, expect = ["--decontaminate-with", str(ev)], f"{ev}:1: not a JSON line"
    refused(["bash", "scripts/prepare_openwebtext.sh", "--dumps", tmp_path / "dumps", "--output", out,
             "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1], *extra],
            fault_class="OpenWebText steps", case=f"scripts/prepare_openwebtext.sh: {case}", expect=expect,
            watch=[tmp_path])
    assert not out.exists()


# ---- data read at training time, and data that differs between ranks -------------------------------
def test_token_id_beyond_the_vocabulary_outside_the_sampled_windows(files, tmp_path):
    """A .bin larger than the start check's sample, out-of-vocabulary ids only where the sampled windows
    do not look: the start check passes, and the first batch that holds one names the prefix (before: an
    IndexError in the embedding at step 1 naming no file)."""
    from megapar.data.gpt_dataset import START_SAMPLE_TOKENS
    from megapar.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
    from megapar.data.validate import _windows
    prefix, doc, docs = str(tmp_path / "big"), 1000, 2 * START_SAMPLE_TOKENS // 1000 + 100
    tokens = np.full(doc * docs, 300, dtype=np.uint16)  # 300: no row of the 265-id vocabulary
    for start, end in _windows(tokens.size, START_SAMPLE_TOKENS):
        tokens[start:end] = 7
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for d in range(docs):
        builder.add_document(tokens[d * doc:(d + 1) * doc])
    builder.finalize(index_file_path(prefix))
    cache = tmp_path / "cache"
    refused(train_cmd(files, prefix) + ["--data-cache-path", str(cache)], fault_class="data",
            case="a token id >= the vocabulary outside the start check's sampled windows: named at the batch",
            expect=[f"--data-path {prefix}: token id 300", "train split", "vocabulary of 265 ids",
                    "tools/preprocess_data.py"], watch=[tmp_path], allow_new=[cache])


def test_data_cache_path_that_cannot_take_the_indices(files, tmp_path):
    """A --data-cache-path whose disk fills up (here: a file-size limit, EFBIG, as a full disk gives
    ENOSPC) while the indices are written: one line naming the folder, no half-written index left."""
    cache = tmp_path / "cache"
    cmd = train_cmd(files) + ["--train-iters", "5000", "--data-cache-path", str(cache)]
    cmd = ["bash", "-c", 'ulimit -f 16; exec "$@"', "bash", sys.executable, *cmd[1:]]  # 16 KiB per file at most
    refused(cmd, fault_class="data", case="--data-cache-path too full for the dataset indices",
            expect=[f"cannot write the dataset indices into {cache}", "the disk is full or a file-size limit",
                    "give --data-cache-path a folder with room"], watch=[tmp_path])


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(files: dict, tmp_path: Path, change) -> tuple:
    """Two one-process 'nodes' of a tp 2 job on this host, each with its own node-local copy of the
    corpus (the same relative --data-path read from its own folder); `change(node1_prefix)` alters node
    1's copy. Returns (node 0's folder, node 1's folder, node 0's Outcome, node 1's output)."""
    nodes = [tmp_path / f"node{i}" for i in (0, 1)]
    for n in nodes:
        (n / "data").mkdir(parents=True)
        for ext in (".bin", ".idx"):
            shutil.copy(files["prefix"] + ext, n / "data" / f"corpus{ext}")
    change(str(nodes[1] / "data" / "corpus"))
    port, env = _free_port(), {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def launch(rank: int) -> list:
        return [sys.executable, "-m", "megapar.launch", "--nnodes", "2", "--node-rank", str(rank), "--master-addr",
                "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1", "--",
                *train_cmd(files, "data/corpus")[3:], "--tensor-model-parallel-size", "2"]
    node1 = subprocess.Popen(launch(1), cwd=nodes[1], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        out0 = refused(launch(0), fault_class="data", case=f"node-local copies that differ ({change.__doc__})",
                       expect="--data-path data/corpus: rank 1 (host ", watch=[tmp_path], cwd=nodes[0],
                       env={"PYTHONPATH": str(ROOT)})
        out1 = node1.communicate(timeout=120)[0]
    finally:
        node1.kill()
    return out0, out1


def _another_corpus(prefix: str) -> None:
    """another corpus"""
    random_corpus(prefix, docs=70)


def _other_tokens(prefix: str) -> None:
    """the same .idx, other tokens"""
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[:50] = (np.asarray(tokens[:50]) + 1) % 265
    tokens.flush()
    del tokens


def _no_bin(prefix: str) -> None:
    """no .bin on node 1"""
    os.remove(prefix + ".bin")


@pytest.mark.parametrize("change,names", [(_another_corpus, "reads data/corpus.idx of "),
                                          (_other_tokens, "of the same sizes as rank 0's"),
                                          (_no_bin, "cannot read data/corpus.bin: No such file")],
                         ids=["another corpus", "other tokens", "no .bin"])
def test_ranks_reading_different_data_are_named(files, tmp_path, change, names):
    """Tensor-parallel ranks on two nodes whose local copies differ: before, they trained on mismatched
    tokens and exited 0; now every rank stops at start, and each node prints one line naming rank 1,
    its host and the file."""
    out0, out1 = _two_nodes(files, tmp_path, change)
    lines = [x for x in out0.output.splitlines() + out1.splitlines() if x.startswith("error:")]
    assert len(lines) == 2 and lines[0] == lines[1] and names in lines[0], (lines, out1[-2000:])
