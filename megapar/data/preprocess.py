"""JSON lines -> `.bin/.idx`, byte-identical to Megatron-LM's tools/preprocess_data.py.

    preprocess(PreprocessConfig(input="docs.jsonl", output_prefix="out/owt", json_keys=["text"],
                                tokenizer_type="GPT2BPETokenizer", vocab_file=..., merge_file=...,
                                append_eod=True, workers=2))

Input lines are read in batches; each batch is JSON-parsed and tokenized in-process (workers=1)
or by a pool of worker processes (results consumed in input order, so the output is identical
for any --workers). Each document becomes one sequence (+ eod with append_eod if it has >= 1
token); an empty document adds a document boundary but no sequence (Megatron core_v0.14.0).
Whitespace-only lines are skipped. A malformed line stops the run naming file and line (or is
skipped and counted with skip_bad_lines). A failing worker stops the run with its error.
Outputs are written under temporary names and renamed only when everything succeeded.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import gzip
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Iterator, Optional

import numpy as np

from ..errors import MegaparError, die_with_parent
from .indexed_dataset import IndexedDatasetBuilder, best_dtype
from .tokenizer import build_tokenizer

try:  # optional, faster JSON parsing (docs/benchmarks/data_cpu_20261124.md#data); same results for valid JSON lines
    import orjson as _fastjson
except ImportError:  # pragma: no cover
    _fastjson = None

BATCH_BYTES = 1 << 18


class PreprocessError(MegaparError, RuntimeError):
    """Preprocessing stopped; the message names the file/line or worker error and the fix."""


@dataclasses.dataclass
class PreprocessConfig:
    input: str
    output_prefix: str
    json_keys: list[str] = dataclasses.field(default_factory=lambda: ["text"])
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    tiktoken_name: Optional[str] = None
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    skip_bad_lines: bool = False
    quiet: bool = False
    allow_empty: bool = False  # else an input that yields no tokens is an error

    def output_paths(self, key: str) -> tuple[str, str]:
        base = f"{self.output_prefix}_{key}_document"
        return base + ".bin", base + ".idx"


# ---- worker side ---------------------------------------------------------------------------
_STATE: dict = {}


def _init_worker(cfg: PreprocessConfig) -> None:
    if mp.parent_process() is not None:  # a pool worker: Ctrl-C is the main process's to handle,
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # and SIGTERM (from it or the kernel) ends it quietly
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent(signal.SIGTERM)
    if _STATE.get("cfg") is cfg:  # inherited through fork: nothing to build
        return
    tok = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model,
                          cfg.tiktoken_name)
    _STATE.update(cfg=cfg, tok=tok, dtype=best_dtype(tok.vocab_size))


def _parse(line: bytes, keys: list[str]) -> list[str]:
    """Return the texts of `keys` in one JSON line, or raise ValueError saying what is wrong."""
    if _fastjson is not None:
        obj = _fastjson.loads(line)
    else:
        obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    texts = []
    for k in keys:
        if k not in obj:
            raise ValueError(f"missing key {k!r} (keys present: {sorted(obj)[:10]}); set --json-keys")
        t = obj[k]
        if not isinstance(t, str):
            raise ValueError(f"key {k!r} is {type(t).__name__}, expected a string")
        if _fastjson is None and "\\ud" in line.decode("utf-8", "replace").lower():
            t.encode("utf-8")  # a lone surrogate raises, like Megatron's tokenizer
        texts.append(t)
    return texts


def encode_batch(first_lineno: int, blob: bytes) -> dict:
    """Parse + tokenize a batch of lines (one bytes blob). Returns per key (flat tokens, per-doc lengths), the
    bytes read, and the skipped bad lines as (lineno, reason)."""
    cfg, tok, dtype = _STATE["cfg"], _STATE["tok"], _STATE["dtype"]
    out_tokens = {k: [] for k in cfg.json_keys}
    out_lens = {k: [] for k in cfg.json_keys}
    bad = []
    for j, line in enumerate(blob.split(b"\n")):
        if not line.strip():
            continue
        try:
            texts = _parse(line, cfg.json_keys)
        except (ValueError, UnicodeError) as e:
            if not cfg.skip_bad_lines:
                raise PreprocessError(f"{cfg.input}:{first_lineno + j}: malformed line ({e}); fix it or "
                                      "pass --skip-bad-lines to skip and count such lines") from None
            bad.append((first_lineno + j, str(e)[:200]))
            continue
        for k, text in zip(cfg.json_keys, texts):
            ids = tok.tokenize(text)
            if ids and cfg.append_eod:
                ids.append(tok.eod)
            out_tokens[k].extend(ids)
            out_lens[k].append(len(ids))
    res = {k: (np.array(out_tokens[k], dtype=dtype), np.array(out_lens[k], dtype=np.int32))
           for k in cfg.json_keys}
    return {"docs": res, "bytes": len(blob), "bad": bad}


# ---- main side -----------------------------------------------------------------------------
def _open_input(path: str):
    if not os.path.isfile(path):
        raise PreprocessError(f"--input {path!r} not found")
    raw = open(path, "rb")
    return raw, (gzip.open(raw, "rb") if path.endswith(".gz") else raw)


def _batches(f, raw) -> Iterator[tuple[int, bytes, int]]:
    """Yield (first line number, blob of whole lines of about BATCH_BYTES, position in the input
    file after it) -- the position of the raw file, compressed bytes for .gz input."""
    lineno = 1
    while True:
        blob = f.read(BATCH_BYTES)
        if not blob:
            return
        if not blob.endswith(b"\n"):
            blob += f.readline()
        yield lineno, blob, raw.tell()
        lineno += blob.count(b"\n")


class Interrupted(BaseException):
    """A stop signal in the main process: the outputs are removed and the workers stopped."""


_STOP: dict = {"signal": None}


def request_stop(signum, frame) -> None:
    """Signal handler (SIGTERM, SIGINT): the first signal stops the conversion once the batches in
    flight are back -- a worker terminated while it writes its result would leave half a message in
    the pool's pipe, and the pool's exit hook would then wait on it forever; a second signal
    interrupts at once."""
    name = signal.Signals(signum).name
    if _STOP["signal"] is not None:
        raise Interrupted(name)
    _STOP["signal"] = name


def _results(cfg: PreprocessConfig, batches) -> Iterator[dict]:
    """Encoded batches in input order, each with "pos" (the input position after it): in-process
    for workers <= 1, else a process pool with a bounded number of batches in flight. Any worker
    error or crash is raised here; on any exception the workers are terminated before it
    propagates, so none outlives the run. After a `request_stop` signal no batch is started or
    yielded; the pool shuts down cleanly, then Interrupted is raised."""
    if cfg.workers <= 1:
        if _STATE.get("cfg") is not cfg:
            _init_worker(cfg)
        for lineno, blob, pos in batches:
            if _STOP["signal"]:
                raise Interrupted(_STOP["signal"])
            yield {**encode_batch(lineno, blob), "pos": pos}
        return
    # fork starts workers fast; spawn when torch (threads) is loaded in this process
    ctx = mp.get_context("spawn" if "torch" in sys.modules else "fork")
    ex = cf.ProcessPoolExecutor(cfg.workers, mp_context=ctx, initializer=_init_worker, initargs=(cfg,))
    pending: collections.deque = collections.deque()
    try:
        for lineno, blob, pos in batches:
            if _STOP["signal"]:
                break
            pending.append((ex.submit(encode_batch, lineno, blob), pos))
            if len(pending) >= 4 * cfg.workers:
                fut, at = pending.popleft()
                yield {**fut.result(), "pos": at}
        while pending:
            fut, at = pending.popleft()
            res = fut.result()
            if not _STOP["signal"]:
                yield {**res, "pos": at}
    except cf.process.BrokenProcessPool as e:
        _stop_workers(ex)
        raise PreprocessError(f"a preprocessing worker died ({e}); rerun with --workers 1 to see "
                              "the failing document's error") from None
    except BaseException:
        _stop_workers(ex)
        raise
    ex.shutdown(wait=True)
    if _STOP["signal"]:
        raise Interrupted(_STOP["signal"])


def _stop_workers(ex: cf.ProcessPoolExecutor) -> None:
    """Cancel what is queued, terminate the worker processes and reap them."""
    procs = list((getattr(ex, "_processes", None) or {}).values())  # private, but stable since 3.8
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class _Progress:
    """Prints documents, MB/s, % and ETA every `interval` docs. The % is the input position
    after the last batch whose documents were written (not how far reading ran ahead of the
    workers)."""

    def __init__(self, total: int, interval: int, quiet: bool):
        self.total, self.interval, self.quiet = total, interval, quiet
        self.start = time.time()
        self.docs = self.bytes = self.pos = 0
        self.next_log = interval

    def update(self, docs: int, nbytes: int, pos: Optional[int] = None, final: bool = False) -> None:
        self.docs += docs
        self.bytes += nbytes
        self.pos = self.total if final else (self.pos if pos is None else pos)
        due = self.interval > 0 and self.docs >= self.next_log
        if self.quiet or not (due or (final and self.docs + self.interval > self.next_log)):
            return
        self.next_log = self.docs + self.interval
        el = max(time.time() - self.start, 1e-9)
        pos = self.pos
        rate = pos / el
        eta = (self.total - pos) / rate if rate > 0 else 0.0
        print(f"Processed {self.docs} documents ({self.docs / el:.1f} docs/s, {self.bytes / el / 1e6:.2f} MB/s)"
              f" | {100.0 * pos / max(self.total, 1):.1f}% | ETA {eta:.0f}s", file=sys.stderr, flush=True)


def _check_not_empty(cfg: PreprocessConfig, stats: dict) -> None:
    """No tokens for a key means a corpus training cannot use: an error unless allow_empty."""
    for k, st in stats.items():
        if st["num_tokens"] == 0 and not cfg.allow_empty:
            raise PreprocessError(f"--input {cfg.input!r} has no documents with text under key {k!r} "
                                  f"({st['num_docs']} documents, 0 tokens): nothing to train on, no output "
                                  "written; check --input and --json-keys, or pass --allow-empty to write "
                                  "an empty dataset anyway")


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run the conversion; return {key: {"bin", "idx", "num_docs", "num_tokens"}, "bad_lines": n,
    "vocab_size": the tokenizer's, ...}."""
    tok = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model,
                          cfg.tiktoken_name)
    dtype = best_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    raw, f = _open_input(cfg.input)
    _STOP["signal"] = None
    _STATE.update(cfg=cfg, tok=tok, dtype=dtype)  # used in-process and by forked workers
    builders = {k: IndexedDatasetBuilder(cfg.output_paths(k)[0], dtype) for k in cfg.json_keys}
    stats = {k: {"num_docs": 0, "num_tokens": 0} for k in cfg.json_keys}
    bad_lines: list = []
    prog = _Progress(os.path.getsize(cfg.input), cfg.log_interval, cfg.quiet)
    try:
        with raw, f:
            for res in _results(cfg, _batches(f, raw)):
                for k, (tokens, lens) in res["docs"].items():
                    builders[k].add_documents(tokens, lens[lens > 0], (lens > 0).astype(np.int64))
                    stats[k]["num_docs"] += lens.size
                    stats[k]["num_tokens"] += tokens.size
                bad_lines.extend(res["bad"])
                prog.update(res["docs"][cfg.json_keys[0]][1].size, res["bytes"], res["pos"])
        _check_not_empty(cfg, stats)
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    for k, b in builders.items():
        b.finalize(cfg.output_paths(k)[1])
        stats[k].update(zip(("bin", "idx"), cfg.output_paths(k)))
    prog.update(0, 0, final=True)
    if bad_lines and not cfg.quiet:
        print(f"Skipped {len(bad_lines)} malformed lines (first: line {bad_lines[0][0]}: {bad_lines[0][1]})",
              file=sys.stderr)
    return {**stats, "bad_lines": len(bad_lines), "seconds": time.time() - prog.start, "bytes": prog.bytes,
            "vocab_size": tok.vocab_size}
