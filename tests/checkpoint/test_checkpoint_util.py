"""tools/checkpoint_util.py + megapar.reshard: round trips are bitwise, logits are layout
invariant, ZeRO-1 state follows dp, bad input gets one message naming the file."""
import argparse
import os
import shutil

import pytest
import torch

from ckpt_fixtures import VOCAB, save_tiny_checkpoint
from distributed import run_distributed
from gpt_helpers import batch, tiny_model_config
from megapar.checkpoint import flatten_model_state
from megapar.model import GPT2Model, Stage
from megapar.model.sharding import is_vocab_parallel
from megapar.reshard import load_model_state_for

from megapar.cli import checkpoint_util

IT = "iter_0000020"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_tiny_checkpoint(str(root / "tp2pp2"), tp=2, pp=2)
    save_tiny_checkpoint(str(root / "zero_dp4"), tp=1, pp=1, dp=4, zero=True)
    return root


def convert(src, dst, *extra):
    assert checkpoint_util.main(["--load-dir", str(src), "--save-dir", str(dst), *map(str, extra)]) == 0


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_tree(a, b, where=""):
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            if k == "identity":     # a conversion's output is a new set of files, with an identity of its own
                assert a[k]["iteration"] == b[k]["iteration"] and b[k]["run_id"], (where, a[k], b[k])
                continue
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        assert vars(a) == vars(b), where
    elif hasattr(a, "__array__"):
        assert (a == b).all(), where
    else:
        assert a == b, where


def _shard_file(root, tp_rank, pp_rank, name="model_optim_rng.pt"):
    return os.path.join(root, IT, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}", name)


def test_round_trip_tp2pp2_tp1pp1_tp2pp2_is_bitwise(ckpts, tmp_path):
    convert(ckpts / "tp2pp2", tmp_path / "one",
            "--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size", 1)
    one = load(tmp_path / "one" / IT / "mp_rank_00" / "model_optim_rng.pt")
    assert one["args"].tensor_model_parallel_size == 1 and one["args"].padded_vocab_size == 128
    assert "word_embeddings_for_head" not in one["model"] and "rng_state" not in one
    convert(tmp_path / "one", tmp_path / "back", "--target-tensor-parallel-size", 2,
            "--target-pipeline-parallel-size", 2)
    assert open(tmp_path / "back" / "latest_checkpointed_iteration.txt").read() == "20"
    for t in range(2):
        for p in range(2):
            a, b = load(_shard_file(ckpts / "tp2pp2", t, p)), load(_shard_file(tmp_path / "back", t, p))
            a.pop("rng_state")            # RNG is per (tp, pp) position: dropped when the layout changes
            compare_shards(a, b, t, f"shard[{t},{p}]")
    # the real dummy rows after conversion are zeros
    w = flatten_model_state(load(_shard_file(tmp_path / "back", 1, 0))["model"])
    assert not w["language_model.embedding.word_embeddings.weight"].any()


def _zero_dummy(t, tp_rank):
    t = t.clone()
    t[max(0, VOCAB - tp_rank * t.shape[0]):] = 0
    return t


def compare_optim_state(ast, bst, tp_rank, where):
    assert ast.keys() == bst.keys(), where
    for k in ast:
        for kind in ast[k]:
            x, y = ast[k][kind], bst[k][kind]
            if is_vocab_parallel(k):
                assert torch.equal(_zero_dummy(y, tp_rank), y), (where, k)
                x = _zero_dummy(x, tp_rank)
            assert x.dtype == y.dtype and torch.equal(x, y), (where, k, kind)


def compare_shards(a, b, tp_rank, where):
    """Every entry bitwise equal; the dummy vocabulary rows of `b` (converted) are zeros, those of
    `a` (trained) are ignored -- canonical form drops them and sharding re-pads with zeros."""
    a, b = dict(a), dict(b)
    am, bm = flatten_model_state(a.pop("model")), flatten_model_state(b.pop("model"))
    pairs = [(k, am[k], bm.get(k)) for k in am]
    if "optimizer" in a and "state" in a["optimizer"]:
        a["optimizer"], b["optimizer"] = dict(a["optimizer"]), dict(b["optimizer"])
        ast, bst = a["optimizer"].pop("state"), b["optimizer"].pop("state")
        assert ast.keys() == bst.keys()
        pairs += [(k, ast[k][kind], bst[k][kind]) for k in ast for kind in ast[k]]
    assert am.keys() == bm.keys(), where
    for k, x, y in pairs:
        if is_vocab_parallel(k):
            assert torch.equal(_zero_dummy(y, tp_rank), y), (where, k)
            x = _zero_dummy(x, tp_rank)
        assert x.dtype == y.dtype and torch.equal(x, y), (where, k)
    assert_same_tree(a, b, where)


