"""Checkpoint tools and --load, faulted with real files and real processes on CPU.

data loss: tools/checkpoint_util.py and tools/convert_to_hf.py never delete what they did not
write -- a --save-dir that is, contains or lies inside --load-dir is refused, and --force replaces
only a previous output of the same tool (megapar/checkpoint/publish.py).
load: a --load that names no checkpoint stops before any work, unless it is also --save (a
resumable job's first run: a note, then training from scratch); files are written with the umask.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from harness import ROOT, refused, run

sys.path.insert(0, str(ROOT / "tests"))
from synthetic_data import byte_gpt2_files, random_corpus  # noqa: E402

CKPT_UTIL = str(ROOT / "tools" / "checkpoint_util.py")
TO_HF = str(ROOT / "tools" / "convert_to_hf.py")
VOCAB = 265  # the byte-level GPT-2 vocabulary of byte_gpt2_files
MODEL = "iter_0000001/mp_rank_00/model_optim_rng.pt"
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--eval-iters", "0",
        "--eval-interval", "0", "--log-interval", "1", "--lr", "1e-3", "--make-vocab-size-divisible-by", "8",
        "--attention-backend", "torch", "--split", "100,0,0", "--lr-decay-iters", "10"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """Flags for a tiny offline corpus with a byte-level GPT-2 vocabulary."""
    d = tmp_path_factory.mktemp("data")
    vocab, merge = byte_gpt2_files(str(d))
    random_corpus(str(d / "corpus"))
    return ["--data-path", str(d / "corpus"), "--vocab-file", vocab, "--merge-file", merge]


def train(data: list[str], *extra, umask: int | None = None, cache: Path | None = None):
    cmd = ["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, *map(str, extra)]
    if cache is not None:
        cmd += ["--data-cache-path", str(cache)]
    if umask is not None:
        cmd = ["bash", "-c", f"umask {umask:03o} && exec \"$@\"", "train", sys.executable, *cmd[1:]]
    return run(cmd)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """A real checkpoint written by one training iteration."""
    ck = tmp_path_factory.mktemp("trained") / "ck"
    out = train(data, "--save", ck, cache=ck.parent / "cache")
    assert out.rc == 0, out.output[-3000:]
    return ck


@pytest.fixture
def runs(trained, tmp_path) -> Path:
    """runs/ck (a copy of the trained checkpoint) beside an unrelated file runs/notes.txt."""
    runs = tmp_path / "runs"
    shutil.copytree(trained, runs / "ck")
    (runs / "notes.txt").write_text("the user's own notes\n")
    return runs


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    lm = torch.load(path, map_location="cpu", weights_only=False)["model"]["language_model"]
    out = {f"embedding.{k}": v["weight"] for k, v in lm["embedding"].items()}
    out.update({f"encoder.{k}": v for k, v in lm["encoder"].items()})
    return out


def assert_same_model(a: Path, b: Path) -> None:
    """Same weights (the vocabulary's padding rows aside: resharding writes them as zeros)."""
    ta, tb = model_tensors(a), model_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        n = VOCAB if k == "embedding.word_embeddings" else None
        assert torch.equal(ta[k][:n], tb[k][:n]), k


def reshard(load, save, *extra) -> list:
    return ["python", CKPT_UTIL, "--load-dir", load, "--save-dir", save, *extra]


def to_hf(load, save, *extra) -> list:
    return ["python", TO_HF, "--load-dir", load, "--save-dir", save, *extra]


def strip_identities(shard: Path) -> None:
    """Make a legacy shard folder as one saved before identities: no identity.json, none in its files."""
    (shard / "identity.json").unlink()
    for name in ("model_optim_rng.pt", "distrib_optim.pt"):
        if (shard / name).exists():
            state = torch.load(shard / name, weights_only=False)
            del state["identity"]
            torch.save(state, shard / name)


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial." in p.name or ".old." in p.name]


# ---- checkpoint_util: where it writes ---------------------------------------------------------------
def test_save_dir_containing_the_source_is_refused(runs):
    refused(reshard(runs / "ck", runs, "--force"), fault_class="data loss",
            case="checkpoint_util --save-dir = parent of --load-dir, --force", expect="contains the --load-dir",
            watch=[runs])


def test_save_dir_equal_to_the_source_is_refused(runs):
    refused(reshard(runs / "ck", runs / "ck", "--force"), fault_class="data loss",
            case="checkpoint_util --save-dir = --load-dir, --force", expect="is the --load-dir", watch=[runs])


def test_save_dir_inside_the_source_is_refused(runs):
    refused(reshard(runs / "ck", runs / "ck" / "tp2", "--target-tensor-parallel-size", "2"),
            fault_class="data loss", case="checkpoint_util --save-dir inside --load-dir",
            expect="lies inside the --load-dir", watch=[runs])
    assert sorted(os.listdir(runs)) == ["ck", "notes.txt"]


def test_relative_and_symlinked_paths_are_resolved(runs):
    refused(reshard(".", "..", "--force"), fault_class="data loss",
            case="checkpoint_util --load-dir . --save-dir .. (relative), --force", expect="contains the --load-dir",
            watch=[runs], cwd=runs / "ck")
    (runs.parent / "link").symlink_to(runs / "ck")
    refused(reshard(runs / "ck", runs.parent / "link", "--force"), fault_class="data loss",
            case="checkpoint_util --save-dir a symlink to --load-dir, --force", expect="is the --load-dir",
            watch=[runs])


def test_unrelated_non_empty_save_dir_is_not_replaced(runs):
    other = runs / "other"
    other.mkdir()
    (other / "results.csv").write_text("step,loss\n1,5.6\n")
    refused(reshard(runs / "ck", other, "--force"), fault_class="data loss",
            case="checkpoint_util --force onto an unrelated non-empty folder",
            expect=["not a previous output", "choose a new directory"], watch=[runs])


def test_previous_output_with_a_user_file_is_not_replaced(runs):
    out = runs / "tp1"
    assert run(reshard(runs / "ck", out)).rc == 0
    (out / "README.txt").write_text("what this checkpoint is\n")
    refused(reshard(runs / "ck", out, "--force"), fault_class="data loss",
            case="checkpoint_util --force onto a previous output plus a user's file",
            expect="not a previous output", watch=[runs])


def test_save_dir_that_is_a_file_is_refused(runs):
    refused(reshard(runs / "ck", runs / "notes.txt", "--force"), fault_class="data loss",
            case="checkpoint_util --save-dir is a file, --force", expect="is not a directory", watch=[runs])


def test_previous_output_needs_force_and_is_replaced_with_it(runs):
    out = runs / "out"
    assert run(reshard(runs / "ck", out, "--target-tensor-parallel-size", "2")).rc == 0
    refused(reshard(runs / "ck", out), fault_class="data loss",
            case="checkpoint_util onto a previous output without --force", expect="--force", watch=[runs])
    done = run(reshard(runs / "ck", out, "--force", "--target-tensor-parallel-size", "1"))
    assert done.rc == 0, done.output[-3000:]
    assert sorted(os.listdir(out / "iter_0000001")) == ["mp_rank_00"]
    assert_same_model(runs / "ck" / MODEL, out / MODEL)
    assert (runs / "notes.txt").read_text() == "the user's own notes\n" and not leftovers(runs)


def test_canonical_output_is_replaced_with_force(runs):
    full = runs / "full"
    for _ in range(2):
        done = run(reshard(runs / "ck", full, "--to-full", "--force"))
        assert done.rc == 0, done.output[-3000:]
    assert sorted(os.listdir(full)) == ["metadata.pt", "tensors"] and not leftovers(runs)


@pytest.mark.parametrize("flag,value", [("--target-tensor-parallel-size", "0"),
                                        ("--target-pipeline-parallel-size", "-1")])
def test_target_size_below_one_is_refused(runs, flag, value):
    refused(reshard(runs / "ck", runs / "out", flag, value), fault_class="data loss",
            case=f"checkpoint_util {flag} {value}", expect=[flag, "must be >= 1"], watch=[runs])


# ---- convert_to_hf --------------------------------------------------------------------------------
def test_hf_save_dir_inside_the_source_is_refused(runs):
    refused(to_hf(runs / "ck", runs / "ck" / "hf"), fault_class="data loss",
            case="convert_to_hf --save-dir inside --load-dir", expect="lies inside the --load-dir", watch=[runs])


def test_hf_force_onto_an_unrelated_folder_is_refused(runs):
    refused(to_hf(runs / "ck", runs, "--force"), fault_class="data loss",
            case="convert_to_hf --save-dir = parent of --load-dir, --force", expect="contains the --load-dir",
            watch=[runs])
    other = runs / "models"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "gpt2"}')  # an HF-looking folder with more in it
    (other / "model.safetensors").write_bytes(b"weights")
    (other / "tokenizer.json").write_text("{}")
    refused(to_hf(runs / "ck", other, "--force"), fault_class="data loss",
            case="convert_to_hf --force onto a folder with more than config.json + model.safetensors",
            expect="not a previous output", watch=[runs])


