"""Read a megapar checkpoint saved at any (tp, pp, dp) as canonical full tensors, one at a time.

Shard files are opened with torch.load(mmap=True): only the tensors asked for are paged in, and
all mappings are dropped whenever `budget_bytes` (default 64 MiB) were paged in since the last
drop, so resident memory stays bounded by a few tensors rather than the model. A full tensor
is assembled by copying each TP shard straight into its place (no intermediate copies). Every
problem (missing tracker / iteration / shard, truncated or corrupt file, shards that disagree)
raises CheckpointError naming the file.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict
from typing import Optional, Protocol

import torch

from ..topology import layer_counts
from ..optimizer.base import OPTIM_KINDS
from ..checkpoint.common import (SHAPE_FIELDS, SavedConfig, DISTRIB_OPTIM_FILE, MODEL_FILE, CheckpointError,
                                 flatten_model_states, load_file, read_saved_config, read_tracker,
                                 shard_dir_name, shard_dirs)
from ..checkpoint.legacy import (check_optimizer_state, check_shard_identity, read_optimizer_state, read_shard,
                                 verify_shards)
from ..checkpoint.publish import published_dir
from ..model.sharding import is_vocab_parallel, tp_partition_dim
from ..checkpoint.layout import HEAD, canonical_key, chunk_layout, expected_full_shape, stage_of

# ModelConfig fields that every shard of one checkpoint must agree on: the model's shape, and how it was split
_SAME_FIELDS = SHAPE_FIELDS + ("padded_vocab_size", "decoder_first_pipeline_num_layers",
                               "decoder_last_pipeline_num_layers", "virtual_pipeline_model_parallel_size")


class Source(Protocol):
    """A checkpoint of any kind read as canonical tensors (checkpoint/layout.py's names), one at a time: what
    every writer of reshard/ takes. Implemented by ShardedCheckpoint (legacy layout), DistSource (torch_dist),
    CanonicalFolder and HFFolder; open_source picks one for a folder."""
    saved: SavedConfig          # the checkpoint's args and model config
    iteration: int | str        # its iteration ("release" for an import)
    names: list[str]            # canonical keys, in model order
    has_optim: bool             # whether optimizer state (OPTIM_KINDS) is there to read
    distributed: bool           # whether it was saved with --use-distributed-optimizer

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        """The full canonical tensor `name` of `kind` ("param" or one of OPTIM_KINDS), vocabulary trimmed."""

    def spec(self, name: str, kind: str = "param") -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of what `full(name, kind)` returns, without reading it."""

    def meta(self) -> dict:
        """Everything but the tensors: the canonical form's metadata (canonical.py)."""

    def optim_meta(self) -> Optional[dict]:
        """{step, grad_scaler, param_groups} (layout independent), or None without optimizer state."""

    def release(self) -> None:
        """Drop what reading held (file mappings, open files); reading may go on after."""


class _Budget:
    """Bytes paged in from all open shard files since they were last released."""

    def __init__(self, limit: int):
        self.limit, self.read = limit, 0
        self.files: list["_ShardFile"] = []

    def add(self, n: int) -> None:
        self.read += n
        if self.read > self.limit:  # drop every mapping so paged-in data leaves resident memory
            for f in self.files:
                f.release()
            self.read = 0


class _ShardFile:
    """One lazily (re)opened, memory-mapped shard file: a model file (checked by read_shard) or
    a distrib_optim.pt."""

    def __init__(self, path: str, budget: _Budget, is_model: bool):
        self.path, self.budget, self.is_model = path, budget, is_model
        self._state: Optional[dict] = None
        budget.files.append(self)

    def state(self) -> dict:
        if self._state is None:
            self._state = read_shard(self.path, mmap=True) if self.is_model else load_file(self.path, mmap=True)
        return self._state

    def release(self) -> None:
        self._state = None


class ShardedCheckpoint:
    """Canonical view of a checkpoint at any layout.

    names: canonical keys in model order; full(name, kind) with kind "param" or one of
    master_param / exp_avg / exp_avg_sq returns the full (vocab-trimmed) tensor."""

    def __init__(self, root: str, iteration: Optional[int | str] = None, budget_bytes: int = 64 << 20):
        self.root = root
        if iteration is None:
            if not os.path.isdir(root):
                raise CheckpointError(f"checkpoint directory {root} does not exist")
            iteration = read_tracker(root)
            if iteration is None:
                raise CheckpointError(f"{os.path.join(root, 'latest_checkpointed_iteration.txt')} is missing; "
                                      f"{root} holds no finished checkpoint (pass --iteration to pick one)")
        self.iteration = iteration
        self.dir = published_dir(root, iteration)
        if not os.path.isdir(self.dir):
            raise CheckpointError(f"checkpoint directory {self.dir} (named by the tracker) does not exist")
        self.tp, self.pp = self._detect_layout()
        self.idents = verify_shards(self.dir, [os.path.dirname(self._path(t, p, MODEL_FILE)) for t in range(self.tp)
                                               for p in range(self.pp)], iteration, self.pp)
        self.budget = _Budget(budget_bytes)
        self.shards = {(t, p): _ShardFile(self._path(t, p, MODEL_FILE), self.budget, is_model=True)
                       for t in range(self.tp) for p in range(self.pp)}
        self.headers = {k: self._header(k) for k in self.shards}
        self._check_consistent()
        first = self.headers[(0, 0)]
        self.saved: SavedConfig = first["saved"]
        self.layer_counts = layer_counts(self.saved.model, self.pp)      # transformer layers per stage
        self.layout = chunk_layout(self.saved.model, self.pp)            # per stage: its chunks' layer ranges
        self.has_optim = first["has_optim"]
        self.distributed = first["distributed"]
        self.optim_files = {k: _ShardFile(self._path(*k, DISTRIB_OPTIM_FILE), self.budget, is_model=False)
                            for k in self.shards} if self.distributed else {}
        self.names = self._canonical_names()

    # ---- discovery and validation ---------------------------------------------------------
    def _path(self, tp_rank: int, pp_rank: int, fname: str) -> str:
        return os.path.join(self.dir, shard_dir_name(tp_rank, pp_rank, self.pp), fname)

    def _detect_layout(self) -> tuple[int, int]:
        found = shard_dirs(self.dir)
        if not found:
            raise CheckpointError(f"{self.dir} holds no mp_rank_* shard directories")
        # the saved args say the layout; the directory listing must match it
        probe = os.path.join(self.dir, found[0], MODEL_FILE)
        layout = read_saved_config(read_shard(probe, mmap=True), f"checkpoint file {probe}").parallel
        tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
        missing = [shard_dir_name(t, p, pp) for t in range(tp) for p in range(pp)
                   if not os.path.isdir(os.path.join(self.dir, shard_dir_name(t, p, pp)))]
        if missing:
            raise CheckpointError(f"checkpoint {self.dir} was saved with tensor-parallel {tp} x pipeline-parallel "
                                  f"{pp} but shard directories {', '.join(missing)} are missing")
        return tp, pp

    def _header(self, key: tuple[int, int]) -> dict:
        """What a shard's files say (its optimizer state checked against its model tensors)."""
        sf = self.shards[key]
        st = sf.state()
        keys = {k: tuple(v.shape) for k, v in flatten_model_states(st).items()}
        ident = self.idents[os.path.dirname(sf.path)]
        check_shard_identity(sf.path, st.get("identity"), ident)
        optim = read_optimizer_state(st, sf.path, mmap=True)
        if optim is not None and optim[1] != sf.path:
            check_shard_identity(optim[1], optim[0].get("identity"), ident)
        if optim is not None:
            check_optimizer_state(optim[0], keys, optim[1], "convert with --no-optim to leave the optimizer state "
                                                            "out, or load an earlier iteration")
        return {"saved": read_saved_config(st, sf.path), "iteration": st["iteration"], "keys": keys,
                "has_optim": optim is not None, "distributed": optim is not None and optim[1] != sf.path,
                "scheduler": st.get("opt_param_scheduler"), "rng_state": st.get("rng_state"),
                "checkpoint_version": st.get("checkpoint_version"),
                "optim_meta": None if optim is None else _optim_meta(optim[0])}

    def _check_consistent(self) -> None:
        ref, ref_path = self.headers[(0, 0)], self.shards[(0, 0)].path
        for key, h in self.headers.items():
            path = self.shards[key].path
            mine, theirs = h["saved"], ref["saved"]
            for a in _SAME_FIELDS:
                if getattr(mine.model, a) != getattr(theirs.model, a):
                    raise CheckpointError(f"checkpoint file {path} disagrees with {ref_path} on {a}: "
                                          f"{getattr(mine.model, a)} vs {getattr(theirs.model, a)}; "
                                          f"the shards come from different runs")
            if mine.parallel != theirs.parallel:
                raise CheckpointError(f"checkpoint file {path} disagrees with {ref_path} on the parallel layout "
                                      f"({mine.parallel} vs {theirs.parallel}); the shards come from different runs")
            if h["iteration"] != ref["iteration"]:
                raise CheckpointError(f"checkpoint file {path} is at iteration {h['iteration']} but {ref_path} "
                                      f"is at {ref['iteration']}; the shards come from different saves")
            if (h["has_optim"], h["distributed"]) != (ref["has_optim"], ref["distributed"]):
                raise CheckpointError(f"checkpoint file {path} and {ref_path} disagree on whether (and how) "
                                      f"optimizer state was saved")
            same_stage = self.headers[(0, key[1])]
            if set(h["keys"]) != set(same_stage["keys"]):
                diff = sorted(set(h["keys"]) ^ set(same_stage["keys"]))
                raise CheckpointError(f"checkpoint file {path} has different model keys than tensor-parallel rank 0 "
                                      f"of its stage ({', '.join(diff[:3])})")

    def _canonical_names(self) -> list[str]:
        names: list[str] = []
        for p in range(self.pp):
            for local in self.headers[(0, p)]["keys"]:
                if local == HEAD or local.endswith("." + HEAD):
                    continue
                names.append(canonical_key(local, self.layout[p]))
        names.sort(key=_model_order)  # stable: interleaved stages hold non-adjacent layer blocks
        if len(set(names)) != len(names):
            raise CheckpointError(f"checkpoint {self.dir}: stages hold overlapping parameters; "
                                  f"is its num_layers ({self.saved.model.num_layers}) right?")
        return names

    # ---- metadata ---------------------------------------------------------------------------
    def optim_meta(self) -> Optional[dict]:
        """{step, grad_scaler, param_groups} (layout independent), or None without optimizer state."""
        return self.headers[(0, 0)]["optim_meta"]

    # ---- tensors -------------------------------------------------------------------------------
    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        """The full canonical tensor `name` (kind: param | master_param | exp_avg | exp_avg_sq)."""
        p, local = stage_of(name, self.layout)
        parts = [self._part(t, p, local, kind) for t in range(self.tp)]   # mmapped views
        shapes = {tuple(x.shape) for x in parts}
        if len(shapes) != 1 or len({x.dtype for x in parts}) != 1:
            raise CheckpointError(f"checkpoint {self.dir}: tensor-parallel shards of {local} ({kind}) on stage {p} "
                                  f"have different shapes/dtypes {sorted(shapes)}; the shards are inconsistent")
        dim = tp_partition_dim(name)
        shape = list(parts[0].shape)
        if dim is not None:
            shape[dim] *= self.tp
        want = expected_full_shape(name, self.saved.model)
        if want is not None and tuple(shape) != want:
            raise CheckpointError(f"checkpoint {self._path(0, p, MODEL_FILE)}: {local} ({kind}) merges to "
                                  f"shape {tuple(shape)} but the checkpoint's args imply {want}")
        vocab = self.saved.model.vocab_size
        keep = vocab if is_vocab_parallel(name) and vocab is not None else None
        out_shape = [keep] + shape[1:] if keep is not None else shape
        full = torch.empty(out_shape, dtype=parts[0].dtype)
        for t, part in enumerate(parts):       # copy each shard straight into place (no cat, no clone)
            if dim is None:
                full.copy_(part[:keep] if keep is not None else part)
                self.budget.add(part.numel() * part.element_size())
                break
            lo = t * part.shape[dim]
            hi = lo + part.shape[dim]
            if keep is not None:
                hi = min(hi, keep)
                if hi <= lo:
                    continue
                part = part[: hi - lo]
            full.narrow(dim, lo, hi - lo).copy_(part)
            self.budget.add(part.numel() * part.element_size())
        return full

    def spec(self, name: str, kind: str = "param") -> tuple[tuple[int, ...], torch.dtype]:
        """(full canonical shape, dtype) of a tensor, from file metadata (no data is read)."""
        p, local = stage_of(name, self.layout)
        part = self._part(0, p, local, kind)
        shape = list(part.shape)
        dim = tp_partition_dim(name)
        if dim is not None:
            shape[dim] *= self.tp
        if is_vocab_parallel(name) and self.saved.model.vocab_size is not None:
            shape[0] = self.saved.model.vocab_size
        return tuple(shape), part.dtype

    def meta(self) -> dict:
        """Everything but the tensors: the canonical form's metadata."""
        h = self.headers[(0, 0)]
        model = self.saved.model
        return {"format": "megapar-canonical", "version": 1, "args": self.saved.args,
                "model_config": asdict(model), "iteration": self.iteration,
                "checkpoint_version": h["checkpoint_version"], "vocab_size": model.vocab_size, "names": self.names,
                "has_optim": self.has_optim, "distributed_optimizer": self.distributed,
                "optim_meta": self.optim_meta(), "opt_param_scheduler": h["scheduler"],
                "source_layout": {"tp": self.tp, "pp": self.pp, "dp": self.saved.parallel.data_parallel_size},
                "rng_states": {k: v["rng_state"] for k, v in self.headers.items() if v["rng_state"] is not None}}

    def _part(self, t: int, p: int, local: str, kind: str) -> torch.Tensor:
        """Shard (t, p)'s tensor `local` of `kind`: a view into the memory-mapped file."""
        if kind == "param":
            sf = self.shards[(t, p)]
            flat = flatten_model_states(sf.state())
            if local not in flat:
                raise CheckpointError(f"checkpoint file {sf.path} lacks model tensor {local}")
            return flat[local]
        if kind not in OPTIM_KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}")
        if not self.has_optim:
            raise CheckpointError(f"checkpoint {self.dir} has no optimizer state (saved with --no-save-optim); "
                                  f"convert it with --no-optim")
        sf = self.optim_files[(t, p)] if self.distributed else self.shards[(t, p)]
        st = sf.state() if self.distributed else sf.state()["optimizer"]
        entry = st.get("state", {}).get(local)
        if entry is None or kind not in entry:
            raise CheckpointError(f"checkpoint file {sf.path} lacks optimizer state {kind} of {local}")
        return entry[kind]

    def release(self) -> None:
        for sf in list(self.shards.values()) + list(self.optim_files.values()):
            sf.release()


def _model_order(name: str) -> tuple[int, int]:
    """Embeddings, then the layers in order, then the final LayerNorm."""
    m = re.match(r"^language_model\.encoder\.layers\.(\d+)\.", name)
    if m:
        return 1, int(m.group(1))
    return (2, 0) if name.startswith("language_model.encoder.") else (0, 0)


def _optim_meta(optim: dict) -> dict:
    return {"step": optim.get("step", 0), "grad_scaler": optim.get("grad_scaler"),
            "param_groups": optim.get("param_groups")}
