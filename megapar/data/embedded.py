"""An offline default dataset: the docstrings of the Python standard library.

    info = prepare_embedded_dataset("data_cache/embedded")
    info["data_prefix"], info["tokenizer_type"], info["tokenizer_model"]

Real English text that exists on every machine with Python: module/class/function docstrings of
the stdlib (parsed with `ast`, nothing imported) plus the language-reference topics of
`pydoc_data/topics.py`, in sorted file order, ~2 MB of JSON lines. Tokenized with GPT-2 BPE when
vocab/merge files are given and exist, else with a SentencePiece BPE model (8000 pieces) trained
on the corpus itself (a second or so). Results are cached in `out_dir` (atomic writes, a lock for
concurrent callers); a second call reuses them.
"""
from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import json
import os
import sys
import sysconfig
from typing import Iterator, Optional

from ..atomic import atomic_write

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
MIN_CHARS, MAX_CHARS = 40, 20000
MANIFEST_VERSION = 1


def _log(msg: str) -> None:
    print(f"> {msg}", flush=True)


def _stdlib_files(root: str) -> Iterator[str]:
    """Every .py file under the stdlib root, skipping tests and third-party packages, sorted."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                yield os.path.join(dirpath, fn)


def _docstrings(path: str) -> list[str]:
    """Docstrings of a source file (module, classes, functions), plus the string values of
    pydoc_data/topics.py. Unparseable files give []."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    if path.endswith(os.path.join("pydoc_data", "topics.py")):
        return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n, clean=True))]


def collect_stdlib_docs(max_bytes: int = 4_000_000, root: Optional[str] = None) -> list[str]:
    """Unique stdlib docstrings of MIN_CHARS..MAX_CHARS characters, deterministic order, at most
    `max_bytes` of UTF-8 text in total."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs, seen, total = [], set(), 0
    for path in _stdlib_files(root):
        for d in _docstrings(path):
            d = d.strip()
            if not (MIN_CHARS <= len(d) <= MAX_CHARS) or d in seen:
                continue
            n = len(d.encode("utf-8", "replace"))
            if total + n > max_bytes:
                return docs
            seen.add(d)
            docs.append(d)
            total += n
    return docs


def _write_atomic(path: str, lines: list[str]) -> None:
    with atomic_write(path) as f:
        f.writelines(lines)


@contextlib.contextmanager
def _locked(out_dir: str):
    """Serialise concurrent callers (e.g. several ranks) on one out_dir."""
    with open(os.path.join(out_dir, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _corpus(out_dir: str, max_bytes: int) -> tuple[str, str]:
    """Write (once) docs.jsonl and the matching plain-text file; return their paths."""
    base = os.path.join(out_dir, f"stdlib_docs_{max_bytes}")
    jsonl, txt = base + ".jsonl", base + ".txt"
    if not (os.path.isfile(jsonl) and os.path.isfile(txt)):
        _log(f"collecting docstrings from the Python {sys.version.split()[0]} standard library")
        docs = collect_stdlib_docs(max_bytes)
        text = [d.encode("utf-8", "replace").decode("utf-8") for d in docs]  # drop lone surrogates
        _write_atomic(txt, [ln + "\n" for d in text for ln in d.split("\n") if ln.strip()])
        _write_atomic(jsonl, [json.dumps({"text": d}) + "\n" for d in text])
        _log(f"wrote {len(docs)} documents ({os.path.getsize(jsonl) / 1e6:.2f} MB) to {jsonl}")
    return jsonl, txt


def prepare_embedded_dataset(out_dir: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                             max_bytes: int = 4_000_000, vocab_size: int = 8000) -> dict:
    """Build (or reuse) the stdlib-docstring dataset in `out_dir`. Returns dict(data_prefix,
    tokenizer_type, vocab_file + merge_file or tokenizer_model, vocab_size, num_docs, num_tokens)."""
    from .preprocess import PreprocessConfig, preprocess
    from .train_tokenizer import train_sentencepiece

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    gpt2 = bool(vocab_file and merge_file and os.path.isfile(vocab_file) and os.path.isfile(merge_file))
    kind = "gpt2" if gpt2 else "spm"
    key = {"version": MANIFEST_VERSION, "python": sys.version.split()[0], "kind": kind, "max_bytes": max_bytes,
           "vocab_size": None if gpt2 else vocab_size,
           "files": [os.path.abspath(vocab_file), os.path.abspath(merge_file)] if gpt2 else None}
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    manifest = os.path.join(out_dir, f"manifest_{kind}_{tag}.json")
    with _locked(out_dir):
        if os.path.isfile(manifest):
            with open(manifest) as f:
                info = json.load(f)
            if os.path.isfile(info["data_prefix"] + ".idx") and os.path.isfile(info["data_prefix"] + ".bin"):
                _log(f"reusing embedded dataset {info['data_prefix']} ({info['num_tokens']} tokens)")
                return info
        jsonl, txt = _corpus(out_dir, max_bytes)
        if gpt2:
            tok_args = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.abspath(vocab_file),
                        "merge_file": os.path.abspath(merge_file)}
        else:
            model_prefix = os.path.join(out_dir, f"stdlib_spm{vocab_size}_{tag}")
            if not os.path.isfile(model_prefix + ".model"):
                _log(f"training a SentencePiece BPE tokenizer ({vocab_size} pieces) on {txt}")
                train_sentencepiece([txt], model_prefix, vocab_size=vocab_size)
            tok_args = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model_prefix + ".model"}
        _log(f"tokenizing {jsonl} with {tok_args['tokenizer_type']}")
        cfg = PreprocessConfig(input=jsonl, output_prefix=os.path.join(out_dir, f"stdlib_{kind}_{tag}"),
                               append_eod=True, workers=1, quiet=True, **tok_args)
        res = preprocess(cfg)
        info = {"data_prefix": res["text"]["bin"][:-len(".bin")], **tok_args, "corpus": jsonl,
                "vocab_size": res["vocab_size"],
                "num_docs": res["text"]["num_docs"], "num_tokens": res["text"]["num_tokens"]}
        _write_atomic(manifest, [json.dumps(info, indent=1) + "\n"])
        _log(f"embedded dataset ready: {info['data_prefix']} ({info['num_docs']} docs, {info['num_tokens']} tokens)")
        return info