def test_hf_force_onto_a_checkpoint_is_refused(runs, trained):
    shutil.copytree(trained, runs / "ck2")
    refused(to_hf(runs / "ck", runs / "ck2", "--force"), fault_class="data loss",
            case="convert_to_hf --force onto a megapar checkpoint", expect="not a previous output", watch=[runs])


def test_hf_previous_export_is_replaced_with_force(runs):
    from safetensors.torch import load_file
    hf = runs / "hf"
    assert run(to_hf(runs / "ck", hf)).rc == 0
    done = run(to_hf(runs / "ck", hf, "--force", "--dtype", "fp16"))
    assert done.rc == 0, done.output[-3000:]
    assert sorted(os.listdir(hf)) == ["config.json", "merges.txt", "model.safetensors", "special_tokens_map.json",
                                      "tokenizer_config.json", "vocab.json"] and not leftovers(runs)
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "float16"
    wte = load_file(str(hf / "model.safetensors"))["transformer.wte.weight"]
    src = model_tensors(runs / "ck" / MODEL)["embedding.word_embeddings"]
    assert torch.equal(wte, src[: wte.shape[0]].half())


# ---- training --load -----------------------------------------------------------------------------
def test_missing_load_dir_is_refused(data, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", tmp_path / "nope",
             "--save", tmp_path / "ck", "--data-cache-path", tmp_path / "cache"],
            fault_class="load", case="--load that does not exist", expect=["--load", "does not exist", "--save"],
            watch=[tmp_path])


