"""Behaviour pinned across refactors: a fixed tiny run writes the same checkpoint tensors and losses
as the reference in tests/data/golden_checkpoint.pt (written by the code before the refactor).

Everything is generated here from fixed seeds (a byte-level GPT-2 vocabulary, random token
documents), so the test needs no external data. Regenerate the reference only for an intended
change of numerics or format:  python tests/checkpoint/test_golden_checkpoint.py --regenerate
"""
import os
import sys

import pytest
import torch

from megapar.checkpoint.common import IDENTITY_FILE

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: run as a script too
from data_dirs import SHIPPED  # noqa: E402
from synthetic_data import byte_gpt2_files, random_corpus  # noqa: E402
from train_helpers import run_training  # noqa: E402

GOLDEN = str(SHIPPED / "golden_checkpoint.pt")
LAYOUTS = {"serial": (1, []),
           "tp2_dp2_zero1": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"])}
ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--lr", "1e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--eval-interval", "3", "--eval-iters", "1", "--split", "90,10,0", "--train-iters", "4",
        "--make-vocab-size-divisible-by", "32", "--save-interval", "4", "--attention-backend", "torch"]


PATH_ARGS = {"save", "load", "vocab_file", "merge_file", "tokenizer_model", "data_cache_path", "tensorboard_dir"}


def _tensors(obj, prefix=""):
    """Flatten nested dicts/lists of a checkpoint into {path: tensor or plain value}."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}{i}/"))
    elif isinstance(obj, torch.Tensor):
        out[prefix.rstrip("/")] = obj.detach().clone()
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out[prefix.rstrip("/")] = obj
    return out


def _checkpoint_contents(root: str) -> dict:
    """Every file of the saved iteration, loaded and flattened (the `args` namespace aside: its
    Megatron fields are compared separately; rng states are machine-dependent and the identity
    (run id, checksums) run-dependent: skipped)."""
    out = {}
    it_dir = os.path.join(root, "iter_0000004")
    for shard in sorted(os.listdir(it_dir)):
        for name in sorted(set(os.listdir(os.path.join(it_dir, shard))) - {IDENTITY_FILE}):
            state = torch.load(os.path.join(it_dir, shard, name), map_location="cpu", weights_only=False)
            args = state.pop("args", None)
            state.pop("rng_state", None)
            state.pop("identity", None)
            for k, v in _tensors(state).items():
                out[f"{shard}/{name}/{k}"] = v
            if args is not None:
                out[f"{shard}/{name}/args"] = {k: v for k, v in sorted(vars(args).items()) if k not in PATH_ARGS
                                               and isinstance(v, (int, float, str, bool, type(None)))}
    return out


def run_layout(tmp: str, layout: str) -> dict:
    world, extra = LAYOUTS[layout]
    vocab, merge = byte_gpt2_files(tmp)
    prefix = os.path.join(tmp, "corpus")
    random_corpus(prefix)
    save = os.path.join(tmp, f"ckpt_{layout}")
    result = run_training(ARGS + extra + ["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merge,
                                          "--save", save, "--data-cache-path", os.path.join(tmp, "cache")],
                          world_size=world)
    return {"losses": result["losses"], "checkpoint": _checkpoint_contents(save)}


def _compare(got, want, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype, where
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=where)
    else:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6) if isinstance(want, float) else got == want, \
            f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_and_losses_unchanged(tmp_path, layout):
    golden = torch.load(GOLDEN, weights_only=False)[layout]
    got = run_layout(str(tmp_path), layout)
    assert [it for it, _ in got["losses"]] == [it for it, _ in golden["losses"]]
    for (_, a), (_, b) in zip(got["losses"], golden["losses"]):
        assert a == pytest.approx(b, rel=1e-5)
    want_ck, got_ck = golden["checkpoint"], got["checkpoint"]
    assert set(want_ck) <= set(got_ck), f"missing from the checkpoint: {sorted(set(want_ck) - set(got_ck))}"
    for key, want in want_ck.items():
        if key.endswith("/args"):  # every Megatron args field of before is still there, same value
            for name, value in want.items():
                assert name in got_ck[key], f"{key}: field {name} is gone"
                _compare(got_ck[key][name], value, f"{key}.{name}")
        else:
            _compare(got_ck[key], want, key)


if __name__ == "__main__" and "--regenerate" in sys.argv:
    import tempfile
    out = {}
    for layout in sorted(LAYOUTS):
        with tempfile.TemporaryDirectory() as d:
            out[layout] = run_layout(d, layout)
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    torch.save(out, GOLDEN)
    print(f"wrote {GOLDEN} ({os.path.getsize(GOLDEN) / 1e3:.0f} kB)")
