"""F.linear whose weight and bias gradients go straight into the fp32 gradient buffer.

Megatron's --gradient-accumulation-fusion, without apex. Unfused, a bf16 weight's gradient takes
three trips through memory each microbatch: the weight-gradient GEMM writes a bf16 tensor, autograd
hands it to the parameter, and the GradBuffer hook adds it into the fp32 `main_grad`; each weight
and bias also costs a Python hook call and a kernel launch. Fused, the GEMM itself accumulates in
fp32 into `main_grad` (cuBLAS with bf16 inputs, an fp32 C and beta = 1:
`torch.addmm(..., out_dtype=float32)`), the bias gradient is added to its `main_grad` without a
hook, and autograd receives no gradient for either (no dummy to allocate, hand over and free):
it still runs the GradBuffer's per-parameter post-accumulate-grad hook, with `p.grad` None, which
adds nothing but drives the bucketed all-reduce
(`tests/tensor_parallel/test_wgrad_fusion.py::test_fused_parameters_get_no_gradient_but_their_hooks_run`). Tried
against a 345M H100 profile that put several ms of the step in the unfused path; the step's wall
time moved by less than the run-to-run spread (it is partly launch-bound;
docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured).

A parameter takes this path only when its layer marked it `fused_grad_accumulation` and it has a
`main_grad` (set by the GradBuffer); the hook reads the same mark. Under torch.compile the
accumulations are custom ops, so the compiler keeps them (and their in-place writes) intact.

Column-parallel layers pass their TP group (`grad_x_group`): backward then all-reduces the input
gradient asynchronously and computes the weight gradient while it travels (Megatron's async
tensor-parallel all-reduce), instead of a separate all-reduce after the whole backward of the layer
(mappings.copy_to_tp), which also cloned the gradient first; GPT-2 345M at tp 2 (compiled, CUDA
graph) measured faster on 2x H200 (docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured). With
sequence parallelism forward
all-gathers the input's sequence first and backward reduce-scatters the input gradient instead
(both Megatron's; the gathered input is kept for the weight gradient, not gathered again).

Zero-bubble pipeline schedules (--enable-zero-bubble, wgrad_store.py) split the backward in two: a
weight that carries a `WeightGradStore` (`wgrad_store`) has its weight-gradient GEMM queued as
work for the schedule's W pass when its backward runs inside the store's `deferring()`; the input
gradient and the bias gradient are computed at once. Such layers run eagerly under torch.compile,
like the tensor-parallel ones (the queue is Python state a traced backward cannot hold).

An fp8 layer (--fp8-format, megapar/fp8.py) computes its GEMM through torchao's float8 autograd
function instead; its weight is not marked `fused_grad_accumulation` (torchao returns a bf16 weight
gradient, which the GradBuffer hook adds to `main_grad`) and its bias is added by `add_bias`.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..topology import ConfigError
from .mappings import Group, all_gather_dim0, reduce_scatter_dim0, to_tp_region, tp_world

if TYPE_CHECKING:
    from ..fp8 import Fp8Gemm
    from .wgrad_store import WeightGradStore


def _add_wgrad_(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad [out, in] += grad_out^T [out, T] @ x [T, in], accumulated in main_grad's dtype."""
    if main_grad.is_cuda and grad_out.dtype != main_grad.dtype:
        torch.addmm(main_grad, grad_out.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    elif grad_out.dtype != main_grad.dtype:  # CPU: no mixed-dtype GEMM
        main_grad.addmm_(grad_out.t().to(main_grad.dtype), x.to(main_grad.dtype))
    else:  # an fp32 model
        main_grad.addmm_(grad_out.t(), x)


def _add_bgrad_(main_grad: torch.Tensor, grad_out: torch.Tensor, gemv: bool) -> None:
    """main_grad [out] += grad_out [T, out] summed over tokens.

    gemv (GPU, bf16/fp16 grad_out): [1, out] += ones [1, T] @ grad_out [T, out], accumulated in fp32
    by cuBLAS. On a 345M H100 step it cut GPU time against torch's column sum (grad_out.sum(0), then
    an fp32 add) and made the CUDA-graphed step faster. Without a graph it made the compiled step much
    slower (twice), although the profiler showed it cheaper on the CPU and on the GPU (numbers in
    docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured); until that is understood only
    graphed runs use it (`use_gemv_bias_grads`), in their eager warm-up steps too, so the capture meets no new
    kernel."""
    if gemv and main_grad.is_cuda and grad_out.dtype != main_grad.dtype:
        row = main_grad.view(1, -1)
        ones = torch.ones(1, grad_out.shape[0], dtype=grad_out.dtype, device=grad_out.device)
        torch.addmm(row, ones, grad_out, out_dtype=main_grad.dtype, out=row)
    else:
        main_grad.add_(grad_out.sum(0))


# The same accumulations as operators whose schema says they write main_grad, so torch.compile keeps
# them (and their in-place writes) intact. Defined with torch.library.Library rather than the
# torch.library.custom_op decorator, whose Python wrapper costs several times the accumulation itself
# on every call (docs/benchmarks/host-overhead_cpu_20261126.md#host-overhead-per-layer).
_OPS = torch.library.Library("megapar", "DEF")
_OPS.define("accumulate_wgrad_(Tensor(a!) main_grad, Tensor grad_out, Tensor x) -> ()")
_OPS.define("accumulate_bgrad_(Tensor(a!) main_grad, Tensor grad_out, bool gemv) -> ()")
_OPS.impl("accumulate_wgrad_", _add_wgrad_, "CompositeExplicitAutograd")
_OPS.impl("accumulate_bgrad_", _add_bgrad_, "CompositeExplicitAutograd")
_wgrad_op = torch.ops.megapar.accumulate_wgrad_.default
_bgrad_op = torch.ops.megapar.accumulate_bgrad_.default


@torch.library.register_fake("megapar::accumulate_wgrad_")
def _(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    return None


@torch.library.register_fake("megapar::accumulate_bgrad_")
def _(main_grad: torch.Tensor, grad_out: torch.Tensor, gemv: bool) -> None:
    return None


def accumulate_wgrad_(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """_add_wgrad_, through its operator while torch.compile traces, called directly otherwise (the
    dispatcher's round trip into Python is host time a small layer's eager step does not need)."""
    (_wgrad_op if torch.compiler.is_compiling() else _add_wgrad_)(main_grad, grad_out, x)


def accumulate_bgrad_(main_grad: torch.Tensor, grad_out: torch.Tensor, gemv: bool) -> None:
    """_add_bgrad_, through its operator while torch.compile traces (as accumulate_wgrad_)."""
    (_bgrad_op if torch.compiler.is_compiling() else _add_bgrad_)(main_grad, grad_out, gemv)


class _LinearAccumulateGrad(torch.autograd.Function):
    """forward: x W^T + b (x all-gathered along dim 0 first with sequence_parallel; with bias_after_gemm
    the bias is added to the GEMM's rounded output, as a separate add would);
    backward: dx = g W (all-reduced, or reduce-scattered with sequence_parallel, over grad_x_group,
    overlapping the next two), W.main_grad += g^T x (or, inside a zero-bubble B, queued in
    wgrad_store for the schedule's W), b.main_grad += sum(g), dW, db = None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                weight_main_grad: torch.Tensor, bias_main_grad: Optional[torch.Tensor], gemv: bool,
                grad_x_group: Group, sequence_parallel: bool, bias_after_gemm: bool,
                wgrad_store: Optional["WeightGradStore"] = None) -> torch.Tensor:
        if sequence_parallel:
            x = all_gather_dim0(x, grad_x_group)                                  # [s/tp, b, in] -> [s, b, in]
        ctx.save_for_backward(x, weight)
        # not saved tensors: every accumulation into the buffer bumps their version
        ctx.weight_main_grad, ctx.bias_main_grad, ctx.gemv = weight_main_grad, bias_main_grad, gemv
        ctx.grad_x_group, ctx.sequence_parallel, ctx.wgrad_store = grad_x_group, sequence_parallel, wgrad_store
        if bias_after_gemm:
            return F.linear(x, weight) + bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])                         # [T, out]
        grad_x = g2d.mm(weight).view(*grad_out.shape[:-1], weight.shape[1])    # [*, in]
        pending, group = None, ctx.grad_x_group
        if ctx.sequence_parallel:  # reduced in the background                 # [s/tp, b, in]
            grad_x, pending = reduce_scatter_dim0(grad_x, group, async_op=True)
        elif tp_world(group) > 1:  # grad_x is ours alone: reduced in place, in the background
            pending = dist.all_reduce(grad_x, group=group, async_op=True)
        x2d, store = x.reshape(-1, x.shape[-1]), ctx.wgrad_store                # [T, in]
        if store is None or not store.defer(functools.partial(accumulate_wgrad_, ctx.weight_main_grad, g2d, x2d)):
            accumulate_wgrad_(ctx.weight_main_grad, g2d, x2d)                   # [out, in] += [out, T] @ [T, in]
        if ctx.bias_main_grad is not None:
            accumulate_bgrad_(ctx.bias_main_grad, g2d, ctx.gemv)
        if pending is not None:
            pending.wait()
        return grad_x, None, None, None, None, None, None, None, None, None


class _BiasAddAccumulateGrad(torch.autograd.Function):
    """forward: y + b; backward: dy = g, b.main_grad += sum(g), db = None."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, bias_main_grad: torch.Tensor, gemv: bool) -> torch.Tensor:
        ctx.bias_main_grad, ctx.gemv = bias_main_grad, gemv
        return y + bias

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        accumulate_bgrad_(ctx.bias_main_grad, grad_out.reshape(-1, grad_out.shape[-1]), ctx.gemv)
        return grad_out, None, None, None


def _apply(fn: type[torch.autograd.Function], *args) -> torch.Tensor:
    """fn.apply(*args); in eager mode through the C++ apply beneath torch.autograd.Function.apply,
    whose Python layer, on every call, binds arguments for a `setup_context` (this file's Functions
    define none), routes functorch transforms (checked here) and unwraps dead functorch wrappers
    (tensors that escaped a finished transform; training has none). torch.compile traces the
    public `apply`."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*args)


@functools.cache
def _hooks_run_without_gradient() -> bool:
    """Whether autograd runs a leaf's post-accumulate-grad hook when backward hands it no gradient."""
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, g: torch.Tensor):
            return g, None
    w, ran = torch.zeros(1, requires_grad=True), []
    w.register_post_accumulate_grad_hook(lambda _: ran.append(True))
    Probe.apply(torch.zeros(1, requires_grad=True), w).sum().backward()
    return bool(ran)


def require_hooks_without_gradient(params) -> None:
    """Gradient buffers whose reductions count fused parameters (among `params`) through their
    post-accumulate-grad hooks rely on autograd running them although the fused backward hands those
    parameters no gradient (torch does; undocumented). Refuse a torch that does not, rather than
    lose gradients."""
    if any(getattr(p, "fused_grad_accumulation", False) for p in params) and not _hooks_run_without_gradient():
        raise ConfigError(f"torch {torch.__version__} does not run a parameter's post-accumulate-grad hook when "
                          f"backward gives it no gradient, which the fused gradient accumulation relies on; add "
                          f"--no-gradient-accumulation-fusion or use a newer torch")


def fuses(p: Optional[nn.Parameter]) -> bool:
    """True when backward accumulates p's gradient into p.main_grad itself (and hands autograd none)."""
    return p is not None and getattr(p, "fused_grad_accumulation", False) and hasattr(p, "main_grad")


def use_gemv_bias_grads(params) -> None:
    """Accumulate these biases' gradients with a GEMV (accumulate_bgrad_): for CUDA-graphed steps."""
    for p in params:
        p.bias_grad_gemv = True


def _gemv(bias: Optional[nn.Parameter]) -> bool:
    return getattr(bias, "bias_grad_gemv", False)


def _active(p: nn.Parameter) -> bool:
    return fuses(p) and p.requires_grad and torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: nn.Parameter, bias: Optional[nn.Parameter] = None,
           grad_x_group: Group = None, sequence_parallel: bool = False,
           fp8: Optional["Fp8Gemm"] = None, bias_after_gemm: bool = False) -> torch.Tensor:
    """F.linear, with the gradients accumulated into `main_grad` when the parameters allow it.

    grad_x_group: x is replicated over this TP group, so its gradient is all-reduced over it
    (copy_to_tp's backward, overlapped with the weight gradient on the fused path); with
    sequence_parallel x is this rank's part of the sequence, all-gathered first (gather_from_sp).
    fp8: the GEMM runs with fp8 operands (megapar/fp8.py), scaled by this rank's own tensors.
    bias_after_gemm: y = (x W^T) + b, the bias added to the GEMM's rounded output as `add_bias`
    adds it (the row-parallel layer at tp 1), but in the same autograd node as the GEMM."""
    tp = tp_world(grad_x_group)
    if fp8 is not None:
        from ..fp8 import fp8_matmul
        y = fp8_matmul(to_tp_region(x, grad_x_group, sequence_parallel) if tp > 1 else x, weight, fp8)
        return y if bias is None else add_bias(y, bias)
    if _active(weight) and (bias is None or _active(bias)):
        store = getattr(weight, "wgrad_store", None)  # zero-bubble: its weight gradient may be deferred
        accumulate = _linear_accumulate_eager if tp > 1 or store is not None else _linear_accumulate
        return accumulate(x, weight, bias, grad_x_group, sequence_parallel and tp > 1, bias_after_gemm, store)
    x = to_tp_region(x, grad_x_group, sequence_parallel)
    if bias_after_gemm and bias is not None:
        return add_bias(F.linear(x, weight), bias)
    return F.linear(x, weight, bias)


def _linear_accumulate(x, weight, bias, group: Group, sequence_parallel: bool, bias_after_gemm: bool,
                       store: Optional["WeightGradStore"] = None) -> torch.Tensor:
    return _apply(_LinearAccumulateGrad, x, weight, bias, weight.main_grad, None if bias is None else bias.main_grad,
                  _gemv(bias), group, sequence_parallel, bias_after_gemm and bias is not None, store)


# With TP collectives inside: eager under torch.compile, like those of mappings.py (a collective
# inside a compiled autograd.Function crashed a tp 2 step).
_linear_accumulate_eager = torch.compiler.disable(_linear_accumulate)


def add_bias(y: torch.Tensor, bias: nn.Parameter) -> torch.Tensor:
    """y + bias, with the bias gradient accumulated into `bias.main_grad` when it allows it."""
    if _active(bias):
        return _apply(_BiasAddAccumulateGrad, y, bias, bias.main_grad, _gemv(bias))
    return y + bias
