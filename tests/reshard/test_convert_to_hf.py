"""tools/convert_to_hf.py: transformers' GPT2LMHeadModel gives megapar's logits, and AutoTokenizer of the
export encodes text as megapar's tokenizer does."""
import json
import os
import sys

from pathlib import Path

import pytest
import torch

from ckpt_fixtures import VOCAB, save_tiny_checkpoint
from gpt_helpers import batch, tiny_model_config
from megapar.fp8 import torchao_quietly
from megapar.model import GPT2Model, Stage
from megapar.reshard import load_model_state_for

with torchao_quietly():  # transformers imports torchao (when installed) with its models
    transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
    transformers.GPT2LMHeadModel, transformers.AutoTokenizer
from megapar.cli import convert_to_hf  # noqa: E402


@pytest.mark.parametrize("tp,pp", [pytest.param(2, 2, marks=pytest.mark.slow), (1, 1)])
def test_hf_export_matches_megapar_logits(tmp_path, tp, pp):
    save_tiny_checkpoint(str(tmp_path / "ck"), tp=tp, pp=pp, steps=1)
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf"),
                               "--no-tokenizer"]) == 0
    cfg_json = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg_json["vocab_size"] == VOCAB and cfg_json["activation_function"] == "gelu_new"

    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    assert hf.transformer.wte.weight.shape == (VOCAB, 32)             # dummy rows removed

    cfg = tiny_model_config([], vocab=VOCAB)
    _, state = load_model_state_for(str(tmp_path / "ck"), 1, 1, 0, 0)
    ours = GPT2Model(cfg.model, Stage.of(4, 1, 0), 0).eval()
    ours.load_state_dict(state)
    tokens, _ = batch(vocab=VOCAB, b=2)
    with torch.no_grad():
        want = ours(tokens)[..., :VOCAB]
        got = hf(tokens).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)        # attention kernels differ in rounding
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_safetensors_file_gets_the_user_file_mode(tmp_path):
    """save_file alone writes 0o600; give_user_file_mode gives what open() would (0o666 less the umask)."""
    from safetensors.torch import save_file
    from megapar.atomic import give_user_file_mode
    old = os.umask(0o027)
    try:
        save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
        give_user_file_mode(tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    assert oct((tmp_path / "model.safetensors").stat().st_mode & 0o777) == "0o640"
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no probe file left


@pytest.mark.slow  # --quick skips it (a checkpoint and an export); the test above is the cheap sibling
def test_hf_export_files_follow_the_umask(tmp_path):
    """model.safetensors gets the mode of every other file the user creates (save_file alone makes it 0o600)."""
    save_tiny_checkpoint(str(tmp_path / "ck"), tp=1, pp=1, steps=0)
    old = os.umask(0o027)
    try:
        assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf"),
                                   "--no-tokenizer"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert modes == {"config.json": "0o640", "model.safetensors": "0o640"}


def test_hf_export_refuses_non_empty_dir(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("x")
    save_tiny_checkpoint(str(tmp_path / "ck"), tp=1, pp=1, steps=0)
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf"), "--force"]) == 2
    assert "not a previous output" in capsys.readouterr().err and (tmp_path / "hf" / "x").read_text() == "x"


# ---- the tokenizer beside the model ---------------------------------------------------------------
from ckpt_fixtures import write_hf_gpt2  # noqa: E402
from megapar.cli import convert_from_hf  # noqa: E402
from megapar.data.tokenizer import build_tokenizer  # noqa: E402
from synthetic_data import byte_gpt2_files  # noqa: E402

def real_texts(corpora: Path) -> list[str]:
    """Web documents, and paragraphs of a novel and of a play (real text of every kind of character)."""
    web = [p.read_text() for p in sorted((corpora / "webtext_gpt2_sample").glob("*.txt"))]
    emma = (corpora / "gutenberg_emma" / "austen-emma.txt").read_text()[:30000]
    play = (corpora / "tinyshakespeare" / "input.txt").read_text()[:30000]
    return web + emma.split("\n\n")[:200] + [play]


def imported_checkpoint(tmp_path, vocab: int, *tokenizer_flags) -> str:
    """A checkpoint whose args name `tokenizer_flags`' files (an HF import is the cheapest way to write one)."""
    write_hf_gpt2(tmp_path / "hf_in", vocab=vocab)
    argv = ["--load-dir", str(tmp_path / "hf_in"), "--save-dir", str(tmp_path / "ck"), *map(str, tokenizer_flags)]
    assert convert_from_hf.main(argv) == 0
    return str(tmp_path / "ck")


def test_exported_gpt2_tokenizer_encodes_as_megapar(tmp_path, capsys, real_data, gpt2_files):
    vocab, merges = gpt2_files
    ck = imported_checkpoint(tmp_path, 50257, "--vocab-file", vocab, "--merge-file", merges)
    capsys.readouterr()
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", str(tmp_path / "hf")]) == 0
    assert "wrote tokenizer: GPT-2 BPE (vocab.json, merges.txt, tokenizer_config.json" in capsys.readouterr().out
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert len(hf) == 50257 and hf.eos_token_id == ours.eod == 50256
    assert hf("Hello world")["input_ids"] == [15496, 995]
    for text in real_texts(real_data / "corpora"):
        assert hf(text)["input_ids"] == ours.tokenize(text), text[:80]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == 50256


def test_exported_sentencepiece_tokenizer_encodes_as_megapar(tmp_path, capsys, real_data):
    from megapar.data.train_tokenizer import train_sentencepiece
    model = train_sentencepiece([str(real_data / "corpora" / "tinyshakespeare" / "input.txt")], str(tmp_path / "spm"),
                                1000)
    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    ck = imported_checkpoint(tmp_path, ours.vocab_size, "--tokenizer-model", model)
    capsys.readouterr()
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", str(tmp_path / "hf")]) == 0
    assert "wrote tokenizer: SentencePiece (tokenizer.model, tokenizer_config.json" in capsys.readouterr().out
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert len(hf) == ours.vocab_size and hf.eos_token_id == ours.eod
    # none starts with whitespace (HF's Llama tokenizer drops one leading space)
    for text in real_texts(real_data / "corpora"):
        assert hf(text)["input_ids"] == ours.tokenize(text), text[:80]


def test_tokenizer_options_missing_files_and_no_tokenizer(tmp_path, capsys):
    vocab, merges = byte_gpt2_files(str(tmp_path))
    ck = imported_checkpoint(tmp_path, 265)          # args name GPT-2 BPE without files
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", out]) == 2
    assert "names no GPT-2 BPE --vocab-file to export; pass --vocab-file" in capsys.readouterr().err
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", out, "--vocab-file", vocab, "--merge-file",
                               str(tmp_path / "nope.txt")]) == 2
    assert "cannot read --merge-file" in capsys.readouterr().err and not os.path.exists(out)
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", out, "--no-tokenizer"]) == 0
    assert "warning: --no-tokenizer" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", out, "--force", "--vocab-file", vocab,
                               "--merge-file", merges]) == 0               # --force replaces an export
    assert sorted(os.listdir(out)) == ["config.json", "merges.txt", "model.safetensors", "special_tokens_map.json",
                                       "tokenizer_config.json", "vocab.json"]
    assert convert_to_hf.main(["--load-dir", ck, "--save-dir", out, "--force", "--no-tokenizer"]) == 0
    ck100 = imported_checkpoint(tmp_path / "v100", 100)
    assert convert_to_hf.main(["--load-dir", ck100, "--save-dir", str(tmp_path / "hf100"), "--vocab-file", vocab,
                               "--merge-file", merges]) == 2
    assert "has 265 tokens but the model's vocabulary is 100" in capsys.readouterr().err



def test_sentencepiece_export_names_protobuf_when_it_is_missing(monkeypatch):
    from megapar.reshard import hf_tokenizer
    sp = hf_tokenizer.TokenizerFiles("SentencePieceTokenizer", tokenizer_model="m.model")
    assert hf_tokenizer.reader_note(sp) is None                          # the dev install brings protobuf
    monkeypatch.setitem(sys.modules, "google.protobuf", None)             # as if it were not installed
    assert "pip install protobuf" in hf_tokenizer.reader_note(sp)
    assert hf_tokenizer.reader_note(hf_tokenizer.TokenizerFiles("GPT2BPETokenizer", "v", "m")) is None
