"""tools/convert_from_hf.py: a Hugging Face GPT-2 folder becomes a megapar checkpoint at any layout
whose logits are transformers' logits; HF -> megapar -> HF gives the same tensors; training
fine-tunes from it; what megapar cannot represent is refused by name."""
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_fixtures import write_hf_gpt2
from distributed import run_distributed
from gpt_helpers import batch
from megapar.config.build import parse_config
from megapar.checkpoint import MODEL_FILE, load_checkpoint, read_tracker
from megapar.cli import convert_from_hf, convert_to_hf
from megapar.fp8 import torchao_quietly
from megapar.model import GPT2Model, Stage, set_vocab
from megapar.reshard.hf_source import canonical_names, megapar_flags
from megapar.topology import Topology

VOCAB = 100
HF_CONFIG = dict(n_layer=4, n_embd=32, n_head=4, n_positions=32, n_inner=64, layer_norm_epsilon=1e-6)


def import_hf(hf_dir, out, tp=1, pp=1, *extra) -> None:
    argv = ["--load-dir", str(hf_dir), "--save-dir", str(out), "--target-tensor-parallel-size", str(tp),
            "--target-pipeline-parallel-size", str(pp), *map(str, extra)]
    assert convert_from_hf.main(argv) == 0


def model_config(hf_cfg: dict, tp: int, pp: int):
    """megapar's ModelConfig for the imported model at (tp, pp), from the flags the tool prints."""
    flags = megapar_flags(hf_cfg, 128) + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                          str(pp), "--attention-backend", "torch", "--hidden-dropout", "0",
                                          "--attention-dropout", "0"]
    cfg = parse_config(flags, world_size=tp * pp).model
    set_vocab(cfg, hf_cfg["vocab_size"], tp, log=lambda *_: None)
    return cfg


def forward(root: str, hf_cfg: dict, tp: int, pp: int, tokens, tp_rank: int = 0, tp_group=None) -> torch.Tensor:
    """Logits of TP rank `tp_rank` of the checkpoint at (tp, pp), loaded as training loads it
    (load_checkpoint with --finetune), its pipeline stages run one after another."""
    cfg, topo, x = model_config(hf_cfg, tp, pp), Topology(tp, pp, 1), None
    for p in range(pp):
        model = GPT2Model(cfg, Stage.for_config(cfg, pp, p), 0, tp_group).eval()
        load_checkpoint(root, model, None, None, cfg, topo, topo.rank(tp_rank, 0, p), load_optim=False,
                        load_rng=False, finetune=True)
        model.set_input_tensor(x)
        with torch.no_grad():
            x = model(tokens) if p == 0 else model(None)
    return x


