"""Named run recipes: the GPU count and the full flag list of each measured run configuration.

A recipe is a value: the settings ({dest: value}) it fixes, built by small functions below, rendered
as flags by `flag_words`. It fixes what defines a run's speed and memory: model shape, seq 1024, bf16, micro and global
batch, kernels (torch.compile, CUDA graph, fused AdamW), parallel sizes. It leaves data, tokenizer,
learning-rate schedule and iteration counts to the command line. `--recipe NAME` (or `--recipe=NAME`)
is an overlay below the command line (overlays.py), so that a flag given on the command line overrides
the recipe's: `--recipe 345m-tp2 --micro-batch-size 4`.
benchmarks/bench_train.py measures exactly these recipes, so a throughput table row names a run
anyone can repeat. The CPU recipes (`cpu=True`) are for a machine without a GPU: small fp32 models, a
first run in about a minute. `python -m megapar.config.recipes [NAME]` prints the table or one recipe's flags.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .settings import ConfigError, flag_words


@dataclass(frozen=True)
class Recipe:
    """One run configuration: launch it on `gpus` GPUs (a CPU recipe: processes) with the settings
    `values` ({dest: value}, plus data and iteration flags)."""
    gpus: int
    values: dict[str, Any]
    about: str
    cpu: bool = False

    @property
    def flags(self) -> tuple[str, ...]:
        """The command-line words of its values (`flag_words`), in their order."""
        return words(self.values)

    def where(self) -> str:
        """Where it runs, e.g. '2 GPU(s)' or 'CPU, 1 process(es)'."""
        return f"CPU, {self.gpus} process(es)" if self.cpu else f"{self.gpus} GPU(s)"


def words(values: dict[str, Any]) -> tuple[str, ...]:
    """Settings as command-line words: `{"num_layers": 24}` -> ("--num-layers", "24")."""
    return tuple(w for name, value in values.items() for w in flag_words(name, value))


def shape(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """A model shape: layers, hidden size, attention heads."""
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads}


def seq(n: int) -> dict[str, Any]:
    """Samples of `n` tokens, as many position embeddings."""
    return {"seq_length": n, "max_position_embeddings": n}


def batch(micro: int, global_batch: int) -> dict[str, Any]:
    return {"micro_batch_size": micro, "global_batch_size": global_batch}


GPT2_124M = shape(12, 768, 12)
GPT2_345M = shape(24, 1024, 16)
GPT3_6_7B = shape(32, 4096, 32)
GPT3_13B = shape(40, 5120, 40)
GPT_1_3B = shape(24, 2048, 16)
SEQ_1024_BF16 = {**seq(1024), "bf16": True}
SEQ_2048_BF16 = {**seq(2048), "bf16": True}
COMPILE = {"torch_compile": True}
# a CUDA graph captures the whole step; fastest with compiled layers and csrc's one-launch AdamW
GRAPH = {**COMPILE, "enable_cuda_graph": True, "adam_impl": "fused"}
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform"}
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def _tp(n: int) -> dict[str, Any]:
    return {"tensor_model_parallel_size": n}


def _pp(n: int) -> dict[str, Any]:
    return {"pipeline_model_parallel_size": n}


def _zero(stage: int) -> dict[str, Any]:
    return {"zero_stage": stage}


def _v2() -> dict[str, Any]:
    return {"virtual_pipeline_model_parallel_size": 2}


def _recipe(gpus: int, model: dict[str, Any], micro: int, global_batch: int, *extra: dict[str, Any],
            about: str) -> Recipe:
    """A recipe at seq 1024 in bf16 with the given batch sizes and extra settings."""
    values = {**model, **SEQ_1024_BF16, **batch(micro, global_batch)}
    for more in extra:
        values.update(more)
    return Recipe(gpus, values, about)


RECIPES: dict[str, Recipe] = {
    "124m": _recipe(1, GPT2_124M, 16, 16, about="GPT-2 124M, eager"),
    "345m": _recipe(1, GPT2_345M, 8, 8, about="GPT-2 345M, eager"),
    "345m-fused-ln": _recipe(1, GPT2_345M, 8, 8, {"layernorm_impl": "fused"}, about="345M with csrc's LayerNorm"),
    "124m-compile": _recipe(1, GPT2_124M, 16, 16, COMPILE, about="124M, each layer compiled"),
    "345m-compile": _recipe(1, GPT2_345M, 8, 8, COMPILE, about="345M, each layer compiled"),
    "124m-graph": _recipe(1, GPT2_124M, 16, 16, GRAPH, about="124M, compiled, whole step one CUDA graph"),
    "345m-graph": _recipe(1, GPT2_345M, 8, 8, GRAPH, about="345M, compiled, whole step one CUDA graph"),
    "345m-graph-fp16": Recipe(1, {**GPT2_345M, **seq(1024), "fp16": True, "initial_loss_scale": 65536.0,
                                  **batch(8, 8), **GRAPH},
                              "345M in fp16 with loss scaling, compiled, whole step one CUDA graph"),
    "345m-m8": _recipe(1, GPT2_345M, 8, 64, about="345M, 8 microbatches per step"),
    # the baseline of the pipelines at equal microbatches per step (the optimizer steps once per 8 microbatches)
    "345m-m8-graph": _recipe(1, GPT2_345M, 8, 64, GRAPH, about="345M, 8 microbatches per step, CUDA graph"),
    "345m-graph-ce": _recipe(1, GPT2_345M, 8, 8, GRAPH, {"cross_entropy_loss_fusion": True},
                             about="345m-graph with the LM head and loss fused in chunks"),
    "345m-recompute": _recipe(1, GPT2_345M, 8, 8, FULL_RECOMPUTE, about="345M, full activation recompute"),
    "345m-recompute-graph": _recipe(1, GPT2_345M, 8, 8, FULL_RECOMPUTE, GRAPH, NO_DROPOUT,
                                    about="345M, full activation recompute, CUDA graph"),
    "345m-dp2": _recipe(2, GPT2_345M, 8, 16, about="345M, data parallel 2"),
    "345m-dp4": _recipe(4, GPT2_345M, 8, 32, about="345M, data parallel 4"),
    "345m-dp4-zero1": _recipe(4, GPT2_345M, 8, 32, {"use_distributed_optimizer": True},
                              about="345M, data parallel 4, ZeRO-1"),
    "345m-tp2": _recipe(2, GPT2_345M, 8, 8, _tp(2), about="345M, tensor parallel 2"),
    "345m-tp2-graph": _recipe(2, GPT2_345M, 8, 8, _tp(2), GRAPH, about="345M, tensor parallel 2, CUDA graph"),
    "345m-tp2-sp": _recipe(2, GPT2_345M, 8, 8, _tp(2), {"sequence_parallel": True},
                           about="345M, tensor parallel 2, sequence parallel"),
    "345m-pp2-m8": _recipe(2, GPT2_345M, 8, 64, _pp(2), about="345M, pipeline parallel 2, 8 microbatches"),
    "345m-pp4-m8": _recipe(4, GPT2_345M, 8, 64, _pp(4), about="345M, pipeline parallel 4, 8 microbatches"),
    # the last stage also runs the LM head and the loss: give it fewer layers
    "345m-pp2-m8-last11": _recipe(2, GPT2_345M, 8, 64, _pp(2), {"decoder_last_pipeline_num_layers": 11},
                                  about="345M, pipeline parallel 2, last stage 11 layers"),
    "345m-pp4-m8-last3": _recipe(4, GPT2_345M, 8, 64, _pp(4), {"decoder_last_pipeline_num_layers": 3},
                                 about="345M, pipeline parallel 4, last stage 3 layers"),
    # interleaved 1F1B: 2 model chunks per rank; the bubble (pp - 1) / m shrinks to (pp - 1) / (2 m)
    "345m-pp2-m8-v2": _recipe(2, GPT2_345M, 8, 64, _pp(2), _v2(),
                              about="345M, pipeline parallel 2, 8 microbatches, interleaved (2 chunks per rank)"),
    "345m-pp2-m8-graph": _recipe(2, GPT2_345M, 8, 64, _pp(2), GRAPH,
                                 about="345M, pipeline parallel 2, 8 microbatches, CUDA graph"),
    # ZB-H1: the same run with each backward split in two and the weight gradients filling the cooldown bubble
    "345m-pp2-m8-zb-graph": _recipe(2, GPT2_345M, 8, 64, _pp(2), {"enable_zero_bubble": True}, GRAPH,
                                    about="345M, pipeline parallel 2, 8 microbatches, zero-bubble (ZB-H1), CUDA graph"),
    "345m-pp2-m8-v2-graph": _recipe(2, GPT2_345M, 8, 64, _pp(2), _v2(), GRAPH,
                                    about="345M, pipeline parallel 2, 8 microbatches, interleaved, CUDA graph"),
    "345m-pp4-m8-v2": _recipe(4, GPT2_345M, 8, 64, _pp(4), _v2(),
                              about="345M, pipeline parallel 4, 8 microbatches, interleaved (2 chunks per rank)"),
    "345m-tp2-pp2": _recipe(4, GPT2_345M, 8, 64, _tp(2), _pp(2), {"use_distributed_optimizer": True},
                            about="345M, tensor 2 x pipeline 2, ZeRO-1"),
    **{f"345m-compile-zero{z}": _recipe(1, GPT2_345M, 8, 8, COMPILE, _zero(z), about=f"345M compiled, ZeRO-{z}")
       for z in (1, 2, 3)},
    **{f"345m-dp2-zero{z}": _recipe(2, GPT2_345M, 8, 16, COMPILE, _zero(z),
                                    about=f"345M compiled, data parallel 2, ZeRO-{z}") for z in (1, 2, 3)},
    **{f"345m-dp2-zero{z}-graph": _recipe(2, GPT2_345M, 8, 16, GRAPH, _zero(z),
                                          about=f"345M, data parallel 2, ZeRO-{z}, CUDA graph") for z in (1, 2, 3)},
    # GPT-3's 1.3B shape (24 layers, hidden 2048, 16 heads) at seq 1024, as measured against nanoGPT's bench.py
    "1.3b-graph": _recipe(1, GPT_1_3B, 8, 8, GRAPH, about="1.3B shape, compiled, whole step one CUDA graph"),
    "1.3b-graph-ce": _recipe(1, GPT_1_3B, 8, 8, GRAPH, {"cross_entropy_loss_fusion": True},
                             about="1.3b-graph with the LM head and loss fused in chunks"),
    # the same shape's layers split over two GPUs (tp 2 strong scaling against 1.3b-graph)
    "1.3b-tp2-graph": _recipe(2, GPT_1_3B, 8, 8, _tp(2), GRAPH, about="1.3B shape, tensor parallel 2, CUDA graph"),
    "1.3b-tp2-sp-graph": _recipe(2, GPT_1_3B, 8, 8, _tp(2), {"sequence_parallel": True}, GRAPH,
                                 about="1.3B shape, tensor and sequence parallel 2, CUDA graph"),
    # the same shape on two GPUs, as measured against DeepSpeed ZeRO and FSDP2 without recompute (estimate_memory at
    # micro-batch 8: 29.0 GiB per GPU at ZeRO-1, 27.1 at ZeRO-2, 26.2 at ZeRO-3)
    **{f"1.3b-dp2-zero{z}": _recipe(2, GPT_1_3B, 8, 16, COMPILE, _zero(z),
                                    about=f"1.3B compiled, data parallel 2, ZeRO-{z}") for z in (1, 2, 3)},
    **{f"1.3b-dp2-zero{z}-graph": _recipe(2, GPT_1_3B, 8, 16, GRAPH, _zero(z),
                                          about=f"1.3B, data parallel 2, ZeRO-{z}, CUDA graph") for z in (1, 2, 3)},
    # GPT-3's 1.3B shape at seq 2048 on one GPU (estimate_memory: 50.6 GiB at micro-batch 8): bf16 vs fp8 GEMMs
    "1.3b-compile": Recipe(1, {**GPT_1_3B, **SEQ_2048_BF16, **batch(8, 8), **COMPILE},
                           "1.3B (24 layers, hidden 2048, seq 2048), compiled"),
    "1.3b-fp8": Recipe(1, {**GPT_1_3B, **SEQ_2048_BF16, **batch(8, 8), **COMPILE, "fp8_format": "hybrid"},
                       "1.3B compiled, the transformer GEMMs in fp8 (hybrid, tensorwise; Hopper/Ada, torchao)"),
    # models larger than one GPU holds: seq 2048 as GPT-3
    "6.7b-offload": Recipe(1, {**GPT3_6_7B, **SEQ_2048_BF16, **batch(2, 128), **_zero(2),
                               "optimizer_cpu_offload": True},
                           "GPT-3 6.7B on one GPU: ZeRO-2 with the optimizer on the CPU"),
    "13b-dp2-zero3": Recipe(2, {**GPT3_13B, **SEQ_2048_BF16, **batch(1, 32), **_zero(3),
                                "recompute_granularity": "full"},
                            "GPT-3 13B on two GPUs: ZeRO-3, full recompute"),
    # estimate_memory: 53.8 GiB per GPU, 95.8 GiB of host memory per rank (+12 GiB with --delayed-param-update)
    "13b-dp2-zero3-offload": Recipe(2, {**GPT3_13B, **SEQ_2048_BF16, **batch(1, 32), **_zero(3),
                                        "optimizer_cpu_offload": True},
                                    "GPT-3 13B on two GPUs: ZeRO-3 with the optimizer on the CPU, no recompute"),
    # the embedded default's 300 iterations in about a minute on 2 CPU cores (its own model takes minutes)
    "cpu-tiny": Recipe(1, {**shape(2, 128, 4), **seq(64), **batch(4, 4)},
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