def test_load_dir_without_checkpoint_is_refused(data, runs):
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", runs, "--save", runs / "new"],
            fault_class="load", case="--load a folder with no checkpoint (the parent of one)",
            expect=["holds no checkpoint", "latest_checkpointed_iteration.txt"], watch=[runs])


def test_first_run_of_a_resumable_job_starts_with_a_note(data, tmp_path):
    ck = tmp_path / "ck"
    out = train(data, "--load", ck, "--save", ck, umask=0o027, cache=tmp_path / "cache")
    assert out.rc == 0, out.output[-3000:]
    assert f"> no checkpoint in {ck} yet: starting from scratch" in out.output
    assert "WARNING" not in out.output
    files = [p for p in [*ck.rglob("*"), *(tmp_path / "cache").rglob("*")] if p.is_file()]
    assert any(p.name.endswith(".npy") for p in files) and (ck / "latest_checkpointed_iteration.txt").is_file()
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o640)}, modes  # 0o666 & ~0o027: the umask, not mkstemp's 0o600
    again = train(data, "--load", ck, "--save", ck, "--train-iters", "2")
    assert again.rc == 0 and "successfully loaded checkpoint" in again.output, again.output[-3000:]


def test_another_models_optimizer_file_is_refused(data, tmp_path):
    """distrib_optim.pt of a model with the same layout but two layers, put into a one-layer
    checkpoint: its extra layers' state would load silently; training's --load and
    checkpoint_util both refuse it, naming the file and the difference."""
    one, two = tmp_path / "one", tmp_path / "two"
    for ck, layers in ((one, "1"), (two, "2")):
        out = train(data, "--use-distributed-optimizer", "--num-layers", layers, "--save", ck,
                    cache=tmp_path / "cache")
        assert out.rc == 0, out.output[-3000:]
    optim = "iter_0000001/mp_rank_00/distrib_optim.pt"
    shutil.copy(two / optim, one / optim)
    expect = [f"checkpoint file {one / optim}: its optimizer state does not match the model",
              "it holds 28 parameters, the model 16", "not in the model: language_model.encoder.layers.1."]
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--use-distributed-optimizer", "--load", one,
             "--save", one, "--train-iters", "2", "--data-cache-path", tmp_path / "cache"],
            fault_class="load", case="--load a checkpoint holding another model's distrib_optim.pt",
            expect=[f"checkpoint file {one / optim} is not the file saved with this checkpoint",
                    "put back the file saved with it"], watch=[one], allow_new=[tmp_path / "cache"])
    strip_identities(one / "iter_0000001" / "mp_rank_00")             # saved before identities: the shapes
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--use-distributed-optimizer", "--load", one,
             "--save", one, "--train-iters", "2", "--data-cache-path", tmp_path / "cache"],
            fault_class="load", case="the same, in a checkpoint saved before identities",
            expect=expect + ["--no-load-optim"], watch=[one], allow_new=[tmp_path / "cache"])
    refused(reshard(one, tmp_path / "out"), fault_class="load",
            case="checkpoint_util on a checkpoint holding another model's distrib_optim.pt",
            expect=expect + ["--no-optim"], watch=[one])


