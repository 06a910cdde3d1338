"""Named run recipes: the GPU count and the full flag list of each measured run configuration.

A recipe fixes what defines a run's speed and memory: model shape, seq 1024, bf16, micro and global
batch, kernels (torch.compile, CUDA graph, fused AdamW), parallel sizes. It leaves data, tokenizer,
learning-rate schedule and iteration counts to the command line. `--recipe NAME` (or `--recipe=NAME`)
expands to the recipe's flags placed first, so that a flag given on the command line overrides the
recipe's (argparse keeps the last value): `--recipe 345m-tp2 --micro-batch-size 4`.
benchmarks/bench_train.py measures exactly these recipes, so a throughput table row names a run
anyone can repeat. The CPU recipes (`cpu=True`) are for a machine without a GPU: small fp32 models, a
first run in about a minute. `python -m megapar.config.recipes [NAME]` prints the table or one recipe's flags.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from ..topology import ConfigError


@dataclass(frozen=True)
class Recipe:
    """One run configuration: launch it on `gpus` GPUs (a CPU recipe: processes) with `flags` (plus
    data and iteration flags)."""
    gpus: int
    flags: tuple[str, ...]
    about: str
    cpu: bool = False

    def where(self) -> str:
        """Where it runs, e.g. '2 GPU(s)' or 'CPU, 1 process(es)'."""
        return f"CPU, {self.gpus} process(es)" if self.cpu else f"{self.gpus} GPU(s)"


GPT2_124M = ("--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12")
GPT2_345M = ("--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16")
SEQ_1024 = ("--seq-length", "1024", "--max-position-embeddings", "1024")
SEQ_1024_BF16 = (*SEQ_1024, "--bf16")
GPT3_6_7B = ("--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32")
GPT3_13B = ("--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40")
SEQ_2048_BF16 = ("--seq-length", "2048", "--max-position-embeddings", "2048", "--bf16")
GPT_1_3B = ("--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16")
COMPILE = ("--torch-compile",)
# a CUDA graph captures the whole step; fastest with compiled layers and csrc's one-launch AdamW
GRAPH = (*COMPILE, "--enable-cuda-graph", "--adam-impl", "fused")
FULL_RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform")


def _tp(n: int) -> tuple[str, ...]:
    return ("--tensor-model-parallel-size", str(n))


def _pp(n: int) -> tuple[str, ...]:
    return ("--pipeline-model-parallel-size", str(n))


def _zero(stage: int) -> tuple[str, ...]:
    return ("--zero-stage", str(stage))


def _recipe(gpus: int, model: tuple[str, ...], micro: int, global_batch: int, *extra: str, about: str) -> Recipe:
    """A recipe at seq 1024 in bf16 with the given batch sizes and extra flags."""
    batch = ("--micro-batch-size", str(micro), "--global-batch-size", str(global_batch))
    return Recipe(gpus, (*model, *SEQ_1024_BF16, *batch, *extra), about)


RECIPES: dict[str, Recipe] = {
    "124m": _recipe(1, GPT2_124M, 16, 16, about="GPT-2 124M, eager"),
    "345m": _recipe(1, GPT2_345M, 8, 8, about="GPT-2 345M, eager"),
    "345m-fused-ln": _recipe(1, GPT2_345M, 8, 8, "--layernorm-impl", "fused", about="345M with csrc's LayerNorm"),
    "124m-compile": _recipe(1, GPT2_124M, 16, 16, *COMPILE, about="124M, each layer compiled"),
    "345m-compile": _recipe(1, GPT2_345M, 8, 8, *COMPILE, about="345M, each layer compiled"),
    "124m-graph": _recipe(1, GPT2_124M, 16, 16, *GRAPH, about="124M, compiled, whole step one CUDA graph"),
    "345m-graph": _recipe(1, GPT2_345M, 8, 8, *GRAPH, about="345M, compiled, whole step one CUDA graph"),
    "345m-graph-fp16": Recipe(1, (*GPT2_345M, *SEQ_1024, "--fp16", "--initial-loss-scale", "65536",
                                  "--micro-batch-size", "8", "--global-batch-size", "8", *GRAPH),
                              "345M in fp16 with loss scaling, compiled, whole step one CUDA graph"),
    "345m-m8": _recipe(1, GPT2_345M, 8, 64, about="345M, 8 microbatches per step"),
    # the baseline of the pipelines at equal microbatches per step (the optimizer steps once per 8 microbatches)
    "345m-m8-graph": _recipe(1, GPT2_345M, 8, 64, *GRAPH, about="345M, 8 microbatches per step, CUDA graph"),
    "345m-graph-ce": _recipe(1, GPT2_345M, 8, 8, *GRAPH, "--cross-entropy-loss-fusion",
                             about="345m-graph with the LM head and loss fused in chunks"),
    "345m-recompute": _recipe(1, GPT2_345M, 8, 8, *FULL_RECOMPUTE, about="345M, full activation recompute"),
    "345m-recompute-graph": _recipe(1, GPT2_345M, 8, 8, *FULL_RECOMPUTE, *GRAPH, "--hidden-dropout", "0",
                                    "--attention-dropout", "0", about="345M, full activation recompute, CUDA graph"),
    "345m-dp2": _recipe(2, GPT2_345M, 8, 16, about="345M, data parallel 2"),
    "345m-dp4": _recipe(4, GPT2_345M, 8, 32, about="345M, data parallel 4"),
    "345m-dp4-zero1": _recipe(4, GPT2_345M, 8, 32, "--use-distributed-optimizer",
                              about="345M, data parallel 4, ZeRO-1"),
    "345m-tp2": _recipe(2, GPT2_345M, 8, 8, *_tp(2), about="345M, tensor parallel 2"),
    "345m-tp2-graph": _recipe(2, GPT2_345M, 8, 8, *_tp(2), *GRAPH, about="345M, tensor parallel 2, CUDA graph"),
    "345m-tp2-sp": _recipe(2, GPT2_345M, 8, 8, *_tp(2), "--sequence-parallel",
                           about="345M, tensor parallel 2, sequence parallel"),
    "345m-pp2-m8": _recipe(2, GPT2_345M, 8, 64, *_pp(2), about="345M, pipeline parallel 2, 8 microbatches"),
    "345m-pp4-m8": _recipe(4, GPT2_345M, 8, 64, *_pp(4), about="345M, pipeline parallel 4, 8 microbatches"),
    # the last stage also runs the LM head and the loss: give it fewer layers
    "345m-pp2-m8-last11": _recipe(2, GPT2_345M, 8, 64, *_pp(2), "--decoder-last-pipeline-num-layers", "11",
                                  about="345M, pipeline parallel 2, last stage 11 layers"),
    "345m-pp4-m8-last3": _recipe(4, GPT2_345M, 8, 64, *_pp(4), "--decoder-last-pipeline-num-layers", "3",
                                 about="345M, pipeline parallel 4, last stage 3 layers"),
    # interleaved 1F1B: 2 model chunks per rank; the bubble (pp - 1) / m shrinks to (pp - 1) / (2 m)
    "345m-pp2-m8-v2": _recipe(2, GPT2_345M, 8, 64, *_pp(2), "--virtual-pipeline-model-parallel-size", "2",
                              about="345M, pipeline parallel 2, 8 microbatches, interleaved (2 chunks per rank)"),
    "345m-pp2-m8-graph": _recipe(2, GPT2_345M, 8, 64, *_pp(2), *GRAPH,
                                 about="345M, pipeline parallel 2, 8 microbatches, CUDA graph"),
    # ZB-H1: the same run with each backward split in two and the weight gradients filling the cooldown bubble
    "345m-pp2-m8-zb-graph": _recipe(2, GPT2_345M, 8, 64, *_pp(2), "--enable-zero-bubble", *GRAPH,
                                    about="345M, pipeline parallel 2, 8 microbatches, zero-bubble (ZB-H1), CUDA graph"),
    "345m-pp2-m8-v2-graph": _recipe(2, GPT2_345M, 8, 64, *_pp(2), "--virtual-pipeline-model-parallel-size", "2",
                                    *GRAPH, about="345M, pipeline parallel 2, 8 microbatches, interleaved, CUDA graph"),
    "345m-pp4-m8-v2": _recipe(4, GPT2_345M, 8, 64, *_pp(4), "--virtual-pipeline-model-parallel-size", "2",
                              about="345M, pipeline parallel 4, 8 microbatches, interleaved (2 chunks per rank)"),
    "345m-tp2-pp2": _recipe(4, GPT2_345M, 8, 64, *_tp(2), *_pp(2), "--use-distributed-optimizer",
                            about="345M, tensor 2 x pipeline 2, ZeRO-1"),
    **{f"345m-compile-zero{z}": _recipe(1, GPT2_345M, 8, 8, *COMPILE, *_zero(z), about=f"345M compiled, ZeRO-{z}")
       for z in (1, 2, 3)},
    **{f"345m-dp2-zero{z}": _recipe(2, GPT2_345M, 8, 16, *COMPILE, *_zero(z),
                                    about=f"345M compiled, data parallel 2, ZeRO-{z}") for z in (1, 2, 3)},
    **{f"345m-dp2-zero{z}-graph": _recipe(2, GPT2_345M, 8, 16, *GRAPH, *_zero(z),
                                          about=f"345M, data parallel 2, ZeRO-{z}, CUDA graph") for z in (1, 2, 3)},
    # GPT-3's 1.3B shape (24 layers, hidden 2048, 16 heads) at seq 1024, as measured against nanoGPT's bench.py
    "1.3b-graph": _recipe(1, GPT_1_3B, 8, 8, *GRAPH, about="1.3B shape, compiled, whole step one CUDA graph"),
    "1.3b-graph-ce": _recipe(1, GPT_1_3B, 8, 8, *GRAPH, "--cross-entropy-loss-fusion",
                             about="1.3b-graph with the LM head and loss fused in chunks"),
    # the same shape's layers split over two GPUs (tp 2 strong scaling against 1.3b-graph)
    "1.3b-tp2-graph": _recipe(2, GPT_1_3B, 8, 8, *_tp(2), *GRAPH, about="1.3B shape, tensor parallel 2, CUDA graph"),
    "1.3b-tp2-sp-graph": _recipe(2, GPT_1_3B, 8, 8, *_tp(2), "--sequence-parallel", *GRAPH,
                                 about="1.3B shape, tensor and sequence parallel 2, CUDA graph"),
    # the same shape on two GPUs, as measured against DeepSpeed ZeRO and FSDP2 without recompute (estimate_memory at
    # micro-batch 8: 29.0 GiB per GPU at ZeRO-1, 27.1 at ZeRO-2, 26.2 at ZeRO-3)
    **{f"1.3b-dp2-zero{z}": _recipe(2, GPT_1_3B, 8, 16, *COMPILE, *_zero(z),
                                    about=f"1.3B compiled, data parallel 2, ZeRO-{z}") for z in (1, 2, 3)},
    **{f"1.3b-dp2-zero{z}-graph": _recipe(2, GPT_1_3B, 8, 16, *GRAPH, *_zero(z),
                                          about=f"1.3B, data parallel 2, ZeRO-{z}, CUDA graph") for z in (1, 2, 3)},
    # GPT-3's 1.3B shape at seq 2048 on one GPU (estimate_memory: 50.6 GiB at micro-batch 8): bf16 vs fp8 GEMMs
    "1.3b-compile": Recipe(1, (*GPT_1_3B, *SEQ_2048_BF16, "--micro-batch-size", "8", "--global-batch-size", "8",
                               *COMPILE), "1.3B (24 layers, hidden 2048, seq 2048), compiled"),
    "1.3b-fp8": Recipe(1, (*GPT_1_3B, *SEQ_2048_BF16, "--micro-batch-size", "8", "--global-batch-size", "8",
                           *COMPILE, "--fp8-format", "hybrid"),
                       "1.3B compiled, the transformer GEMMs in fp8 (hybrid, tensorwise; Hopper/Ada, torchao)"),
    # models larger than one GPU holds: seq 2048 as GPT-3
    "6.7b-offload": Recipe(1, (*GPT3_6_7B, *SEQ_2048_BF16, "--micro-batch-size", "2", "--global-batch-size", "128",
                               *_zero(2), "--optimizer-cpu-offload"),
                           "GPT-3 6.7B on one GPU: ZeRO-2 with the optimizer on the CPU"),
    "13b-dp2-zero3": Recipe(2, (*GPT3_13B, *SEQ_2048_BF16, "--micro-batch-size", "1", "--global-batch-size", "32",
                                *_zero(3), "--recompute-granularity", "full"),
                            "GPT-3 13B on two GPUs: ZeRO-3, full recompute"),
    # estimate_memory: 53.8 GiB per GPU, 95.8 GiB of host memory per rank (+12 GiB with --delayed-param-update)
    "13b-dp2-zero3-offload": Recipe(2, (*GPT3_13B, *SEQ_2048_BF16, "--micro-batch-size", "1",
                                        "--global-batch-size", "32", *_zero(3), "--optimizer-cpu-offload"),
                                    "GPT-3 13B on two GPUs: ZeRO-3 with the optimizer on the CPU, no recompute"),
    # the embedded default's 300 iterations in about a minute on 2 CPU cores (its own model takes minutes)
    "cpu-tiny": Recipe(1, ("--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                           "--seq-length", "64", "--max-position-embeddings", "64",
                           "--micro-batch-size", "4", "--global-batch-size", "4"),
                       "CPU, fp32: 2 layers, hidden 128, seq 64, batch 4", cpu=True),
}


def recipe(name: str) -> Recipe:
    """The recipe called `name`; ConfigError (one line naming every recipe) if there is none."""
    if name not in RECIPES:
        raise ConfigError(f"unknown --recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_names(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(recipe names in order, argv without the --recipe flags)."""
    names, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--recipe":
            if i + 1 == len(argv):
                raise ConfigError(f"--recipe needs a name; choose one of: {', '.join(RECIPES)}")
            names.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--recipe="):
            names.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return names, rest


