"""Python side of csrc/: loads the compiled CUDA extension and holds the PyTorch reference of
every fused op (the CPU fallback and the test oracle).

`load_fused_kernels()` returns the ahead-of-time module `megapar_kernels` (built by setup.py
when a CUDA torch and nvcc are present) or JIT-builds the same sources once per (source hash,
torch, CUDA, GPU arch) into a cache directory. The JIT build happens in a private temporary
directory that is renamed into place only when it succeeded, so an interrupted or failed build
never leaves a lock file or a half-built module behind. Nothing here falls back silently: a
caller that asks for the fused kernels on a machine without them gets a RuntimeError.
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
SOURCES = ["megapar_kernels.cpp", "softmax.cu", "layernorm.cu", "adamw.cu", "adamw_binding.cpp", "fused_mlp.cu",
           "fused_mlp_binding.cpp"]
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


# cuBLAS headers csrc/ needs (fused_mlp.cu; torch's ATen/cuda/CUDAContextLight.h in its binding).
_CUBLAS_HEADERS = ("cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h")


def _nvidia_wheel_dirs() -> list[Path]:
    """site-packages/nvidia/* of the pip CUDA wheels torch depends on (nvidia/cublas, ... or nvidia/cu13)."""
    spec = importlib.util.find_spec("nvidia")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(p for loc in locs if Path(loc).is_dir() for p in Path(loc).iterdir() if p.is_dir())


def _loaded_cublaslt() -> Optional[Path]:
    """The libcublasLt that torch has loaded into this process (Linux), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and "/libcublasLt.so" in fields[5]:
            return Path(fields[5].strip())
    return None


def cublas_build_flags() -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) for the cuBLASLt calls in csrc/.

    Links the libcublasLt torch itself loaded (by path: pip wheels ship only libcublasLt.so.N,
    which `-lcublasLt` does not find), else one under CUDA_HOME or a pip wheel, else plain
    `-lcublasLt`. Headers missing from CUDA_HOME/include (a toolkit without cuBLAS) are taken
    from the library's own include dir or the wheels, as -isystem dirs searched after CUDA_HOME's."""
    from torch.utils.cpp_extension import CUDA_HOME

    home = [Path(CUDA_HOME)] if CUDA_HOME else []
    lib = _loaded_cublaslt()
    if lib is None:
        libs = [p for root in home + _nvidia_wheel_dirs() for sub in ("lib64", "lib")
                for p in sorted((root / sub).glob("libcublasLt.so*"))]
        lib = libs[0] if libs else None
    ldflags = [str(lib)] if lib is not None else ["-lcublasLt"]
    cflags: list[str] = []
    dirs = ([lib.parent.parent / "include"] if lib is not None else []) + [d / "include" for d in _nvidia_wheel_dirs()]
    for header in _CUBLAS_HEADERS:
        if any((root / "include" / header).exists() for root in home):
            continue
        found = next((str(d) for d in dirs if (d / header).exists()), None)
        if found is not None and found not in cflags:
            cflags += ["-isystem", found]
    return cflags, ldflags


def _missing_reason() -> Optional[str]:
    """Why the fused kernels cannot run here, or None when they can (built or buildable)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if importlib.util.find_spec("megapar_kernels") is None and _nvcc() is None:
        return "the extension was not built ahead of time and nvcc (CUDA_HOME) was not found for a JIT build"
    return None


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
    h.update(repr(cublas_build_flags()).encode())  # which cuBLAS the extension links
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
        cflags, ldflags = cublas_build_flags()
        mod = load(name=JIT_NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=["-O3", *cflags],
             extra_cuda_cflags=NVCC_FLAGS + cflags, extra_ldflags=ldflags, extra_include_paths=[str(CSRC)],
             build_directory=str(tmp),
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
                               "Use --attention-backend flash|torch / --layernorm-impl torch / --mlp-impl torch / "
                               "--adam-impl torch instead.")
        if os.environ.get("MEGAPAR_FORCE_JIT") != "1" and importlib.util.find_spec("megapar_kernels") is not None:
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


__all__ = ["fused_kernels_available", "load_fused_kernels", "fused_kernels_source", "cache_dir"]