def test_atomic_write_follows_the_umask(tmp_path):
    from megapar.atomic import atomic_write_text
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.txt", "y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]


# ---- kill -9 in the middle of a save ---------------------------------------------------------------
KILL_AT = '''import os, runpy, signal, sys
name, nth = sys.argv[1], int(sys.argv[2])
sys.argv = ["megapar.pretrain_gpt2"] + sys.argv[3:]
real, seen = os.replace, [0]
def replace(src, dst, *a, **k):  # SIGKILL just before the nth rename onto a file or folder called `name`
    if os.path.basename(str(dst)) == name:
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *a, **k)
os.replace = replace
runpy.run_module("megapar.pretrain_gpt2", run_name="__main__")
'''


def losses(output: str) -> dict[int, str]:
    import re
    return {int(m[1]): m[2] for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+)", output)}


@pytest.fixture(scope="module")
def uninterrupted_losses(data, tmp_path_factory) -> dict[int, str]:
    """The losses of the 4-iteration run that every kill case must reproduce after its resume."""
    d = tmp_path_factory.mktemp("kill_ref")
    ref = run(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--train-iters", "4", "--save-interval", "1",
               "--data-cache-path", d / "cache", "--save", d / "ref"])
    assert ref.rc == 0, ref.output[-3000:]
    return losses(ref.output)


@pytest.mark.parametrize("name,nth,resumes_at", [
    ("model_optim_rng.pt", 2, 1),                 # iteration 2's model file written, not yet renamed
    ("iter_0000002", 1, 1),                       # its folder complete, not yet in place
    ("latest_checkpointed_iteration.txt", 2, 1),  # in place, the tracker still names iteration 1
])
def test_kill_during_a_save_resumes_exactly(data, tmp_path, uninterrupted_losses, name, nth, resumes_at):
    flags = [*TINY, *data, "--train-iters", "4", "--save-interval", "1", "--data-cache-path", tmp_path / "cache"]
    ck = tmp_path / "ck"
    killed = run(["python", "-c", KILL_AT, name, str(nth), *flags, "--save", ck, "--load", ck])
    assert killed.rc == -9, killed.output[-3000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == str(resumes_at)
    resumed = run(["python", "-m", "megapar.pretrain_gpt2", *flags, "--save", ck, "--load", ck])
    assert resumed.rc == 0 and f"at iteration {resumes_at}" in resumed.output, resumed.output[-3000:]
    want = {i: v for i, v in uninterrupted_losses.items() if i > resumes_at}
    assert losses(resumed.output) == want and len(want) == 4 - resumes_at


def test_output_that_changes_during_a_conversion_is_not_replaced(tmp_path):
    """publish_dir checks the output again just before the rename."""
    from megapar.checkpoint import CheckpointError
    from megapar.checkpoint.publish import CANONICAL, CHECKPOINT, new_staging, publish_dir
    out = tmp_path / "out"
    staging = new_staging(str(out))                      # the tool started on an absent --save-dir ...
    (Path(staging) / "metadata.pt").write_bytes(b"new")
    out.mkdir()
    (out / "mine.txt").write_text("written meanwhile")   # ... and the user wrote there in the meantime
    with pytest.raises(CheckpointError, match="changed during the conversion"):
        publish_dir(staging, str(out), (CHECKPOINT, CANONICAL))
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "mine.txt").read_text() == "written meanwhile"


