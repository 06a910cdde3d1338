"""Dropout for compiled layers on GPUs whose mask costs one Philox call per four elements.

Inductor lowers `F.dropout` to `tl.rand(seed, index)` per element: one Philox4x32-10 call (ten
rounds of 32-bit multiplies) makes 128 random bits, and the kernel keeps 32 of them: at GPT-2 345M
shapes that made each residual join's forward and backward 57% slower (docs/benchmarks/dropout-zero2_h200_20261126.md).
`keep_mask` draws the mask with `tl.randint4x` and uses all four words: element 4i + j is kept
where the top 31 bits of word j of call i are >= p * 2**31, so P(drop) is p to within 2**-31.

    dropout(x, p) = x * keep / (1 - p)        keep: bool, x's shape, saved for backward

The multiply stays in the compiled graph, where Inductor fuses it with the residual add (forward)
and the gradient's other elementwise work (backward), as it fuses its own dropout. The mask is a
Triton kernel behind a `torch.library.triton_op`, so torch.compile and a CUDA graph capture call it
like any kernel. Its Philox key is drawn per call from the current torch generator (`torch.randint`
on the device, which the RNG tracker may have forked to its model-parallel stream): replays of a
captured graph draw new keys, as eager steps do, and the generator's state (saved in checkpoints)
decides every mask. The masks differ from `F.dropout`'s, as Inductor's already do.
model/transformer.py's `sp_dropout` uses it in compiled layers that record gradients.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

BLOCK = 1024  # Philox calls per program: 4096 elements


def available(x: torch.Tensor) -> bool:
    """Whether `dropout` can run on x (a CUDA tensor, Triton installed)."""
    return triton is not None and x.is_cuda


if triton is not None:
    @triton.jit
    def _keep_mask_kernel(seed_ptr, out_ptr, numel, threshold, BLOCK: tl.constexpr):
        call = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                   # [BLOCK] Philox counters
        r0, r1, r2, r3 = tl.randint4x(tl.load(seed_ptr), call)
        words = tl.join(tl.join(r0, r1), tl.join(r2, r3))                       # [BLOCK, 2, 2]
        words = tl.reshape(words, [4 * BLOCK]).to(tl.uint32, bitcast=True)      # [4 * BLOCK]
        keep = (words >> 1).to(tl.int32) >= threshold                           # top 31 bits: int32 compare
        index = tl.program_id(0) * 4 * BLOCK + tl.arange(0, 4 * BLOCK)
        tl.store(out_ptr + index, keep, mask=index < numel)

    @torch.library.triton_op("megapar::dropout_keep_mask", mutates_args=())
    def _keep_mask(seed: torch.Tensor, numel: int, threshold: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.bool, device=seed.device)
        grid = (triton.cdiv(numel, 4 * BLOCK),)
        torch.library.wrap_triton(_keep_mask_kernel)[grid](seed, out, numel, threshold, BLOCK=BLOCK)
        return out


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """A bool tensor of `shape`, each element False with probability p (the current generator's stream)."""
    numel = shape.numel()
    seed = torch.randint(0, 2**62, (1,), device=device)                          # this call's Philox key
    threshold = min(round(p * 2**31), 2**31 - 1)                                 # an int32 kernel argument
    return torch.ops.megapar.dropout_keep_mask(seed, numel, threshold).view(shape)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout of x with probability p (0 < p < 1), x on a GPU (`available`)."""
    return x * keep_mask(x.shape, p, x.device) * (1.0 / (1.0 - p))
