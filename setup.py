"""Installs megapar. The CUDA kernels in csrc/ are compiled ahead of time only when a
CUDA-enabled torch and nvcc are both present; otherwise the install succeeds, says so, and
megapar uses the PyTorch reference implementations (or JIT-builds the kernels on first use
when asked for them explicitly on a CUDA machine)."""
import os
import shutil

from setuptools import find_packages, setup

# Explicit architecture list (Volta..Hopper); override with TORCH_CUDA_ARCH_LIST.
DEFAULT_ARCH_LIST = "7.0;8.0;8.6;9.0"


def _cuda_extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("megapar: torch not importable at build time; fused kernels will use the PyTorch reference")
        return [], {}
    if os.environ.get("MEGAPAR_NO_CUDA_EXT") == "1":
        print("megapar: MEGAPAR_NO_CUDA_EXT=1; skipping the CUDA extension")
        return [], {}
    have_nvcc = CUDA_HOME is not None and shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is not None
    if torch.version.cuda is None or not have_nvcc:
        print("megapar: no CUDA-enabled torch or no nvcc; not building csrc/ "
              "(kernels fall back to the PyTorch reference; --attention-backend fused needs a GPU build)")
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    from megapar.kernels import NVCC_FLAGS, SOURCES  # one list for the AOT and the JIT build
    ext = CUDAExtension(
        name="megapar_kernels",
        sources=[os.path.join("csrc", s) for s in SOURCES],
        include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": NVCC_FLAGS},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extensions()

# The user tools (megapar/cli/); `python tools/<tool>.py` runs the same main.
CLI_TOOLS = ["checkpoint_util", "convert_to_hf", "convert_from_hf", "generate_text", "preprocess_data",
             "train_tokenizer", "estimate_memory", "compare_losses", "plan_layout", "ds_config"]
CONSOLE_SCRIPTS = [f"megapar-{t.replace('_', '-')}=megapar.cli.{t}:main" for t in CLI_TOOLS]

setup(
    name="megapar",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT-2 pretraining in readable PyTorch",
    # data_prep: the OpenWebText pipeline (python -m data_prep.openwebtext.<step>), importable anywhere
    packages=find_packages(include=["megapar", "megapar.*", "data_prep", "data_prep.*"]),
    python_requires=">=3.10",
    install_requires=[l.strip() for l in open("requirements.txt") if l.strip() and not l.startswith("#")],
    # NVIDIA apex is optional and comes from its own repository (PyPI's "apex" is an unrelated project), so it is no
    # extra here. "hf": transformers reads an exported SentencePiece tokenizer.model through protobuf.
    extras_require={"hf": ["transformers", "safetensors", "protobuf"], "wandb": ["wandb"],
                    "tensorboard": ["tensorboard"],
                    "fp8": ["torchao>=0.18"]},
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