# ---- torch_dist: a truncated data file, another model's checkpoint, --async-save without it ---------------
@pytest.fixture(scope="module")
def dist_trained(data, tmp_path_factory) -> Path:
    """A real --ckpt-format torch_dist checkpoint written by one training iteration."""
    ck = tmp_path_factory.mktemp("dist_trained") / "ck"
    out = train(data, "--save", ck, "--ckpt-format", "torch_dist", cache=ck.parent / "cache")
    assert out.rc == 0, out.output[-3000:]
    return ck


def test_truncated_torch_dist_file_is_named(data, dist_trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(dist_trained, ck)
    data_file = ck / "iter_0000001" / "__0_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[:200])
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", ck, "--train-iters", "2"],
            fault_class="load", case="torch_dist checkpoint with a truncated data file",
            expect=["checkpoint file", "iter_0000001/__0_0.distcp is truncated", "load an earlier iteration"],
            watch=[ck])


@pytest.mark.parametrize("name, expect", [("__0_0.distcp", "iter_0000001/__0_0.distcp is missing"),
                                          ("common.pt", "torch_dist checkpoint file"),
                                          (".metadata", "iter_0000001/.metadata is missing")])
def test_missing_torch_dist_file_is_named(data, dist_trained, tmp_path, name, expect):
    """One line naming the file (not DCP's frame listing, not a 'missing legacy file')."""
    ck = tmp_path / "ck"
    shutil.copytree(dist_trained, ck)
    (ck / "iter_0000001" / name).unlink()
    out = refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", ck, "--train-iters", "2"],
                  fault_class="load", case=f"torch_dist checkpoint without its {name}",
                  expect=[expect, "load an earlier iteration"], watch=[ck])
    assert "model_optim_rng.pt" not in out.output and "File \"" not in out.output


def test_load_of_a_hugging_face_folder_points_to_the_converter(data, tmp_path):
    hf = tmp_path / "gpt2_hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (hf / "model.safetensors").write_bytes(b"\0" * 16)
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", hf, "--train-iters", "2"],
            fault_class="load", case="--load names a Hugging Face folder",
            expect=["is a Hugging Face model folder", "tools/convert_from_hf.py --load-dir"], watch=[tmp_path])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("tracker", ["deleted", "names a missing iteration"])
def test_saved_iterations_are_never_trained_over_from_scratch(data, trained, dist_trained, tmp_path, fmt, tracker):
    """--load = --save over saved iterations whose tracker is gone (or names a folder that is not
    there): refused, naming the iterations and the fix, nothing changed."""
    ck = tmp_path / "ck"
    shutil.copytree(trained if fmt == "torch" else dist_trained, ck)
    if tracker == "deleted":
        (ck / "latest_checkpointed_iteration.txt").unlink()
        expect = ["holds saved iterations (iter_0000001) but no latest_checkpointed_iteration.txt",
                  "start from scratch over them", "echo 1 >"]
    else:
        (ck / "latest_checkpointed_iteration.txt").write_text("7")
        expect = ["names iteration 7", "iter_0000007 is missing", "saved iterations: iter_0000001"]
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", ck, "--save", ck, "--train-iters", "2",
             "--ckpt-format", fmt, "--data-cache-path", ck.parent / "nocache"], fault_class="load",
            case=f"{fmt} --load = --save, tracker {tracker}", expect=expect, watch=[ck],
            allow_new=[ck / "megapar.lock", ck.parent / "nocache"])