def expand_recipes(argv: Optional[Sequence[str]]) -> list[str]:
    """argv with every `--recipe NAME` / `--recipe=NAME` replaced by that recipe's flags, placed
    first (in the order the recipes were given) so that the flags in argv override them.
    argv None means sys.argv[1:], as for argparse."""
    names, rest = recipe_names(list(sys.argv[1:] if argv is None else argv))
    return [flag for name in names for flag in recipe(name).flags] + rest


def command_line(name: str) -> str:
    """The recipe's flags as one shell-quoted line."""
    return " ".join(shlex.quote(f) for f in recipe(name).flags)


def describe() -> str:
    """The table of recipes: name, GPUs, what it is, its flags (markdown)."""
    rows = ["| recipe | GPUs | run | flags |", "|---|---|---|---|"]
    rows += [f"| {name} | {'CPU' if r.cpu else r.gpus} | {r.about} | `{command_line(name)}` |"
             for name, r in RECIPES.items()]
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m megapar.config.recipes` prints the table; with a NAME, that recipe's GPU count and flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m megapar.config.recipes [NAME]\n\nWithout NAME: the table of recipes. With NAME: "
              "the GPUs that recipe needs and the flags it stands for (training takes it as --recipe NAME).")
        return 0
    try:
        print(f"# {recipe(argv[0]).where()}\n{command_line(argv[0])}" if argv else describe())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
