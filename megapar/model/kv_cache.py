"""Key/value cache for incremental decoding: prefill once, then one token per step."""
from __future__ import annotations

import torch


class LayerKVCache:
    """Preallocated keys and values of one layer: [b, np_local, max_len, hn] each."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.empty(batch, heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k, v [b, np, s_new, hn]; return all keys/values so far [b, np, length, hn]."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.k.shape[2]}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """One LayerKVCache per local transformer layer."""

    def __init__(self, num_layers: int, batch: int, heads: int, max_len: int, head_dim: int, device, dtype):
        self.layers = [LayerKVCache(batch, heads, max_len, head_dim, device, dtype) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