def _forward_tp_body(rank, world, root, hf_cfg, pp, tokens):
    from megapar.tensor_parallel.mappings import gather_from_tp
    topo = Topology(world, 1, 1)
    topo.create_groups(rank)
    return gather_from_tp(forward(root, hf_cfg, world, pp, tokens, rank, topo.groups.tp), topo.groups.tp)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random transformers GPT2LMHeadModel (non-default n_inner and epsilon, every weight
    perturbed so that no bias is zero), saved with save_pretrained; and its logits."""
    with torchao_quietly():  # transformers imports torchao (when installed) with its models
        transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
        transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, **HF_CONFIG)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(str(folder))
    tokens, _ = batch(vocab=VOCAB, b=2)
    with torch.no_grad():
        logits = model(tokens).logits
    return folder, json.loads((folder / "config.json").read_text()), tokens, logits


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_imported_logits_equal_transformers(hf_model, tmp_path, tp, pp):
    folder, hf_cfg, tokens, want = hf_model
    import_hf(folder, tmp_path / "ck", tp, pp)
    assert read_tracker(str(tmp_path / "ck")) == "release"
    shard = "mp_rank_00" if pp == 1 else "mp_rank_00_000"
    state = torch.load(tmp_path / "ck" / "release" / shard / MODEL_FILE, weights_only=False)
    assert state["args"].padded_vocab_size == 128 * tp and state["model_config"]["vocab_size"] == VOCAB
    assert state["model_config"]["layernorm_epsilon"] == 1e-6 and state["model_config"]["ffn_hidden_size"] == 64
    assert "optimizer" not in state and "rng_state" not in state
    if tp == 1:
        got = forward(str(tmp_path / "ck"), hf_cfg, 1, pp, tokens)
    else:
        got = run_distributed(_forward_tp_body, world_size=tp, args=(str(tmp_path / "ck"), hf_cfg, pp, tokens))[0]
    assert not got[..., VOCAB:].any() or torch.isinf(got[..., VOCAB:]).all()     # padded rows: zero weights
    torch.testing.assert_close(got[..., :VOCAB], want, atol=1e-4, rtol=0)


def test_canonical_names_are_the_model_order():
    cfg = model_config({"n_layer": 3, "n_embd": 32, "n_head": 4, "n_positions": 16, "vocab_size": VOCAB}, 1, 1)
    assert canonical_names(3) == list(GPT2Model(cfg, Stage.of(3, 1, 0), 0).state_dict())


@pytest.mark.parametrize("tp,pp", [(2, 2), pytest.param(1, 1, marks=pytest.mark.slow)])
def test_round_trip_hf_megapar_hf_is_identical(tmp_path, tp, pp):
    from safetensors.torch import load_file
    original = write_hf_gpt2(tmp_path / "hf", n_layer=4, n_inner=64, layer_norm_epsilon=1e-6, n_positions=24)
    import_hf(tmp_path / "hf", tmp_path / "ck", tp, pp)
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "back"),
                               "--no-tokenizer"]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == original.keys()
    for k, t in original.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (cfg["n_inner"], cfg["layer_norm_epsilon"], cfg["n_positions"], cfg["vocab_size"]) == (64, 1e-6, 24, VOCAB)


def test_original_gpt2_file_format_imports_the_same(tmp_path):
    """pytorch_model.bin with keys without `transformer.`, the causal-mask buffers, and a tied
    lm_head.weight (as in OpenAI's GPT-2 on the Hub) gives the same checkpoint as safetensors."""
    tensors = write_hf_gpt2(tmp_path / "st")
    os.makedirs(tmp_path / "bin")
    old = {k[len("transformer."):]: t for k, t in tensors.items()}
    old.update({"h.0.attn.bias": torch.ones(1, 1, 32, 32).tril(), "h.1.attn.masked_bias": torch.tensor(-1e4),
                "lm_head.weight": tensors["transformer.wte.weight"].clone()})
    torch.save(old, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    import_hf(tmp_path / "st", tmp_path / "a")
    import_hf(tmp_path / "bin", tmp_path / "b")
    a = torch.load(tmp_path / "a" / "release" / "mp_rank_00" / MODEL_FILE, weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "release" / "mp_rank_00" / MODEL_FILE, weights_only=False)["model"]
    enc_a, enc_b = a["language_model"]["encoder"], b["language_model"]["encoder"]
    assert enc_a.keys() == enc_b.keys() and all(torch.equal(enc_a[k], enc_b[k]) for k in enc_a)
    assert torch.equal(a["language_model"]["embedding"]["word_embeddings"]["weight"],
                       b["language_model"]["embedding"]["word_embeddings"]["weight"])


def set_config(folder, **settings) -> None:
    """Change settings of the folder's config.json (its tensors stay as they are)."""
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **settings}))