def test_same_layout_through_canonical_keeps_everything_bitwise(ckpts, tmp_path):
    assert checkpoint_util.main(["--load-dir", str(ckpts / "tp2pp2"), "--save-dir", str(tmp_path / "full"),
                                 "--to-full"]) == 0
    meta = load(tmp_path / "full" / "metadata.pt")
    assert meta["vocab_size"] == VOCAB and meta["iteration"] == 20 and meta["optim_meta"]["step"] == 2
    emb = load(tmp_path / "full" / "tensors" / "language_model.embedding.word_embeddings.weight.pt")
    assert emb["param"].shape == (VOCAB, 32) and set(emb) == {"param", "master_param", "exp_avg", "exp_avg_sq"}
    assert not any("word_embeddings_for_head" in n for n in meta["names"])
    assert "language_model.encoder.layers.3.mlp.dense_4h_to_h.weight" in meta["names"]  # global indices
    assert checkpoint_util.main(["--load-dir", str(tmp_path / "full"), "--save-dir", str(tmp_path / "b"),
                                 "--from-full", "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-parallel-size", "2"]) == 0
    for t in range(2):
        for p in range(2):
            a, b = load(_shard_file(ckpts / "tp2pp2", t, p)), load(_shard_file(tmp_path / "b", t, p))
            compare_shards(a, b, t, f"shard[{t},{p}]")   # args, iteration, scheduler, scaler, RNG states


def test_zero1_dp4_to_dp2_carries_distrib_optim(ckpts, tmp_path):
    convert(ckpts / "zero_dp4", tmp_path / "dp2", "--target-data-parallel-size", 2)
    a_dir, b_dir = ckpts / "zero_dp4" / IT / "mp_rank_00", tmp_path / "dp2" / IT / "mp_rank_00"
    a, b = load(a_dir / "model_optim_rng.pt"), load(b_dir / "model_optim_rng.pt")
    assert b["optimizer"] == {"distributed": True, "grad_scaler": a["optimizer"]["grad_scaler"]}
    assert b["args"].data_parallel_size == 2 and a["args"].data_parallel_size == 4
    a["args"].data_parallel_size = 2
    compare_shards(a, b, 0, "model file")                    # model, args, scheduler, RNG (same tp, pp)
    a_opt, b_opt = load(a_dir / "distrib_optim.pt"), load(b_dir / "distrib_optim.pt")
    compare_optim_state(a_opt.pop("state"), b_opt.pop("state"), 0, "distrib_optim")
    assert_same_tree(a_opt, b_opt, "distrib_optim")          # step, grad_scaler, param_groups
    # and the converted state loads into a ZeRO-1 optimizer at dp=2 and saves back identically
    saved = run_distributed(_zero_reload_body, world_size=2, args=(str(tmp_path / "dp2"),))[0]
    compare_optim_state(load(a_dir / "distrib_optim.pt")["state"], saved["state"], 0, "reloaded")
    # switching storage: into the model file without the distributed optimizer
    convert(tmp_path / "dp2", tmp_path / "plain", "--no-distributed-optimizer")
    c = load(tmp_path / "plain" / IT / "mp_rank_00" / "model_optim_rng.pt")
    assert not os.path.exists(tmp_path / "plain" / IT / "mp_rank_00" / "distrib_optim.pt")
    compare_optim_state(load(a_dir / "distrib_optim.pt")["state"], c["optimizer"]["state"], 0, "plain")


def _zero_reload_body(rank, world, root):
    from megapar.checkpoint import load_checkpoint
    from megapar.optimizer.distrib_optimizer import DistributedOptimizer
    from megapar.optimizer.grad_buffer import GradBuffer
    from megapar.optimizer.grad_scaler import DynamicGradScaler
    from megapar.topology import Topology
    topo = Topology(1, 1, world)
    topo.create_groups(rank)
    cfg = tiny_model_config(["--use-distributed-optimizer"], world_size=world, vocab=VOCAB)
    model = GPT2Model(cfg.model, Stage.of(4, 1, 0), 99)
    opt = DistributedOptimizer(model, GradBuffer(model.parameters(), topo.groups.dp, mode="reduce_scatter"),
                               cfg.train, DynamicGradScaler(), 0, topo.groups.dp)
    load_checkpoint(root, model, opt, None, cfg.model, topo, rank)
    return opt.state_for_save()


