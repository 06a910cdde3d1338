"""Scale without gathering: a save holds no more than the rank's own shard plus a little.

The legacy save streams every file (megapar/checkpoint/legacy.py): model tensors one at a time, the
ZeRO optimizer state assembled one parameter at a time on the writing rank. A torch_dist save
(megapar/checkpoint/dist.py) writes each rank's own chunks, copying one chunk at a time. Measured here at the
GPT-2 124M shape (12 layers, hidden 768, 12 heads, vocabulary 50257, 1024 positions; a short
sequence, which changes no parameter), ZeRO-1 over dp 2, on CPU with gloo: each rank's peak
resident-memory growth during the save (tests/ckpt_memory.py). Gathering the whole optimizer state
on dp rank 0 costs ~12 bytes per parameter there, copying the model to the host ~4 more; a check
that allocates like its input (torch.isfinite over the weights) ~7.
"""
import pytest

from ckpt_memory import save_memory_per_rank

# Legacy: one fp32 tensor of the largest parameter (the word embeddings: 0.31 of GPT-2 124M's
# parameters, 1.24 bytes per parameter) is what streaming holds at a time on the writing rank.
# torch_dist: each rank's chunks are written from its own memory, nothing copied. Plus a fixed margin
# for the pickled structure, gloo's buffers, the allocator.
BYTES_PER_PARAM = {"torch": 1.5, "torch_dist": 0.0}
MARGIN = 64 << 20
GPT2_124M = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "64",
             "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "2",
             "--attention-backend", "torch", "--train-iters", "1", "--lr", "1e-4"]


def _zero1_save(rank, world_size, root, fmt):
    """The training Run of GPT-2 124M with ZeRO-1 at dp `world_size`, and its save in format `fmt`."""
    from megapar.config.build import parse_config
    from megapar.run.initialize import build_run
    from megapar.topology import Topology
    import torch
    cfg = parse_config(GPT2_124M + ["--use-distributed-optimizer", "--save", root, "--ckpt-format", fmt],
                       world_size=world_size)
    topo = Topology(1, 1, world_size)
    topo.create_groups(rank)
    run = build_run(cfg, topo, rank, torch.device("cpu"), vocab_size=50257)
    numel = sum(p.numel() for p in run.model.parameters())
    return (lambda: run.checkpointer.save(1, 2)), numel


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_zero1_save_of_gpt2_124m_holds_at_most_one_parameter_extra(tmp_path, fmt):
    results = save_memory_per_rank(_zero1_save, world_size=2, args=(str(tmp_path), fmt))
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['growth'] / 2**20:.1f} MiB peak growth over {r['numel'] / 1e6:.1f}M parameters "
              f"= {r['per_param']:.2f} bytes/parameter")
    assert results[0]["numel"] > 124e6
    for r in results:
        assert r["growth"] <= BYTES_PER_PARAM[fmt] * r["numel"] + MARGIN, results
    written = "mp_rank_00/distrib_optim.pt" if fmt == "torch" else "common.pt"
    assert (tmp_path / "iter_0000001" / written).is_file()