@pytest.mark.parametrize("setting,value,expect", [
    ("activation_function", "gelu", "activation_function 'gelu'"),
    ("activation_function", "relu", "tanh approximation"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn"),
    ("add_cross_attention", True, "add_cross_attention"),
    ("scale_attn_weights", False, "scale_attn_weights"),
    ("tie_word_embeddings", False, "tie_word_embeddings"),
    ("model_type", "gpt_neo", "model_type"),
    ("n_layer", 0, "n_layer"),
    ("n_inner", "big", "n_inner"),
    ("layer_norm_epsilon", -1, "layer_norm_epsilon"),
    ("resid_pdrop", "0.1", "resid_pdrop is '0.1'; it must be a number"),
    ("attn_pdrop", 1.5, "--attention-dropout"),
])
def test_unrepresentable_config_is_refused_by_name(tmp_path, capsys, setting, value, expect):
    write_hf_gpt2(tmp_path / "hf")
    set_config(tmp_path / "hf", **{setting: value})
    assert convert_from_hf.main(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expect in err and err.count("\n") == 1, err
    assert not (tmp_path / "ck").exists() and sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("extra,expect", [
    ({"lm_head.weight": torch.ones(VOCAB, 32)}, "lm_head.weight differs"),
    ({"transformer.h.0.attn.q_proj.weight": torch.ones(32, 32)}, "h.0.attn.q_proj.weight"),
])
def test_unrepresentable_weights_are_refused(tmp_path, capsys, extra, expect):
    write_hf_gpt2(tmp_path / "hf", extra_tensors=extra)
    assert convert_from_hf.main(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ck")]) == 2
    assert expect in capsys.readouterr().err and not (tmp_path / "ck").exists()


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path, capsys):
    write_hf_gpt2(tmp_path / "hf", n_positions=32)
    set_config(tmp_path / "hf", n_positions=64)
    assert convert_from_hf.main(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ck")]) == 2
    assert "wpe.weight has shape (32, 32), but config.json implies (64, 32)" in capsys.readouterr().err


def test_tokenizer_files_of_the_folder_are_recorded(tmp_path):
    write_hf_gpt2(tmp_path / "hf")
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "hf" / name).write_text("{}")
    import_hf(tmp_path / "hf", tmp_path / "ck")
    args = torch.load(tmp_path / "ck" / "release" / "mp_rank_00" / MODEL_FILE, weights_only=False)["args"]
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert args.vocab_file == str((tmp_path / "hf" / "vocab.json").resolve())
    assert args.merge_file == str((tmp_path / "hf" / "merges.txt").resolve())


# ---- fine-tuning from an import ------------------------------------------------------------------
from train_helpers import TINY_TRAIN, run_training  # noqa: E402


def _losses(result):
    return [loss for _, loss in result["losses"]]


def _printed_finetune_command(output: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.strip().startswith("bash scripts/pretrain_gpt2.sh"))
    return shlex.split(line, comments=True)


@pytest.mark.slow  # --quick skips it (two training runs); the printed command's check below stays quick
def test_finetuning_an_import_continues_from_its_weights(embedded_data, tmp_path, capsys):
    """Train 8 iterations, export to HF, import at tp 2, fine-tune with the command the importer prints (its
    processes, model and tokenizer flags; or --no-load-optim --no-load-rng instead of --finetune): the losses
    equal those of fine-tuning the original checkpoint, and start far below a fresh model's."""
    base = TINY_TRAIN + embedded_data + ["--lr", "5e-3"]
    first = run_training(base + ["--train-iters", "8", "--save", str(tmp_path / "ck")])
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    import_hf(tmp_path / "hf", tmp_path / "imported", 2, 1)
    printed = _printed_finetune_command(capsys.readouterr().out)
    assert printed[2:4] == ["--nproc-per-node", "2"], printed          # tp 2: two processes, not one
    data = embedded_data[embedded_data.index("--data-path") + 1]
    flags = [data if w == "PREFIX" else w for w in printed[4:]]         # a SentencePiece model: --data-path to fill
    assert flags[flags.index("--load") + 1] == str(tmp_path / "imported") and "--finetune" in flags
    tune = base + ["--train-iters", "2"]
    from_import = _losses(run_training(flags + TINY_TRAIN + ["--lr", "5e-3", "--train-iters", "2"], 2))
    at_tp2 = tune + ["--tensor-model-parallel-size", "2", "--load", str(tmp_path / "imported")]
    without_optim = _losses(run_training(at_tp2 + ["--no-load-optim", "--no-load-rng"], 2))
    from_original = _losses(run_training(tune + ["--finetune", "--load", str(tmp_path / "ck")]))
    fresh = _losses(first)
    assert len(from_import) == 2 and from_import == pytest.approx(from_original, rel=1e-4)
    assert without_optim == pytest.approx(from_import, rel=1e-6)          # a release checkpoint starts at 0
    assert from_import[0] < fresh[0] - 0.5, (from_import, fresh)


def test_sharded_safetensors_import_the_same(tmp_path):
    """model.safetensors.index.json naming two shard files gives the same checkpoint as one file."""
    from safetensors.torch import save_file
    tensors = write_hf_gpt2(tmp_path / "one")
    os.makedirs(tmp_path / "two")
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(tmp_path / "two" / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "two" / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    import_hf(tmp_path / "one", tmp_path / "a", 2, 1)
    import_hf(tmp_path / "two", tmp_path / "b", 2, 1)
    for shard in ("mp_rank_00", "mp_rank_01"):
        a = torch.load(tmp_path / "a" / "release" / shard / MODEL_FILE, weights_only=False)["model"]
        b = torch.load(tmp_path / "b" / "release" / shard / MODEL_FILE, weights_only=False)["model"]
        enc_a, enc_b = a["language_model"]["encoder"], b["language_model"]["encoder"]
        assert all(torch.equal(enc_a[k], enc_b[k]) for k in enc_a)


def test_truncated_pytorch_model_bin_is_named(tmp_path, capsys):
    tensors = write_hf_gpt2(tmp_path / "hf")
    os.remove(tmp_path / "hf" / "model.safetensors")
    torch.save(tensors, tmp_path / "hf" / "pytorch_model.bin")
    data = (tmp_path / "hf" / "pytorch_model.bin").read_bytes()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert convert_from_hf.main(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin is truncated or corrupt" in err and err.count("\n") == 1, err


def test_the_printed_finetune_command_starts_tp_x_pp_processes_and_runs_on_gpt2_files(tmp_path, capsys):
    """With the folder's GPT-2 BPE files the command is complete (the embedded corpus, tokenized with them); it
    names the launcher with tp x pp processes, and its flags parse at that world size."""
    from megapar.pretrain_gpt2 import parse
    write_hf_gpt2(tmp_path / "hf")
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "hf" / name).write_text("{}")
    capsys.readouterr()
    import_hf(tmp_path / "hf", tmp_path / "ck", 2, 2)
    out = capsys.readouterr().out
    words = _printed_finetune_command(out)
    assert words[:4] == ["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", "4"], words
    assert "PREFIX" not in words and "--data-path" not in words and "# on the embedded corpus" in out
    cfg = parse(words[4:], 4)
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (2, 2)
    assert cfg.ckpt.finetune and cfg.ckpt.load == str(tmp_path / "ck") and cfg.ckpt.save == str(tmp_path / "ck") + \
        "_finetuned"
    assert cfg.data.vocab_file == str((tmp_path / "hf" / "vocab.json").resolve())


def test_a_folder_with_only_tokenizer_json_imports_with_its_bpe(tmp_path, capsys):
    """Current transformers saves GPT-2's tokenizer as tokenizer.json alone: its vocabulary and merges are
    written beside the checkpoint (published with it), the checkpoint and the printed command name them, and
    megapar's tokenizer built from them encodes as the original GPT-2 files do."""
    from transformers import GPT2TokenizerFast

    from megapar.data.tokenizer import build_tokenizer
    from megapar.pretrain_gpt2 import parse
    gpt2 = Path(__file__).resolve().parents[1] / "data" / "gpt2"
    write_hf_gpt2(tmp_path / "hf")
    (tmp_path / "src").mkdir()
    shutil.copy(gpt2 / "encoder.json", tmp_path / "src" / "vocab.json")
    shutil.copy(gpt2 / "vocab.bpe", tmp_path / "src" / "merges.txt")
    GPT2TokenizerFast.from_pretrained(str(tmp_path / "src")).save_pretrained(str(tmp_path / "hf"))
    for name in ("vocab.json", "merges.txt"):     # what transformers 4 also wrote
        (tmp_path / "hf" / name).unlink(missing_ok=True)
    capsys.readouterr()
    import_hf(tmp_path / "hf", tmp_path / "ck")
    out = capsys.readouterr().out
    vocab, merges = (tmp_path / "ck" / "vocab.json").resolve(), (tmp_path / "ck" / "merges.txt").resolve()
    args = torch.load(tmp_path / "ck" / "release" / "mp_rank_00" / MODEL_FILE, weights_only=False)["args"]
    assert (args.vocab_file, args.merge_file) == (str(vocab), str(merges))
    cfg = parse(_printed_finetune_command(out)[4:], 1)
    assert (cfg.data.vocab_file, cfg.data.merge_file) == (str(vocab), str(merges))
    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home\n<|endoftext|> ünïcödé"
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    original = build_tokenizer("GPT2BPETokenizer", vocab_file=str(gpt2 / "encoder.json"),
                               merge_file=str(gpt2 / "vocab.bpe"))
    assert ours.vocab_size == original.vocab_size and ours.tokenize(text) == original.tokenize(text)
    import_hf(tmp_path / "hf", tmp_path / "ck", 1, 1, "--force")        # still recognised as an earlier output
    assert (tmp_path / "ck" / "vocab.json").is_file()