def _forward_serial(tp, pp, root, tokens):
    """Logits of a tp=1 model at `pp` stages, loaded shard by shard with load_model_state_for."""
    cfg = tiny_model_config(["--pipeline-model-parallel-size", str(pp)], world_size=pp, vocab=VOCAB)
    x = None
    for p in range(pp):
        saved, state = load_model_state_for(root, 1, pp, 0, p)
        assert saved.parallel.pipeline_model_parallel_size == saved.args.pipeline_model_parallel_size == pp
        model = GPT2Model(cfg.model, Stage.of(4, pp, p), 0).eval()
        model.load_state_dict(state)
        model.set_input_tensor(x)
        with torch.no_grad():
            x = model(tokens) if p == 0 else model(None)
    return x[..., :VOCAB]


def _forward_tp2_body(rank, world, root, tokens):
    import torch.distributed as dist
    from megapar.tensor_parallel.mappings import gather_from_tp
    cfg = tiny_model_config(["--tensor-model-parallel-size", "2"], world_size=2, vocab=VOCAB, tp=2)
    saved, state = load_model_state_for(root, 2, 1, rank, 0)
    assert saved.model.padded_vocab_size == saved.args.padded_vocab_size == 256
    model = GPT2Model(cfg.model, Stage.of(4, 1, 0), 0, dist.group.WORLD).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return gather_from_tp(model(tokens), dist.group.WORLD)[..., :VOCAB]


def test_logits_equal_at_every_layout(ckpts):
    tokens, _ = batch(vocab=VOCAB, b=2)
    ref = _forward_serial(1, 1, str(ckpts / "tp2pp2"), tokens)
    assert torch.equal(_forward_serial(1, 2, str(ckpts / "tp2pp2"), tokens), ref)
    assert torch.equal(_forward_serial(1, 4, str(ckpts / "tp2pp2"), tokens), ref)
    for out in run_distributed(_forward_tp2_body, world_size=2, args=(str(ckpts / "tp2pp2"), tokens)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)   # TP changes float summation order


def test_no_optim_converts_weights_only(ckpts, tmp_path):
    convert(ckpts / "tp2pp2", tmp_path / "w", "--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size",
            4, "--no-optim")
    for p in range(4):
        st = load(_shard_file(tmp_path / "w", 0, p))
        assert "optimizer" not in st and st["iteration"] == 20
    assert "word_embeddings_for_head" in load(_shard_file(tmp_path / "w", 0, 3))["model"]


# ---- bad input: one message each, naming the file and the problem ------------------------------
def _fails(capsys, argv, *needles):
    assert checkpoint_util.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    return err


def _copy(ckpts, tmp_path, name="tp2pp2"):
    dst = tmp_path / "src"
    shutil.copytree(ckpts / name, dst)
    return dst


def test_force_replaces_only_a_previous_output(ckpts, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _fails(capsys, ["--load-dir", ckpts / "tp2pp2", "--save-dir", out, "--force"], str(out), "not a previous output")
    assert (out / "keep.txt").read_text() == "x"
    os.remove(out / "keep.txt")
    assert checkpoint_util.main(["--load-dir", str(ckpts / "tp2pp2"), "--save-dir", str(out)]) == 0
    _fails(capsys, ["--load-dir", ckpts / "tp2pp2", "--save-dir", out], str(out), "not empty", "--force")
    assert checkpoint_util.main(["--load-dir", str(ckpts / "tp2pp2"), "--save-dir", str(out), "--force",
                                 "--target-tensor-parallel-size", "1"]) == 0
    assert sorted(os.listdir(out / IT)) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert sorted(os.listdir(tmp_path)) == ["out"]                          # no staging or old copy left


def test_missing_tracker_and_missing_shard(ckpts, tmp_path, capsys):
    src = _copy(ckpts, tmp_path)
    os.remove(src / "latest_checkpointed_iteration.txt")
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], "latest_checkpointed_iteration.txt", "missing")
    (src / "latest_checkpointed_iteration.txt").write_text("20")
    shutil.rmtree(src / IT / "mp_rank_01_001")
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], "mp_rank_01_001", "missing")
    assert not (tmp_path / "o").exists()


