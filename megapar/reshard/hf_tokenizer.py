"""The tokenizer files of a Hugging Face export, so that `AutoTokenizer.from_pretrained(folder)` works.

GPT-2 BPE (--tokenizer-type GPT2BPETokenizer):
    vocab.json, merges.txt          the checkpoint's --vocab-file / --merge-file, copied verbatim (HF's
                                    GPT2Tokenizer reads the same formats, and like Megatron skips the
                                    merges file's first line)
    tokenizer_config.json           tokenizer_class GPT2Tokenizer; <|endoftext|> is bos, eos and unk
    special_tokens_map.json
SentencePiece (--tokenizer-type SentencePieceTokenizer):
    tokenizer.model                 the checkpoint's --tokenizer-model, copied verbatim
    tokenizer_config.json           tokenizer_class LlamaTokenizer with add_bos_token / add_eos_token off,
                                    so it encodes as megapar's SentencePieceTokenizer (sp.encode: no
                                    bos, no eos); special tokens are the model's own pieces
    special_tokens_map.json

Where the files come from: the paths in the checkpoint's args, unless --vocab-file/--merge-file or
--tokenizer-model name others. They are checked by building megapar's tokenizer from them, whose
vocabulary must be the checkpoint's.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from ..config.settings import DataConfig
from ..checkpoint.common import CheckpointError
from ..checkpoint.publish import CONFIG_FILES, GPT2_FILES, SP_FILE
ENDOFTEXT = "<|endoftext|>"
_FIX = "pass --vocab-file/--merge-file or --tokenizer-model, or --no-tokenizer to export the model alone"


@dataclass
class TokenizerFiles:
    """The tokenizer to export: its megapar type and source files."""
    kind: str                              # GPT2BPETokenizer | SentencePieceTokenizer
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None


def resolve(data: DataConfig, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
            tokenizer_model: Optional[str] = None) -> TokenizerFiles:
    """The files to export: the options, else the checkpoint's (`data`: its tokenizer settings)."""
    if tokenizer_model:
        return TokenizerFiles("SentencePieceTokenizer", tokenizer_model=tokenizer_model)
    if vocab_file or merge_file:
        return TokenizerFiles("GPT2BPETokenizer", vocab_file or data.vocab_file, merge_file or data.merge_file)
    if data.tokenizer_type == "SentencePieceTokenizer":
        return TokenizerFiles("SentencePieceTokenizer", tokenizer_model=data.tokenizer_model)
    if data.tokenizer_type == "GPT2BPETokenizer":
        return TokenizerFiles("GPT2BPETokenizer", data.vocab_file, data.merge_file)
    raise CheckpointError(f"the checkpoint's tokenizer is {data.tokenizer_type}, which has no files to export; "
                          f"{_FIX}")


def check(files: TokenizerFiles, vocab_size: Optional[int]):
    """Build megapar's tokenizer from the files (one clear error if they are missing or wrong, or
    if its vocabulary is not the checkpoint's); returns it."""
    from ..data.tokenizer import TokenizerError, build_tokenizer
    if files.kind == "GPT2BPETokenizer" and not (files.vocab_file and files.merge_file):
        flag = "--merge-file" if files.vocab_file else "--vocab-file"
        raise CheckpointError(f"the checkpoint names no GPT-2 BPE {flag} to export; {_FIX}")
    if files.kind == "SentencePieceTokenizer" and not files.tokenizer_model:
        raise CheckpointError(f"the checkpoint names no --tokenizer-model to export; {_FIX}")
    try:
        tok = build_tokenizer(files.kind, vocab_file=files.vocab_file, merge_file=files.merge_file,
                              tokenizer_model=files.tokenizer_model)
    except TokenizerError as e:
        raise CheckpointError(f"cannot export the tokenizer ({e}); {_FIX}") from None
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise CheckpointError(f"the tokenizer ({files.kind}) has {tok.vocab_size} tokens but the model's vocabulary "
                              f"is {vocab_size}; {_FIX}")
    return tok


def write(files: TokenizerFiles, tok, out_dir: str, max_length: int) -> list[str]:
    """Write the tokenizer files into `out_dir`; returns their names."""
    if files.kind == "GPT2BPETokenizer":
        shutil.copyfile(files.vocab_file, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(files.merge_file, os.path.join(out_dir, "merges.txt"))
        special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
        config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False}
        names = list(GPT2_FILES)
    else:
        shutil.copyfile(files.tokenizer_model, os.path.join(out_dir, SP_FILE))
        sp = tok.sp
        piece = lambda i: sp.id_to_piece(i) if i >= 0 else None  # noqa: E731
        special = {"bos_token": piece(sp.bos_id()), "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()),
                   "pad_token": piece(sp.pad_id())}
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                  "legacy": False}
        names = [SP_FILE]
    config.update(special, model_max_length=max_length, clean_up_tokenization_spaces=False)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), {k: v for k, v in special.items() if v})
    return names + list(CONFIG_FILES)


def reader_note(files: TokenizerFiles) -> Optional[str]:
    """A note when this Python lacks what transformers needs to read the exported files: it reads a
    SentencePiece tokenizer.model through protobuf (the `hf` extra installs it)."""
    if files.kind != "SentencePieceTokenizer":
        return None
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return ("note: AutoTokenizer reads tokenizer.model through protobuf, which this Python lacks: "
                "pip install protobuf (or pip install -e '.[hf]')")
    return None


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def gpt2_files_from_tokenizer_json(folder: str) -> Optional[dict[str, str]]:
    """{"vocab.json": ..., "merges.txt": ...} from the folder's tokenizer.json when it holds a byte-level BPE
    model and the folder has no vocab.json / merges.txt (current transformers saves only tokenizer.json); its
    added tokens (<|endoftext|>) join the vocabulary; else None. Merges are read in either of the tokenizers
    library's spellings ("a b" or ["a", "b"])."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path) or any(os.path.isfile(os.path.join(folder, f)) for f in GPT2_FILES):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a tokenizers JSON file ({e}); pass --vocab-file and --merge-file, "
                              f"or --tokenizer-model") from None
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in added if t["content"] not in model["vocab"]}}
    return {GPT2_FILES[0]: json.dumps(vocab, ensure_ascii=False),
            GPT2_FILES[1]: "#version: 0.2\n" + "".join(m + "\n" for m in merges)}
