"""Model FLOPs, tokens/s, TFLOP/s per GPU and MFU against the device's dense bf16 peak."""
from __future__ import annotations

from typing import Optional

import torch

# Dense bf16 tensor-core peaks (TFLOP/s), datasheet values without sparsity.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0,
                    "A800": 312.0, "L40S": 362.0, "A10G": 70.0, "V100": 125.0}


def flops_per_token(num_layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Training FLOPs per token (forward + backward): 72 L h^2 + 12 L h s + 6 h V."""
    return 72.0 * num_layers * hidden**2 + 12.0 * num_layers * hidden * seq + 6.0 * hidden * vocab


def device_peak_tflops(device: torch.device) -> tuple[Optional[float], str]:
    """(peak, description) for the MFU denominator; (None, reason) when unknown (e.g. CPU)."""
    if device.type != "cuda":
        return None, "no GPU peak (CPU run)"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key in name:
            return peak, f"{name} dense bf16 peak {peak:.0f} TFLOP/s"
    return None, f"unknown peak for {name}"


def throughput_fields(tokens_per_iter: float, seconds_per_iter: float, fpt: float, world_size: int,
                      peak: Optional[float]) -> str:
    tokens_per_s = tokens_per_iter / seconds_per_iter
    tflops_per_gpu = fpt * tokens_per_s / world_size / 1e12
    mfu = f"{100 * tflops_per_gpu / peak:.1f}%" if peak else "n/a"
    return f"tokens/s: {tokens_per_s:.0f} | TFLOP/s/GPU: {tflops_per_gpu:.2f} | MFU: {mfu}"


def memory_fields(device: torch.device) -> str:
    if device.type == "cuda":
        mb = 2**20
        return (f"memory (MB) | allocated: {torch.cuda.memory_allocated(device) / mb:.0f} | max allocated: "
                f"{torch.cuda.max_memory_allocated(device) / mb:.0f} | reserved: "
                f"{torch.cuda.memory_reserved(device) / mb:.0f} | max reserved: "
                f"{torch.cuda.max_memory_reserved(device) / mb:.0f}")
    try:
        import resource
        return f"memory (MB) | max RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}"
    except ImportError:
        return "memory: n/a"