def test_truncated_shard_is_named(ckpts, tmp_path, capsys):
    src = _copy(ckpts, tmp_path)
    path = _shard_file(src, 1, 0)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], path, "is truncated")
    assert sorted(os.listdir(tmp_path)) == ["src"]                          # no output, no staging folder


def test_inconsistent_shards_are_named(ckpts, tmp_path, capsys):
    src = _copy(ckpts, tmp_path)
    path = _shard_file(src, 1, 1)
    os.remove(os.path.join(os.path.dirname(path), "identity.json"))    # a shard saved before identities: its
    st = load(path)                                                     # contents are what tell the runs apart
    del st["identity"]
    st["iteration"] = 30
    torch.save(st, path)
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], path, "iteration 30")
    st["iteration"] = 20
    st["args"].hidden_size = st["model_config"]["hidden_size"] = 64
    torch.save(st, path)
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], path, "hidden_size")
    st["args"].hidden_size = st["model_config"]["hidden_size"] = 32
    st["model"]["language_model"]["encoder"]["layers.0.mlp.dense_h_to_4h.weight"] = torch.zeros(3, 32)
    torch.save(st, path)
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], "dense_h_to_4h.weight", "shapes")


def test_missing_distrib_optim_and_missing_optimizer(ckpts, tmp_path, capsys):
    src = _copy(ckpts, tmp_path, "zero_dp4")
    os.remove(src / IT / "mp_rank_00" / "distrib_optim.pt")
    _fails(capsys, ["--load-dir", src, "--save-dir", tmp_path / "o"], "distrib_optim.pt", "missing")
    # weights-only source: optimizer conversion is skipped, not faked
    convert(ckpts / "tp2pp2", tmp_path / "w", "--no-optim")
    convert(tmp_path / "w", tmp_path / "w1", "--target-tensor-parallel-size", 1)
    assert "optimizer" not in load(tmp_path / "w1" / IT / "mp_rank_00_000" / "model_optim_rng.pt")


def test_bad_target_layout(ckpts, tmp_path, capsys):
    _fails(capsys, ["--load-dir", ckpts / "tp2pp2", "--save-dir", tmp_path / "o", "--target-tensor-parallel-size", 3],
           "attention heads")
    _fails(capsys, ["--load-dir", ckpts / "tp2pp2", "--save-dir", tmp_path / "o",
                    "--target-pipeline-parallel-size", 3], "4 layers")


# ---- resume at a new layout ---------------------------------------------------------------------
from train_helpers import TINY_TRAIN, run_training  # noqa: E402


@pytest.mark.slow  # --quick skips it (8-process runs); the quick tier keeps conversion (round trips above) and
                   # resume (test_training.py::test_exact_resume) as separate checks
