"""Host buffers for GPU transfers, page-locked at their exact size.

PyTorch's pinned allocator (`pin_memory=True`, its CachingHostAllocator) rounds every request up to a power of
two so that freed blocks can be reused by size class: a 13B rank's 25.7 GB gradient shard takes 32 GiB. The
offload state, its staging copies and an async save's buffers are allocated once and live for the run, so the
rounding only wastes host memory (at 13B, enough to push two ranks of the delayed update past a 256 GiB host;
docs/benchmarks/offload_h100_20261126.md). Buffers above EXACT_ABOVE_BYTES are therefore anonymous memory
(zero-filled by the kernel) page-locked in place with cudaHostRegister, as PyTorch's own
`pinned_use_cuda_host_register` does but without the rounding, and unregistered when the last tensor on them
is freed. Smaller buffers keep the caching allocator (its reuse is worth the rounding). A buffer asked for
`page_aligned` (O_DIRECT file I/O into it: nvme.py) is such anonymous memory at any size, pinned or not, as
mmap's pages start on a page boundary and torch's allocator promises less.
"""
from __future__ import annotations

import mmap

import torch

from .topology import ConfigError

EXACT_ABOVE_BYTES = 64 * 2**20


class _LockedPages(mmap.mmap):
    """Anonymous host memory, page-locked for CUDA from `lock()` until it is freed (after the last
    tensor viewing it: torch.frombuffer keeps it alive)."""

    address = 0

    def lock(self) -> None:
        view = torch.frombuffer(self, dtype=torch.uint8)
        address = view.data_ptr()
        del view
        err = torch.cuda.cudart().cudaHostRegister(address, len(self), 0)
        if int(err) != 0:
            raise ConfigError(f"cannot page-lock {len(self) / 2**30:.1f} GiB of host memory for GPU copies "
                              f"(cudaHostRegister: CUDA error {int(err)}); raise the locked-memory limit (ulimit -l "
                              f"unlimited) or free host memory (estimate_memory prints the host GiB per rank)")
        self.address = address

    def __del__(self) -> None:
        if self.address:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # interpreter shutdown: the process's pages go anyway
                pass
            self.address = 0


def host_buffer(numel: int, dtype: torch.dtype, pinned: bool, zero: bool = False,
                page_aligned: bool = False) -> torch.Tensor:
    """A 1-D host tensor of `numel` elements of `dtype`; page-locked when `pinned` (a GPU run's
    transfer buffer), at its exact size above EXACT_ABOVE_BYTES. zero: filled with zeros (the large
    pinned ones and the page-aligned ones are zero already). page_aligned: its first element starts
    on a page boundary."""
    nbytes = numel * dtype.itemsize
    if (pinned and nbytes > EXACT_ABOVE_BYTES) or (page_aligned and nbytes):
        pages = _LockedPages(-1, nbytes)
        if pinned:
            pages.lock()
        return torch.frombuffer(pages, dtype=dtype)
    make = torch.zeros if zero else torch.empty
    return make(numel, dtype=dtype, pin_memory=pinned)
