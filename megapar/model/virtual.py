"""The v model chunks of one pipeline rank under interleaved 1F1B (Megatron's `model` list).

With pipeline size p and v chunks per rank, chunk j of pipeline rank r is the GPT2Model stage
of layer block j * p + r (`Stage.virtual`): rank 0's chunk 0 owns the embeddings, rank p - 1's
chunk v - 1 the final LayerNorm, the tied head copy and the loss. Each chunk builds its layers
with their global indices, so name-seeded initialisation gives the same weights as any other
layout.

`VirtualStages` holds the chunks as submodules `model0`, `model1`, ... so that
`named_parameters()` / `state_dict()` keys are unique (`model{j}.` + the chunk's own key, layer
indices local to the chunk, as Megatron's `model{j}` checkpoint entries) and the gradient
buffer and optimizers see every chunk's parameters without knowing about chunks.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from .gpt2 import GPT2Model, Stage


class VirtualStages(nn.Module):
    """A list of model chunks with the model interface the training loop needs."""

    def __init__(self, chunks: list[GPT2Model]):
        super().__init__()
        for j, chunk in enumerate(chunks):
            self.add_module(f"model{j}", chunk)
        self.chunks: list[GPT2Model] = list(chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, j: int) -> GPT2Model:
        return self.chunks[j]

    def __iter__(self) -> Iterator[GPT2Model]:
        return iter(self.chunks)

    @property
    def stage(self) -> Stage:
        """What the rank as a whole is: first if its chunk 0 is the first stage, last if its last
        chunk is the last stage. The layer range spans chunk 0's start to the last chunk's end
        and is not contiguous (each chunk has its own `stage`)."""
        first, last = self.chunks[0].stage, self.chunks[-1].stage
        return Stage(first.layer_start, last.layer_end, first.is_first, last.is_last)

    def output_embedding_weight(self) -> torch.Tensor:
        """The rank's copy of the tied word embeddings: chunk 0's on the first rank, the last
        chunk's head copy on the last rank."""
        return (self.chunks[0] if self.chunks[0].stage.is_first else self.chunks[-1]).output_embedding_weight()

    def forward(self, *args, **kwargs):
        raise TypeError("VirtualStages runs chunk by chunk: call model[j](...) (the interleaved schedule does)")