def test_torch_dist_checkpoint_of_another_model_is_refused(data, dist_trained):
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", dist_trained, "--train-iters", "2",
             "--hidden-size", "32"], fault_class="load", case="torch_dist checkpoint of another model shape",
            expect=["does not match this model", "--hidden-size 16 (checkpoint) vs 32 (run)"], watch=[dist_trained])


def test_async_save_without_torch_dist_is_refused(data, tmp_path):
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--save", tmp_path / "ck", "--async-save"],
            fault_class="load", case="--async-save with the legacy format",
            expect=["--async-save needs --ckpt-format torch_dist"], watch=[tmp_path])


# ---- identity: every file is the one saved with its checkpoint ---------------------------------------------
@pytest.fixture(scope="module")
def zero_pair(data, tmp_path_factory) -> tuple[Path, Path]:
    """Two runs of the same shapes (ZeRO: a distrib_optim.pt per shard) that differ in their seed."""
    out = []
    for seed in ("1234", "99"):
        ck = tmp_path_factory.mktemp(f"zero{seed}") / "ck"
        done = train(data, "--save", ck, "--use-distributed-optimizer", "--seed", seed, cache=ck.parent / "cache")
        assert done.rc == 0, done.output[-3000:]
        out.append(ck)
    return out[0], out[1]


def _resume(data, ck: Path, *extra) -> list[str]:
    return ["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--load", ck, "--train-iters", "2", *extra]


def test_optimizer_file_of_another_run_is_refused(data, zero_pair, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(zero_pair[0], ck)
    shard = ck / "iter_0000001" / "mp_rank_00"
    shutil.copy(zero_pair[1] / "iter_0000001" / "mp_rank_00" / "distrib_optim.pt", shard / "distrib_optim.pt")
    refused(_resume(data, ck, "--use-distributed-optimizer"), fault_class="identity",
            case="distrib_optim.pt of another run with the same shapes",
            expect=[f"{shard / 'distrib_optim.pt'}", "not the file saved with this checkpoint",
                    "put back the file saved with it"], watch=[ck])


def test_torch_dist_shard_of_another_run_is_refused(data, dist_trained, tmp_path):
    other = tmp_path / "other"
    assert train(data, "--save", other, "--ckpt-format", "torch_dist", "--seed", "99").rc == 0
    ck = tmp_path / "ck"
    shutil.copytree(dist_trained, ck)
    shard = ck / "iter_0000001" / "__0_1.distcp"
    shutil.copy(other / "iter_0000001" / "__0_1.distcp", shard)
    refused(_resume(data, ck), fault_class="identity", case="a .distcp shard of another run with the same shapes",
            expect=[str(shard), "not the file saved with this checkpoint"], watch=[ck, other])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_flipped_bytes_inside_a_saved_weight_are_refused(data, trained, dist_trained, tmp_path, fmt):
    """Same size, bytes changed in the middle (where the tensors are): the checksum names the file."""
    ck = tmp_path / "ck"
    shutil.copytree(trained if fmt == "torch" else dist_trained, ck)
    path = ck / (MODEL if fmt == "torch" else "iter_0000001/__0_0.distcp")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 8] = b"\x7f" * 8          # finite garbage in a weight
    path.write_bytes(bytes(raw))
    refused(_resume(data, ck), fault_class="identity", case=f"{fmt}: 8 bytes changed inside a saved weight",
            expect=[str(path), "checksum differs", "load an earlier iteration"], watch=[ck])


