"""FP8 GEMMs for the transformer layers (--fp8-format), through torchao's float8 training.

What runs in fp8: the four GEMMs of every transformer layer (QKV, attention dense, h->4h, 4h->h),
forward and both backward GEMMs (input gradient, weight gradient). What does not: embeddings, the
LM head, attention's batched matmuls, LayerNorm, softmax, the optimizer. Weights, activations
between layers, gradients and checkpoints stay in bf16/fp32: each GEMM casts its operands to fp8
on the fly (torch._scaled_mm on Hopper / Ada, compute capability >= 8.9) and returns bf16.

Formats (Megatron's names): `e4m3` casts every operand to e4m3; `hybrid` casts the forward operands
(input, weight) to e4m3 and the output gradient to e5m2 (more range, less precision).
Recipes (torchao's): `tensorwise` (default), one dynamic scale per tensor, amax / fp8 max computed
from the tensor at each cast; `rowwise`, one scale per row, e4m3 only. torchao no longer has delayed
scaling (an amax history), so Megatron's --fp8-amax-history-len / --fp8-amax-compute-algo have no
counterpart here.

Tensor parallelism: each rank scales its own operands: the scale of a column- or row-parallel
weight is that of the rank's shard, and that of the input that of what the rank multiplies (under
sequence parallelism, the all-gathered sequence). The scales differ across TP ranks by design:
each rank's GEMM is independent, and a shared scale would cost an all-reduce of the amax per cast
without making any rank's result more exact (it would move the small values of the shard with the
smaller amax toward e4m3's subnormal range).

Weight gradients: torchao's autograd function returns the weight gradient in bf16, so an fp8
layer's weight takes the unfused path (the GradBuffer hook adds the bf16 gradient into the fp32
`main_grad`, as with --no-gradient-accumulation-fusion); its bias keeps the fused path.

torchao is optional (`pip install megapar[fp8]`); it is imported only when --fp8-format is given.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    import torch

FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("tensorwise", "rowwise")
GEMM_MULTIPLE = 16   # torch._scaled_mm: both dimensions of both operands multiples of 16
MIN_CAPABILITY = (8, 9)


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


# Loggers whose import-time warnings about torchao say nothing about a run: torchao's own (its C++
# extensions skipped or failing to load) and torch's pytree (torchao registers Enum classes as pytree
# constants, which newer torch deprecates).
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def torchao_quietly() -> Iterator[None]:
    """Import torchao (directly, or through transformers, which imports it when installed) inside this
    block: it loads no C++ extensions (float8 training is Python over torch._scaled_mm, and a wheel's
    extensions built for another CUDA or Python than this one's only fail to load), and the loggers of
    TORCHAO_IMPORT_LOGGERS print errors only until the block ends. Every other warning is untouched."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    loggers = [logging.getLogger(name) for name in TORCHAO_IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _import_torchao() -> None:
    """Import the torchao modules this file uses, quietly (torchao_quietly)."""
    with torchao_quietly():
        for module in ("torchao", "torchao.float8.config", "torchao.float8.float8_training_tensor",
                       "torchao.float8.float8_linear", "torchao.float8.float8_utils"):
            importlib.import_module(module)


@dataclass(frozen=True)
class Fp8Gemm:
    """How one fp8 GEMM casts and multiplies: torchao's Float8LinearConfig and LinearMMConfig."""
    fmt: str
    recipe: str
    config: Any
    mm_config: Any


@functools.cache
def fp8_gemm(fmt: str, recipe: str = "tensorwise", emulate: bool = False) -> Fp8Gemm:
    """The torchao configuration of --fp8-format `fmt` with --fp8-recipe `recipe`, one object per
    setting (every layer shares it: torch.compile sees one constant).
    emulate: fp8 casts with high-precision GEMMs (any device; for tests on CPU)."""
    import dataclasses

    import torch
    _import_torchao()
    from torchao.float8.config import CastConfig, Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    if fmt not in FP8_FORMATS or recipe not in FP8_RECIPES:
        raise ValueError(f"unknown fp8 format/recipe {fmt!r}/{recipe!r}")
    if recipe == "rowwise":
        if fmt != "e4m3":
            raise ValueError("torchao's rowwise recipe casts every operand to e4m3: use --fp8-format e4m3")
        config = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        grad_dtype = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
        config = Float8LinearConfig(cast_config_input=CastConfig(target_dtype=torch.float8_e4m3fn),
                                    cast_config_weight=CastConfig(target_dtype=torch.float8_e4m3fn),
                                    cast_config_grad_output=CastConfig(target_dtype=grad_dtype))
    config = dataclasses.replace(config, emulate=emulate)
    # as torchao's Float8Linear: fast accumulation for the forward GEMM only
    mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim)
                                 for g in (config.gemm_config_output, config.gemm_config_grad_input,
                                           config.gemm_config_grad_weight)))
    return Fp8Gemm(fmt, recipe, config, mm_config)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Gemm) -> torch.Tensor:
    """x [*, in] @ weight [out, in]^T -> [*, out] in x's dtype, with fp8 operands (no bias).
    Backward returns dx and dW in high precision (both computed by fp8 GEMMs)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(x, weight.t(), fp8.mm_config, fp8.config)


def layer_fp8(fmt: Optional[str], recipe: str, device: Optional[torch.device] = None) -> Optional[Fp8Gemm]:
    """The Fp8Gemm the transformer layers use (None without --fp8-format). Off a CUDA device
    (a test on CPU) the GEMMs are emulated."""
    import torch

    if fmt is None:
        return None
    return fp8_gemm(fmt, recipe, emulate=device is None or torch.device(device).type != "cuda")


def weight_scale(weight: torch.Tensor, fp8: Fp8Gemm) -> torch.Tensor:
    """The tensorwise scale the forward GEMM gives this (local) weight: fp8 max / amax."""
    from torchao.float8.float8_utils import tensor_to_scale

    return tensor_to_scale(weight, fp8.config.cast_config_weight.target_dtype)
