"""tools/convert_to_hf.py: transformers' GPT2LMHeadModel gives megapar's logits."""
import json

import pytest
import torch

from ckpt_fixtures import VOCAB, save_tiny_checkpoint
from gpt_helpers import batch, tiny_model_config
from megapar.model import GPT2Model, Stage
from megapar.reshard import load_model_state_for

transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
from megapar.cli import convert_to_hf  # noqa: E402


@pytest.mark.parametrize("tp,pp", [pytest.param(2, 2, marks=pytest.mark.slow), (1, 1)])
def test_hf_export_matches_megapar_logits(tmp_path, tp, pp):
    save_tiny_checkpoint(str(tmp_path / "ck"), tp=tp, pp=pp, steps=1)
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf")]) == 0
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


def test_hf_export_refuses_non_empty_dir(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("x")
    save_tiny_checkpoint(str(tmp_path / "ck"), tp=1, pp=1, steps=0)
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf")]) == 1
    assert "not empty" in capsys.readouterr().err
    assert convert_to_hf.main(["--load-dir", str(tmp_path / "ck"), "--save-dir", str(tmp_path / "hf"), "--force"]) == 1
    assert "not a previous output" in capsys.readouterr().err and (tmp_path / "hf" / "x").read_text() == "x"
