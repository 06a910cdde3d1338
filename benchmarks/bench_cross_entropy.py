"""The LM head and loss, fused in chunks (--cross-entropy-loss-fusion) against unfused, on one GPU.

    python benchmarks/bench_cross_entropy.py [--tokens 8192 --vocab 50304 --hidden 1024 2048]

Times forward + backward of the head and the mean loss (bf16 weights and hidden states, fp32 loss math),
graphed (CUDA graph replays after warm-up, as in a graphed step), and the peak memory one eager call adds
over its inputs. unfused: `parallel_lm_logits` + `vocab_parallel_cross_entropy` + mean, the [tokens, V]
logits and their gradient in bf16; fused: `linear_cross_entropy_mean`. The last column is the fused
loss's difference from the unfused one.
"""
from __future__ import annotations

import argparse

import torch

from gpu_timing import graphed_us  # benchmarks/gpu_timing.py
from megapar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapar.tensor_parallel.fused_cross_entropy import linear_cross_entropy_mean
from megapar.tensor_parallel.layers import parallel_lm_logits


def unfused(x, w, t, vocab):
    return vocab_parallel_cross_entropy(parallel_lm_logits(x, w, None), t, vocab).mean()


def fused(x, w, t, vocab):
    return linear_cross_entropy_mean(x, w, t, vocab)


def measure(head, tokens: int, hidden: int, padded: int, vocab: int) -> tuple[float, float, float]:
    """(µs per forward + backward, peak MiB over the inputs, loss) of one head."""
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, **bf16, requires_grad=True)
    w = (torch.randn(padded, hidden, **bf16) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")

    def step():
        x.grad = w.grad = None
        loss = head(x, w, t, vocab)
        loss.backward()
        return loss
    loss = step().item()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return graphed_us(step, iters=50), peak, loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch (micro-batch x seq length)")
    p.add_argument("--vocab", type=int, default=50257, help="true vocabulary size")
    p.add_argument("--padded-vocab", type=int, default=50304, help="padded vocabulary size (rows of the head)")
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048], help="hidden sizes to measure")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, tokens {args.tokens}, vocab {args.vocab} (padded {args.padded_vocab})")
    print(f"{'hidden':>6} {'head':>8} {'us/step':>9} {'peak MiB':>9} {'loss diff':>10}")
    for hidden in args.hidden:
        ref = None
        for name, head in (("unfused", unfused), ("fused", fused)):
            us, peak, loss = measure(head, args.tokens, hidden, args.padded_vocab, args.vocab)
            ref = loss if ref is None else ref
            print(f"{hidden:>6} {name:>8} {us:>9.0f} {peak:>9.0f} {abs(loss - ref):>10.2e}")


if __name__ == "__main__":
    main()
