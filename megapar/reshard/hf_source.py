"""A Hugging Face GPT-2 folder read as a reshard source: the canonical form on the fly.

    src = HFFolder("gpt2_hf")                         # config.json + model.safetensors (or pytorch_model.bin)
    write_sharded(src, "ckpt", tp, pp, with_optim=False)    # megapar/reshard/convert.py, as resharding does

`HFFolder` has the interface of ShardedCheckpoint / CanonicalFolder (names, full, spec, meta,
saved, iteration, release), so the writer that splits any canonical source to a (tp, pp) layout
writes it too. The tensor mapping is the inverse of the export's (megapar/reshard/hf.py): Conv1D
weights are transposed back to [out, in], QKV rows go from [3, np, hn] to per-head [np, 3, hn].
The iteration is "release" (Megatron's name for a checkpoint that is not a training run's);
there is no optimizer state, so training loads it with --finetune (or --no-load-optim --no-load-rng).

Weights: model.safetensors, model.safetensors.index.json (shards), or pytorch_model.bin. Keys may
carry the `transformer.` prefix (GPT2LMHeadModel) or not (GPT2Model, the original GPT-2 files);
the attention-mask buffers (`h.N.attn.bias`, `h.N.attn.masked_bias`) are skipped, and an
`lm_head.weight` must equal the word embeddings (megapar's output layer is tied to them).
config.json settings megapar's GPT-2 cannot represent are refused by name (`check_representable`).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from typing import Any, Optional

import torch

from ..config.build import parse_config
from ..config.settings import default_of
from ..checkpoint.common import CHECKPOINT_VERSION, CheckpointError, SavedConfig, megatron_args, read_saved_config
from ..errors import MegaparError
from ..model.sharding import is_vocab_parallel
from .hf import LAYER_MAP, hf_key, tensor_from_hf
from ..checkpoint.layout import WORD, expected_full_shape

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
# HF's names for the tanh approximation of GELU, the one megapar's MLP uses (F.gelu(approximate="tanh"))
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# config.json settings with the value megapar's GPT-2 has (HF's default when absent), and why another is refused
REQUIRED_SETTINGS: dict[str, tuple[Any, str]] = {
    "scale_attn_weights": (True, "megapar always scales attention scores by 1/sqrt(head size)"),
    "scale_attn_by_inverse_layer_idx": (False, "megapar does not scale attention by 1/(layer index + 1)"),
    "reorder_and_upcast_attn": (False, "megapar does not have HF's reordered, upcast attention"),
    "add_cross_attention": (False, "megapar's GPT-2 has no cross-attention"),
    "tie_word_embeddings": (True, "megapar's output layer is always tied to the word embeddings"),
}
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")     # causal-mask buffers of old GPT-2 files
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


# ---- config.json ----------------------------------------------------------------------------------
def read_hf_config(folder: str) -> dict:
    """config.json of the HF folder as a dict, or CheckpointError naming what is wrong."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"Hugging Face folder {folder} does not exist (or is not a directory)")
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; a Hugging Face model folder holds config.json and the "
                              f"weights (save one with model.save_pretrained(folder))")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-save the model with save_pretrained") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} holds a JSON {type(cfg).__name__}, not an object of settings")
    return cfg


def check_representable(cfg: dict, path: str) -> None:
    """Refuse, by name, a config.json whose model megapar's GPT-2 cannot represent exactly."""
    if cfg.get("model_type") != "gpt2":
        raise CheckpointError(f"{path}: model_type is {cfg.get('model_type')!r}, not 'gpt2'; only GPT-2 "
                              f"(GPT2LMHeadModel) folders can be imported")
    for name in _SIZES:
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{path}: {name} is {value!r}; it must be a positive integer")
    n_inner = cfg.get("n_inner")
    if n_inner is not None and (not isinstance(n_inner, int) or isinstance(n_inner, bool) or n_inner < 1):
        raise CheckpointError(f"{path}: n_inner is {n_inner!r}; it must be null (4 x n_embd) or a positive integer")
    if cfg["n_embd"] % cfg["n_head"]:
        raise CheckpointError(f"{path}: n_embd {cfg['n_embd']} is not divisible by n_head {cfg['n_head']}")
    act = cfg.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise CheckpointError(f"{path}: activation_function {act!r} cannot be represented: megapar's MLP uses "
                              f"the tanh approximation of GELU ({' / '.join(TANH_GELUS)})")
    for name, (want, why) in REQUIRED_SETTINGS.items():
        if cfg.get(name, want) != want:
            raise CheckpointError(f"{path}: {name} is {cfg[name]!r} and {why}; this model cannot be imported")
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise CheckpointError(f"{path}: layer_norm_epsilon is {eps!r}; it must be a positive number")


