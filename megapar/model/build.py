"""Build this rank's GPT-2 stage from the config and topology, with Megatron's log lines."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from ..config.settings import ModelConfig
from ..kernels.inductor import COMPILE_OPTIONS
from ..topology import Topology, padded_vocab_size
from .gpt2 import GPT2Model, Stage
from .virtual import VirtualStages


def set_vocab(cfg: ModelConfig, vocab_size: int, tp: int, log: Callable[[str], None] = print) -> None:
    """Fill cfg.vocab_size / cfg.padded_vocab_size and print Megatron's padding line."""
    cfg.vocab_size = vocab_size
    cfg.padded_vocab_size = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, tp)
    log(f"> padded vocab (size: {vocab_size}) with {cfg.padded_vocab_size - vocab_size} dummy tokens "
        f"(new size: {cfg.padded_vocab_size})")


def build_model(cfg: ModelConfig, topo: Topology, rank: int, seed: int, device: torch.device,
                dtype: torch.dtype, on_layer_built: Optional[Callable[[torch.nn.Module], None]] = None,
                layer_hooks: bool = False) -> Union[GPT2Model, VirtualStages]:
    """This rank's stage on `device` in `dtype` (with --virtual-pipeline-model-parallel-size v > 1:
    its v model chunks as one VirtualStages). cfg.vocab_size must be set (set_vocab).
    Data-parallel rank 0 of each (tensor, pipeline) position prints its parameter count.
    on_layer_built: see GPT2Model. layer_hooks: the layers carry module hooks (zero.py's build_zero), so
    --torch-compile compiles each layer's forward and leaves its hooks outside the graph."""
    c = topo.coord(rank)
    v = cfg.virtual_pipeline_model_parallel_size
    if v is not None and v > 1:
        chunks = [GPT2Model(cfg, Stage.virtual(cfg.num_layers, topo.pp, c.pp, v, j), seed, topo.groups.tp,
                            device=device, dtype=dtype, on_layer_built=on_layer_built) for j in range(v)]
        model = VirtualStages(chunks)
    else:
        model = GPT2Model(cfg, Stage.for_config(cfg, topo.pp, c.pp), seed, topo.groups.tp, device=device, dtype=dtype,
                          on_layer_built=on_layer_built)
    if cfg.torch_compile:
        for chunk in (model.chunks if isinstance(model, VirtualStages) else [model]):
            for layer in chunk.language_model.encoder.layers:
                if layer_hooks:
                    layer.forward = torch.compile(layer.forward, options=COMPILE_OPTIONS)
                else:
                    layer.compile(options=COMPILE_OPTIONS)
    if c.dp == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({c.tp}, {c.pp}): {n}", flush=True)
    return model
