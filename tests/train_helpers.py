"""Run megapar.pretrain_gpt2 in-process (1 rank) or under gloo (N ranks) for tests."""

from distributed import run_distributed

TINY_TRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--lr", "1e-3", "--lr-warmup-iters", "2", "--log-interval", "100",
              "--eval-interval", "0", "--eval-iters", "0", "--split", "98,2,0"]


def _pretrain_body(rank, world_size, argv):
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    state = pretrain(parse(argv, world_size))
    return {"losses": state.losses, "iteration": state.iteration, "consumed": state.consumed_samples,
            "valid_losses": state.valid_losses}


def run_training(argv, world_size=1):
    """Losses [(iteration, loss)] seen by rank 0 (every rank logs the same values)."""
    return run_distributed(_pretrain_body, world_size, args=(list(argv),))[0]