def test_checkpoint_saved_before_identities_still_loads(data, trained, dist_trained, tmp_path):
    legacy, torch_dist = tmp_path / "legacy", tmp_path / "torch_dist"
    shutil.copytree(trained, legacy)
    strip_identities(legacy / "iter_0000001" / "mp_rank_00")
    shutil.copytree(dist_trained, torch_dist)
    common_path = torch_dist / "iter_0000001" / "common.pt"
    common = torch.load(common_path, weights_only=False)
    del common["identity"], common["files"]
    torch.save(common, common_path)
    for ck, fmt in ((legacy, "torch"), (torch_dist, "torch_dist")):
        out = run(_resume(data, ck, "--save", ck, "--ckpt-format", fmt))
        assert out.rc == 0 and f"successfully loaded checkpoint from {ck} at iteration 1" in out.output, \
            out.output[-3000:]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_run_id_is_kept_across_a_resume(data, trained, dist_trained, tmp_path, fmt):
    ck = tmp_path / "ck"
    shutil.copytree(trained if fmt == "torch" else dist_trained, ck)
    out = run(_resume(data, ck, "--save", ck, "--ckpt-format", fmt))
    assert out.rc == 0, out.output[-3000:]

    def ident(it: int) -> dict:
        if fmt == "torch":
            return json.loads((ck / f"iter_{it:07d}" / "mp_rank_00" / "identity.json").read_text())
        return torch.load(ck / f"iter_{it:07d}" / "common.pt", weights_only=False)["identity"]
    first, second = ident(1), ident(2)
    assert first["run_id"] == second["run_id"] and len(first["run_id"]) == 16
    assert (first["iteration"], second["iteration"]) == (1, 2)


def test_shard_that_lost_its_identity_json_is_refused(data, trained, tmp_path):
    """Its files carry an identity: without the manifest they would load unchecked."""
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    manifest = ck / "iter_0000001" / "mp_rank_00" / "identity.json"
    manifest.unlink()
    refused(_resume(data, ck), fault_class="identity", case="a shard without its identity.json",
            expect=[f"{manifest} is missing (model_optim_rng.pt was saved with it)", "put it back"], watch=[ck])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_conversion_of_a_changed_checkpoint_is_refused(data, zero_pair, dist_trained, tmp_path, fmt):
    """checkpoint_util checks the files it reads as training's --load does: another run's
    distrib_optim.pt (legacy) or changed bytes in a .distcp (torch_dist) are named, and no output
    (with a fresh identity and checksums that would hide the change) is written."""
    ck = tmp_path / "ck"
    shutil.copytree(zero_pair[0] if fmt == "torch" else dist_trained, ck)
    if fmt == "torch":
        path = ck / "iter_0000001" / "mp_rank_00" / "distrib_optim.pt"
        shutil.copy(zero_pair[1] / "iter_0000001" / "mp_rank_00" / "distrib_optim.pt", path)
        expect = [str(path), "not the file saved with this checkpoint"]
    else:
        path = ck / "iter_0000001" / "__0_0.distcp"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2: len(raw) // 2 + 8] = b"\x7f" * 8
        path.write_bytes(bytes(raw))
        expect = [str(path), "checksum differs"]
    refused(reshard(ck, tmp_path / "out", "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size",
                    "1"), fault_class="identity", case=f"checkpoint_util over a changed {fmt} checkpoint",
            expect=expect, watch=[tmp_path])


# ---- never from scratch over saved iterations ------------------------------------------------------------------
@pytest.mark.parametrize("how", ["no --load", "--finetune"])
def test_a_run_from_iteration_0_never_saves_over_saved_iterations(data, trained, dist_trained, tmp_path, how):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    if how == "no --load":
        cmd, expect = [], ["and this run has no --load, so it would start from scratch and replace them",
                           f"add --load {ck} to resume"]
    else:
        cmd, expect = ["--load", dist_trained, "--finetune"], ["a --finetune starts at iteration 0",
                                                                f"--load {ck} without --finetune"]
    refused(["python", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--save", ck, *cmd], fault_class="load",
            case=f"--save over saved iterations, {how}", watch=[ck, dist_trained],
            expect=[f"--save {ck} holds saved iterations (iter_0000001)", *expect])


@pytest.mark.parametrize("text", ["", "  \n", "latest", "-1"])
def test_a_tracker_that_names_no_iteration_says_which_are_saved(data, trained, tmp_path, text):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    (ck / "latest_checkpointed_iteration.txt").write_text(text)
    refused(_resume(data, ck, "--save", ck), fault_class="load", case=f"a tracker holding {text!r}",
            expect=["should hold an iteration number or 'release'", "write the iteration to resume from into it "
                    "(saved: iter_0000001)"], watch=[ck], allow_new=[ck / "megapar.lock"])
