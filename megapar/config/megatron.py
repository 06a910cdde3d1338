"""Megatron-LM's flags that are not settings of megapar's own: the alias switches, resolved into
recompute settings, and the switches whose choice megapar makes itself (accepted so that a Megatron
script runs as written, named in one line at start)."""
from __future__ import annotations

from typing import Any

# Megatron's alias flags: not settings of their own, resolved into recompute_* by `resolve_aliases`.
ALIAS_FLAGS = {
    "recompute_activations": "= --recompute-granularity selective",
    "checkpoint_activations": "old name: = --recompute-granularity full --recompute-method uniform "
                              "--recompute-num-layers 1",
}

# Megatron switches whose choice megapar makes itself: accepted, so that a Megatron script runs as
# written, and named in one line at start. flag -> (what it takes: None a switch, int a number, else
# its choices; why it changes nothing here)
_KERNELS = "torch.compile (--torch-compile) and --attention-backend choose megapar's kernels"
_ONE_IMPL = "megapar has one GPT-2 implementation"
MEGATRON_NOTED: dict[str, tuple[Any, str]] = {
    "--data-impl": (("mmap", "infer"), "megapar reads Megatron's memory-mapped .bin/.idx"),
    "--DDP-impl": (("local", "torch"), "megapar's data parallelism is its own (gradient buffers, ZeRO)"),
    "--use-flash-attn": (None, "attention is torch SDPA's flash kernel unless --attention-backend says otherwise"),
    "--use-mcore-models": (None, _ONE_IMPL),
    "--transformer-impl": (("local", "transformer_engine"), _ONE_IMPL + " (fp8: --fp8-format)"),
    "--no-masked-softmax-fusion": (None, _KERNELS),
    "--no-bias-gelu-fusion": (None, _KERNELS),
    "--no-bias-dropout-fusion": (None, _KERNELS),
    "--attention-softmax-in-fp32": (None, "the softmax always computes in fp32"),
    "--accumulate-allreduce-grads-in-fp32": (None, "gradients always accumulate in fp32 (--grad-reduce-dtype sets "
                                                   "what travels)"),
    "--log-throughput": (None, "every log line has tokens/s, TFLOP/s per GPU and MFU"),
    "--num-workers": (int, "the memory-mapped dataset is read in the training process"),
    "--use-cpu-initialization": (None, "every weight is drawn on the CPU at its full shape, then sliced"),
    "--fp16-lm-cross-entropy": (None, "the loss reads the logits in their own dtype and computes in fp32, with no "
                                      "fp32 copy of them"),
}
NOTED_DEST = "megatron_noted:"   # the parser's dest of a MEGATRON_NOTED flag: this + the flag


def noted_line(noted: dict[str, Any]) -> str:
    """The start-up line naming the MEGATRON_NOTED flags given ({flag: value}) and why each changes nothing."""
    return "> Megatron flags accepted, not acted on: " + "; ".join(
        f"{name}{'' if value is True else f' {value}'} ({MEGATRON_NOTED[name][1]})" for name, value in noted.items())


def resolve_aliases(given: dict[str, Any]) -> dict[str, bool]:
    """--checkpoint-activations / --recompute-activations -> the recompute_* settings of `given` they
    stand for (in place, where `given` sets none); returns them as given."""
    aliases = {name: bool(given.pop(name, False)) for name in ALIAS_FLAGS}
    if aliases["checkpoint_activations"]:
        given.setdefault("recompute_granularity", "full")
        given.setdefault("recompute_method", "uniform")
    if aliases["recompute_activations"]:
        given.setdefault("recompute_granularity", "selective")
    return aliases