def test_train_222_convert_111_resume_gives_same_losses(embedded_data, tmp_path):
    """Train at (tp, pp, dp) = (2, 2, 2) for 2 iterations, save, convert to (1, 1, 1), resume for
    2 more: the losses equal continuing at (2, 2, 2) (float32 summation order differs: rel 2e-5)."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    par = ["--tensor-parallel", "2", "--pipeline-parallel", "2"]
    ck, ck1 = tmp_path / "ck", tmp_path / "ck111"
    first = run_training(base + par + ["--exit-interval", "2", "--save", str(ck)], 8)
    assert first["iteration"] == 2
    convert(ck, ck1, "--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size", 1,
            "--target-data-parallel-size", 1)
    resumed = run_training(base + ["--load", str(ck1)], 1)
    continued = run_training(base + par + ["--load", str(ck)], 8)
    assert resumed["iteration"] == continued["iteration"] == 4 and resumed["consumed"] == continued["consumed"]
    got, want = [l for _, l in resumed["losses"]], [l for _, l in continued["losses"]]
    assert len(got) == 2 and got == pytest.approx(want, rel=2e-5), (got, want)


@pytest.mark.slow  # --quick skips it; test_target_pipeline_split below converts an uneven checkpoint too
def test_uneven_pipeline_stages_convert_to_any_layout(tmp_path):
    """A pp 2 checkpoint with --decoder-last-pipeline-num-layers 1 (stages of 3 and 1 layers)
    holds the same model as pp 1 trained alike; it converts to pp 1, to tp 2 (same split) and
    to pp 4 (even split)."""
    save_tiny_checkpoint(str(tmp_path / "uneven"), 1, 2, extra=["--decoder-last-pipeline-num-layers", "1"])
    save_tiny_checkpoint(str(tmp_path / "serial"), 1, 1)
    layers = [{k.split(".")[3] for k in flatten_model_state(load(_shard_file(tmp_path / "uneven", 0, p))["model"])
               if ".layers." in k} for p in range(2)]
    assert layers == [{"0", "1", "2"}, {"0"}]                          # stage-local indices
    convert(tmp_path / "uneven", tmp_path / "one", "--target-pipeline-parallel-size", 1)
    got = flatten_model_state(load(tmp_path / "one" / IT / "mp_rank_00" / "model_optim_rng.pt")["model"])
    want = flatten_model_state(load(tmp_path / "serial" / IT / "mp_rank_00" / "model_optim_rng.pt")["model"])
    assert got.keys() == want.keys()
    for k in want:                     # dummy vocabulary rows: zeros after conversion, ignored
        g, w = (_zero_dummy(t, 0) if is_vocab_parallel(k) else t for t in (got[k], want[k]))
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    convert(tmp_path / "uneven", tmp_path / "same", "--target-tensor-parallel-size", 2)   # same pp: same split
    same = load(_shard_file(tmp_path / "same", 1, 0))
    assert same["args"].decoder_last_pipeline_num_layers == 1
    assert "language_model.encoder.layers.2.input_layernorm.weight" in flatten_model_state(same["model"])
    convert(tmp_path / "uneven", tmp_path / "pp4", "--target-pipeline-parallel-size", 4)  # other pp: even split
    pp4 = load(_shard_file(tmp_path / "pp4", 0, 1))
    assert pp4["args"].decoder_last_pipeline_num_layers is None
    assert "language_model.encoder.layers.1.input_layernorm.weight" not in flatten_model_state(pp4["model"])


def test_target_pipeline_split(tmp_path, capsys):
    """--target-decoder-first/last-pipeline-num-layers choose the target's stages: [3, 1] -> [1, 3]
    -> [3, 1] gives back the original shards bitwise (but the dummy vocabulary rows); a split that cannot be made is
    refused."""
    save_tiny_checkpoint(str(tmp_path / "uneven"), 1, 2, extra=["--decoder-last-pipeline-num-layers", "1"])
    convert(tmp_path / "uneven", tmp_path / "first1", "--target-decoder-first-pipeline-num-layers", 1)
    first1 = [load(_shard_file(tmp_path / "first1", 0, p)) for p in range(2)]
    assert [a["args"].decoder_first_pipeline_num_layers for a in first1] == [1, 1]
    assert [a["args"].decoder_last_pipeline_num_layers for a in first1] == [None, None]
    layers = [{k.split(".")[3] for k in flatten_model_state(a["model"]) if ".layers." in k} for a in first1]
    assert layers == [{"0"}, {"0", "1", "2"}]
    convert(tmp_path / "first1", tmp_path / "back", "--target-decoder-last-pipeline-num-layers", 1)
    for p in range(2):
        compare_shards(load(_shard_file(tmp_path / "uneven", 0, p)), load(_shard_file(tmp_path / "back", 0, p)),
                       0, f"stage {p}")
    rc = checkpoint_util.main(["--load-dir", str(tmp_path / "uneven"), "--save-dir", str(tmp_path / "bad"),
                               "--target-decoder-last-pipeline-num-layers", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and "--decoder-last-pipeline-num-layers 5 must be between 1 and --num-layers 4" in err
    assert not (tmp_path / "bad").exists()


def test_resuming_with_another_pipeline_split_is_refused():
    from megapar.config.settings import ModelConfig
    from megapar.checkpoint import CheckpointError, check_compatible, read_saved_config
    from megapar.topology import Topology
    layout = dict(num_layers=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    saved = read_saved_config({"args": argparse.Namespace(**layout, decoder_last_pipeline_num_layers=1)})
    with pytest.raises(CheckpointError, match=r"holds \[3, 1\] layers per pipeline stage, but this run splits them "
                                              r"\[2, 2\]; set --decoder-first/last-pipeline-num-layers"):
        check_compatible(saved, ModelConfig(num_layers=4), Topology(1, 2, 1), "ck")
    check_compatible(saved, ModelConfig(num_layers=4, decoder_first_pipeline_num_layers=3), Topology(1, 2, 1),
                     "ck")  # the same stages  # the same stages