def megapar_flags(cfg: dict, divisible_by: int) -> list[str]:
    """The megapar model flags of an HF GPT-2 config (what a training run loading it passes)."""
    flags = ["--num-layers", cfg["n_layer"], "--hidden-size", cfg["n_embd"], "--num-attention-heads", cfg["n_head"],
             "--seq-length", cfg["n_positions"], "--max-position-embeddings", cfg["n_positions"],
             "--layernorm-epsilon", cfg.get("layer_norm_epsilon", 1e-5),
             "--make-vocab-size-divisible-by", divisible_by]
    if cfg.get("n_inner") is not None:
        flags += ["--ffn-hidden-size", cfg["n_inner"]]
    return [str(f) for f in flags]


def tokenizer_flags(folder: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None) -> list[str]:
    """The tokenizer the checkpoint's args name: the given files, else the folder's GPT-2 BPE files
    (vocab.json + merges.txt) or SentencePiece model (tokenizer.model), else none (generation
    then asks for --vocab-file/--merge-file)."""
    def here(name: str) -> Optional[str]:
        path = os.path.join(folder, name)
        return os.path.abspath(path) if os.path.isfile(path) else None

    sp_model = tokenizer_model or (here("tokenizer.model") if not (vocab_file or merge_file or here("vocab.json"))
                                   else None)
    if sp_model:
        return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", os.path.abspath(sp_model)]
    vocab = os.path.abspath(vocab_file) if vocab_file else here("vocab.json")
    merges = os.path.abspath(merge_file) if merge_file else here("merges.txt")
    flags = ["--tokenizer-type", "GPT2BPETokenizer"]
    return flags + (["--vocab-file", vocab] if vocab else []) + (["--merge-file", merges] if merges else [])


