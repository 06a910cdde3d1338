"""Export a megapar checkpoint (any layout, or a canonical folder) to a Hugging Face
GPT2LMHeadModel folder: config.json + model.safetensors (dummy vocabulary rows removed), and the
tokenizer's files (megapar/reshard/hf_tokenizer.py).

Mapping (Megatron -> HF GPT-2; HF's Conv1D stores weights as [in, out], so linears transpose):
  word_embeddings[:vocab_size]     -> transformer.wte.weight  (lm_head is tied to it)
  position_embeddings              -> transformer.wpe.weight
  layers.i.input_layernorm         -> transformer.h.i.ln_1
  layers.i.query_key_value         -> transformer.h.i.attn.c_attn  rows [np, 3, hn] -> [3, np, hn], transposed
  layers.i.self_attention.dense    -> transformer.h.i.attn.c_proj (transposed)
  layers.i.post_attention_layernorm-> transformer.h.i.ln_2
  layers.i.mlp.dense_h_to_4h       -> transformer.h.i.mlp.c_fc (transposed)
  layers.i.mlp.dense_4h_to_h       -> transformer.h.i.mlp.c_proj (transposed)
  final_layernorm                  -> transformer.ln_f
Import (the inverse, an HF folder read as a reshard source) is megapar/reshard/hf_source.py.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from ..atomic import give_user_file_mode
from ..config.settings import DataConfig
from ..checkpoint.common import SavedConfig
from . import hf_tokenizer
from .hf_tokenizer import TokenizerFiles
from .source import Source
from ..checkpoint.publish import HF, staged_output

_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")
# megapar layer module -> (HF GPT-2 block module, is a linear stored by HF's Conv1D as [in, out])
LAYER_MAP = {"input_layernorm": ("ln_1", False), "self_attention.query_key_value": ("attn.c_attn", True),
             "self_attention.dense": ("attn.c_proj", True), "post_attention_layernorm": ("ln_2", False),
             "mlp.dense_h_to_4h": ("mlp.c_fc", True), "mlp.dense_4h_to_h": ("mlp.c_proj", True)}


def qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Megatron per-head rows [np, 3, hn, ...] -> HF [3 (q, k, v), np, hn, ...]."""
    rest = tuple(t.shape[1:])
    return t.view(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape[0], *rest)


def qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rows [3 (q, k, v), np, hn, ...] -> Megatron per-head [np, 3, hn, ...] (qkv_to_hf's inverse)."""
    rest = tuple(t.shape[1:])
    return t.view(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape[0], *rest)


def hf_key(name: str) -> tuple[str, bool]:
    """A canonical megapar name -> (its HF GPT2LMHeadModel key, whether HF stores it transposed:
    the weight of a linear, which HF's Conv1D keeps as [in, out]). KeyError for other names."""
    if name == "language_model.embedding.word_embeddings.weight":
        return "transformer.wte.weight", False
    if name == "language_model.embedding.position_embeddings.weight":
        return "transformer.wpe.weight", False
    if name.startswith("language_model.encoder.final_layernorm."):
        return f"transformer.ln_f.{name.rsplit('.', 1)[1]}", False
    m = _LAYER.match(name)
    module, leaf = m.group(2).rsplit(".", 1) if m else (None, None)
    if module not in LAYER_MAP:
        raise KeyError(f"no Hugging Face GPT-2 equivalent for {name}")
    hf, linear = LAYER_MAP[module]
    return f"transformer.h.{m.group(1)}.{hf}.{leaf}", linear and leaf == "weight"


def hf_name_and_tensor(name: str, t: torch.Tensor, heads: int) -> tuple[str, torch.Tensor]:
    """A canonical megapar tensor -> (its HF GPT2LMHeadModel key, the tensor in HF's layout)."""
    key, transposed = hf_key(name)
    if "query_key_value" in name:
        t = qkv_to_hf(t, heads)
    return key, (t.t() if transposed else t).contiguous()


def tensor_from_hf(name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's tensor for hf_key(name) -> the canonical megapar tensor `name` (hf_name_and_tensor's inverse)."""
    _, transposed = hf_key(name)
    if transposed:
        t = t.t()
    if "query_key_value" in name:
        t = qkv_from_hf(t, heads)
    return t.contiguous()


def _eod(data: DataConfig, vocab_size: int) -> int:
    """The end-of-document id of the checkpoint's tokenizer (its files must be readable); else
    GPT-2's 50256 for a 50257-token vocabulary, else the last id."""
    from ..data.tokenizer import build_tokenizer
    try:
        return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                               tokenizer_model=data.tokenizer_model).eod
    except Exception:  # noqa: BLE001 (tokenizer files moved or absent: fall back)
        return 50256 if vocab_size == 50257 else vocab_size - 1


def hf_config(saved: SavedConfig, eos: Optional[int] = None) -> dict:
    """config.json of the export; `eos`: the tokenizer's end-of-document id (default: _eod)."""
    m, vocab_size = saved.model, saved.model.vocab_size
    eos = _eod(saved.data, vocab_size) if eos is None else eos
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
            "n_positions": m.max_position_embeddings, "n_ctx": m.max_position_embeddings,
            "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
            "n_inner": m.ffn_hidden_size, "activation_function": "gelu_new", "layer_norm_epsilon": m.layernorm_epsilon,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
            "scale_attn_weights": True, "use_cache": True, "tie_word_embeddings": True,
            "bos_token_id": eos, "eos_token_id": eos}


def export_hf(src: Source, out_dir: str, dtype: Optional[torch.dtype] = None, force: bool = False, log=print,
              tokenizer: Optional[TokenizerFiles] = None) -> None:
    """Write `src` (ShardedCheckpoint / CanonicalFolder) as a transformers GPT2LMHeadModel folder,
    with the tokenizer files of `tokenizer` (megapar/reshard/hf_tokenizer.py; None: the model alone)."""
    from safetensors.torch import save_file
    m = src.saved.model
    with staged_output(src, out_dir, force, (HF,)) as staging:
        tok = hf_tokenizer.check(tokenizer, m.vocab_size) if tokenizer is not None else None
        if m.vocab_size is None:
            raise ValueError("the checkpoint does not record its true vocab_size; cannot remove the dummy rows")
        tensors = {}
        for name in src.names:
            key, t = hf_name_and_tensor(name, src.full(name), m.num_attention_heads)
            tensors[key] = t.to(dtype) if dtype is not None else t
        cfg = hf_config(src.saved, tok.eod if tok is not None else None)
        cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype).replace("torch.", "")
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        give_user_file_mode(os.path.join(staging, "model.safetensors"))  # save_file makes it 0o600
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        written = hf_tokenizer.write(tokenizer, tok, staging, m.max_position_embeddings) if tok is not None else []
    log(f"wrote Hugging Face GPT2LMHeadModel ({m.num_layers} layers, hidden {m.hidden_size}, "
        f"vocab {m.vocab_size}) to {out_dir}")
    if tok is not None:
        source = ", ".join(p for p in (tokenizer.vocab_file, tokenizer.merge_file, tokenizer.tokenizer_model) if p)
        log(f"wrote tokenizer: {'GPT-2 BPE' if tokenizer.kind == 'GPT2BPETokenizer' else 'SentencePiece'} "
            f"({', '.join(written)}) from {source}")
