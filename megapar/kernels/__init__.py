"""Python side of csrc/: loads the compiled CUDA extension and holds the PyTorch reference of
every fused op (the CPU fallback and the test oracle).

`load_fused_kernels()` returns the ahead-of-time module `megapar_kernels` (built by setup.py
when a CUDA torch and nvcc are present) or JIT-builds the same sources once per (source hash,
torch, CUDA, GPU arch) into a cache directory. The JIT build happens in a private temporary
directory that is renamed into place only when it succeeded, so an interrupted or failed build
never leaves a lock file or a half-built module behind. Nothing here falls back silently: a
caller that asks for the fused kernels on a machine without them gets a RuntimeError.
Beside them: inductor.py (torch.compile's options), readback.py (device values read back without stalling).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ["megapar_kernels.cpp", "softmax.cu", "layernorm.cu", "adamw.cu", "adamw_binding.cpp"]
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo", "-std=c++17"]
JIT_NAME = "megapar_kernels_jit"

_module: Optional[ModuleType] = None
_source: str = ""  # "aot" or "jit:<path>"
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where JIT builds are cached: $MEGAPAR_KERNEL_CACHE, else ~/.cache/megapar/kernels."""
    env = os.environ.get("MEGAPAR_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megapar" / "kernels"


def _nvcc() -> Optional[str]:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is not None:
        cand = os.path.join(CUDA_HOME, "bin", "nvcc")
        if os.path.exists(cand):
            return cand
    return shutil.which("nvcc")


def _missing_reason() -> Optional[str]:
    """Why the fused kernels cannot run here, or None when they can (built or buildable)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not aot_kernels_installed() and _nvcc() is None:
        return "the extension was not built ahead of time and nvcc (CUDA_HOME) was not found for a JIT build"
    return None


def aot_kernels_installed() -> bool:
    """True when setup.py built the extension ahead of time (a CUDA torch and nvcc at install)."""
    return importlib.util.find_spec("megapar_kernels") is not None


def fused_kernels_available() -> bool:
    """True when the fused CUDA kernels are built or can be JIT-built and a GPU is visible."""
    return _module is not None or _missing_reason() is None


def _build_key() -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.is_file()):  # every source and header
        h.update(path.name.encode())
        h.update(path.read_bytes())
    major, minor = torch.cuda.get_device_capability()
    h.update(f"{torch.__version__}|{torch.version.cuda}|sm_{major}{minor}|{NVCC_FLAGS}".encode())
    return h.hexdigest()[:16]


def _import_from(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(JIT_NAME, str(path))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    final = cache_dir() / _build_key()
    so_files = sorted(final.glob(f"{JIT_NAME}*.so")) if final.is_dir() else []
    if so_files:
        logger.info("megapar: loading cached JIT build of the fused kernels from %s", final)
        return _import_from(so_files[0])
    final.parent.mkdir(parents=True, exist_ok=True)
    major, minor = torch.cuda.get_device_capability()
    logger.warning(
        "megapar: fused kernels were not built ahead of time; JIT-building them for sm_%d%d "
        "(first use only, about a minute; cached in %s)", major, minor, final)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.building-", dir=final.parent))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    try:
        mod = load(name=JIT_NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=["-O3"],
             extra_cuda_cflags=NVCC_FLAGS, extra_include_paths=[str(CSRC)], build_directory=str(tmp),
             verbose=os.environ.get("MEGAPAR_KERNEL_VERBOSE") == "1", is_python_module=True)
        try:
            os.replace(tmp, final)  # atomic publish; a concurrent winner keeps its copy
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"megapar: JIT build of the fused CUDA kernels failed: {e}") from e
    return mod


def load_fused_kernels() -> ModuleType:
    """The compiled extension (AOT `megapar_kernels`, else a cached JIT build).

    Raises RuntimeError with the reason when CUDA, a GPU or nvcc is missing."""
    global _module, _source
    with _lock:
        if _module is not None:
            return _module
        reason = _missing_reason()
        if reason is not None:
            raise RuntimeError(f"megapar: the fused CUDA kernels were requested but cannot run: {reason}. "
                               "Use --attention-backend flash|torch / --layernorm-impl torch / --adam-impl torch "
                               "instead.")
        if os.environ.get("MEGAPAR_FORCE_JIT") != "1" and aot_kernels_installed():
            import megapar_kernels as mod  # type: ignore[import-not-found]
            _module, _source = mod, "aot"
        else:
            _module = _jit_build()
            _source = f"jit:{Path(_module.__file__).parent}"
        logger.info("megapar: fused CUDA kernels loaded (%s)", _source)
        return _module


def fused_kernels_source() -> str:
    """'aot', 'jit:<dir>' or '' when not loaded (for logs)."""
    return _source


def check_impl(impl: str, what: str) -> None:
    if impl not in ("torch", "fused"):
        raise ValueError(f"megapar: unknown {what} implementation {impl!r} (expected 'torch' or 'fused')")


__all__ = ["aot_kernels_installed", "fused_kernels_available", "load_fused_kernels", "fused_kernels_source",
           "cache_dir"]