def _number(cfg: dict, name: str, default: float, path: str) -> str:
    """config.json's number `name` (HF's default when absent or null) as a flag value."""
    value = cfg.get(name)
    if value is None:
        return str(default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CheckpointError(f"{path}: {name} is {value!r}; it must be a number")
    return str(value)


def saved_config_for(cfg: dict, path: str, divisible_by: int, tokenizer: list[str]) -> SavedConfig:
    """The SavedConfig (Megatron args, model config) of the HF model at tp = pp = 1, as training writes it."""
    flags = megapar_flags(cfg, divisible_by) + tokenizer + [
        "--hidden-dropout", _number(cfg, "resid_pdrop", 0.1, path), "--attention-dropout",
        _number(cfg, "attn_pdrop", 0.1, path), "--init-method-std", _number(cfg, "initializer_range", 0.02, path)]
    from ..model import set_vocab
    try:
        run = parse_config(flags, world_size=1)
    except MegaparError as e:
        raise CheckpointError(f"{path}: {e}") from None
    set_vocab(run.model, cfg["vocab_size"], 1, log=lambda *_: None)
    return read_saved_config({"args": megatron_args(run), "model_config": asdict(run.model)}, path)


# ---- weight files ---------------------------------------------------------------------------------
class _Weights:
    """The tensors of the folder's weight file(s): keys, (shape, dtype) without reading data, get."""

    def __init__(self, folder: str):
        self.files: dict[str, str] = {}          # key -> file
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._open: dict[str, Any] = {}
        found = [n for n in (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN) if os.path.isfile(os.path.join(folder, n))]
        if not found:
            raise CheckpointError(f"{folder} holds no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX} or "
                                  f"{TORCH_BIN} beside config.json")
        self.source = os.path.join(folder, found[0])
        if found[0] == SAFETENSORS:
            self._add_safetensors(self.source)
        elif found[0] == SAFETENSORS_INDEX:
            for shard in sorted(set(self._index(self.source).values())):
                self._add_safetensors(os.path.join(folder, shard))
        else:
            self._add_bin(self.source)

    @staticmethod
    def _index(path: str) -> dict[str, str]:
        try:
            with open(path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            raise CheckpointError(f"{path} is not a safetensors index (a JSON object with a 'weight_map' "
                                  f"of tensor name -> file)") from None
        return weight_map

    def _add_safetensors(self, path: str) -> None:
        from safetensors import safe_open
        if not os.path.isfile(path):
            raise CheckpointError(f"weight file {path} is missing (named by {SAFETENSORS_INDEX})")
        try:
            f = safe_open(path, framework="pt")
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype not in _DTYPES:
                    raise CheckpointError(f"weight file {path}: {key} has dtype {dtype}, not a float type")
                self.files[key], self.meta[key] = path, (tuple(f.get_slice(key).get_shape()), _DTYPES[dtype])
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError for a truncated file or a bad header
            raise CheckpointError(f"weight file {path} is truncated or corrupt ({e}); download or save it "
                                  f"again") from None
        self._open[path] = f

    def _add_bin(self, path: str) -> None:
        state, why = None, "not a dict of tensors"
        for mmap in (True, False):          # mmap needs the zip format; very old files are plain pickles
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
                break
            except Exception as e:  # zip/pickle errors have many types
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        if not isinstance(state, dict):
            raise CheckpointError(f"weight file {path} is truncated or corrupt ({why}); download or save it again")
        for key, t in state.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise CheckpointError(f"weight file {path}: {key} is not a floating-point tensor")
            self.files[key], self.meta[key] = path, (tuple(t.shape), t.dtype)
        self._open[path] = state

    def get(self, key: str) -> torch.Tensor:
        handle = self._open[self.files[key]]
        try:
            t = handle[key] if isinstance(handle, dict) else handle.get_tensor(key)
        except Exception as e:  # a file changed or damaged after it was opened
            raise CheckpointError(f"weight file {self.files[key]}: cannot read {key} ({e})") from None
        return t.clone() if isinstance(handle, dict) else t

    def close(self) -> None:
        self._open.clear()


def canonical_names(num_layers: int) -> list[str]:
    """The canonical (tp = pp = 1) parameter names of a megapar GPT-2, in model order."""
    names = [WORD, "language_model.embedding.position_embeddings.weight"]
    for i in range(num_layers):
        names += [f"language_model.encoder.layers.{i}.{module}.{leaf}" for module in LAYER_MAP
                  for leaf in ("weight", "bias")]
    return names + ["language_model.encoder.final_layernorm.weight", "language_model.encoder.final_layernorm.bias"]


def _strip(key: str) -> str:
    return key[len("transformer."):] if key.startswith("transformer.") else key


# ---- the source -----------------------------------------------------------------------------------
class HFFolder:
    """An HF GPT-2 folder with the reader interface of ShardedCheckpoint (names, full, spec, meta)."""

    def __init__(self, path: str, make_vocab_size_divisible_by: int = default_of("make_vocab_size_divisible_by"),
                 vocab_file: Optional[str] = None,
                 merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None):
        self.path = path
        self.config = read_hf_config(path)
        cfg_path = os.path.join(path, CONFIG)
        check_representable(self.config, cfg_path)
        self.saved = saved_config_for(self.config, cfg_path, make_vocab_size_divisible_by,
                                      tokenizer_flags(path, vocab_file, merge_file, tokenizer_model))
        self.iteration, self.has_optim, self.distributed = "release", False, False
        self.weights = _Weights(path)
        self.names = canonical_names(self.config["n_layer"])
        self._keys = self._match_keys()
        self.specs = {name: self._spec(name) for name in self.names}
        self._check_tied()

    def _match_keys(self) -> dict[str, str]:
        """Canonical name -> key in the weight file; refuse missing and unexpected tensors by name."""
        present = {_strip(k): k for k in self.weights.files}
        wanted = {_strip(hf_key(n)[0]): n for n in self.names}
        missing = [k for k in wanted if k not in present]
        if missing:
            raise CheckpointError(f"{self.weights.source} lacks {len(missing)} tensor(s) that config.json implies "
                                  f"(e.g. {', '.join(missing[:3])}); is it a GPT2LMHeadModel of this config?")
        extra = [k for k in present if k not in wanted and k != "lm_head.weight" and not _BUFFER.match(k)]
        if extra:
            raise CheckpointError(f"{self.weights.source} holds tensors a GPT-2 of megapar's kind does not have "
                                  f"({', '.join(sorted(extra)[:3])}); only GPT2LMHeadModel / GPT2Model weights "
                                  f"can be imported")
        return {n: present[k] for k, n in wanted.items()}

    def _spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.weights.meta[self._keys[name]]
        if hf_key(name)[1]:
            shape = tuple(reversed(shape))
        m = self.saved.model
        want = (m.vocab_size, m.hidden_size) if is_vocab_parallel(name) else expected_full_shape(name, m)
        want = want or (m.hidden_size,)            # the output biases of attention and MLP
        if shape != want:
            raise CheckpointError(f"{self.weights.source}: {self._keys[name]} has shape "
                                  f"{tuple(self.weights.meta[self._keys[name]][0])}, but config.json implies "
                                  f"{tuple(reversed(want)) if hf_key(name)[1] else want}")
        return shape, dtype

    def _check_tied(self) -> None:
        head = next((k for k in self.weights.files if _strip(k) == "lm_head.weight"), None)
        if head is not None and not torch.equal(self.weights.get(head), self.weights.get(self._keys[WORD])):
            raise CheckpointError(f"{self.weights.source}: lm_head.weight differs from the word embeddings "
                                  f"(wte): an untied output layer, which megapar (tied embeddings) cannot represent")

    # ---- the reader interface ---------------------------------------------------------------------
    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        """The canonical tensor `name` (only kind "param": an HF folder has no optimizer state)."""
        if kind != "param":
            raise CheckpointError(f"{self.path} is a Hugging Face model without optimizer state; convert "
                                  f"its weights only")
        t = tensor_from_hf(name, self.weights.get(self._keys[name]), self.saved.model.num_attention_heads)
        return t.to(self.specs[name][1])

    def spec(self, name: str, kind: str = "param") -> tuple[tuple[int, ...], torch.dtype]:
        if kind != "param":
            raise CheckpointError(f"{self.path} is a Hugging Face model without optimizer state")
        return self.specs[name]

    def optim_meta(self) -> None:
        return None

    def meta(self) -> dict:
        """The canonical form's metadata (megapar/reshard/canonical.py) of this model."""
        return {"format": "megapar-canonical", "version": 1, "args": self.saved.args,
                "model_config": asdict(self.saved.model), "iteration": self.iteration,
                "checkpoint_version": CHECKPOINT_VERSION, "vocab_size": self.saved.model.vocab_size,
                "names": self.names, "has_optim": False, "distributed_optimizer": False, "optim_meta": None,
                "opt_param_scheduler": None, "source_layout": {"tp": 1, "pp": 1, "dp": 1}, "rng_states": {}}

    def release(self) -> None:
        self.weights.close()

    def describe(self) -> str:
        c = self.config
        return (f"Hugging Face GPT-2 ({c['n_layer']} layers, hidden {c['n_embd']}, {c['n_head']} heads, "
                f"vocab {c['vocab_size']}, {c['n_positions']} positions) from {self.weights.source}")


