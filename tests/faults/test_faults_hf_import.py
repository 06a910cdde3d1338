"""tools/convert_from_hf.py and the tokenizer of tools/convert_to_hf.py, faulted with real files.

A broken or unrepresentable Hugging Face folder, an impossible target layout or an occupied
--save-dir ends in one `error:` line, with nothing written; so does an export whose tokenizer
files are gone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness import ROOT, refused, run

sys.path.insert(0, str(ROOT / "tests"))
from ckpt_fixtures import write_hf_gpt2  # noqa: E402
from synthetic_data import byte_gpt2_files  # noqa: E402

FROM_HF = str(ROOT / "tools" / "convert_from_hf.py")
TO_HF = str(ROOT / "tools" / "convert_to_hf.py")


def from_hf(load, save, *extra) -> list:
    return ["python", FROM_HF, "--load-dir", load, "--save-dir", save, *map(str, extra)]


@pytest.fixture
def hf(tmp_path) -> Path:
    """A valid GPT-2 folder (2 layers, 4 heads, vocabulary 100)."""
    write_hf_gpt2(tmp_path / "hf")
    return tmp_path / "hf"


def test_missing_folder_is_refused(tmp_path):
    refused(from_hf(tmp_path / "nope", tmp_path / "ck"), fault_class="hf import", case="--load-dir does not exist",
            expect="does not exist", watch=[tmp_path])


def test_missing_config_is_refused(hf, tmp_path):
    (hf / "config.json").unlink()
    refused(from_hf(hf, tmp_path / "ck"), fault_class="hf import", case="no config.json",
            expect="config.json is missing", watch=[tmp_path])


def test_malformed_config_is_refused(hf, tmp_path):
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2,')
    refused(from_hf(hf, tmp_path / "ck"), fault_class="hf import", case="config.json not JSON",
            expect="is not valid JSON", watch=[tmp_path])


def test_missing_weights_are_refused(hf, tmp_path):
    (hf / "model.safetensors").unlink()
    refused(from_hf(hf, tmp_path / "ck"), fault_class="hf import", case="no weight file",
            expect=["holds no weights", "model.safetensors"], watch=[tmp_path])


def test_truncated_safetensors_is_refused(hf, tmp_path):
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(from_hf(hf, tmp_path / "ck"), fault_class="hf import", case="truncated model.safetensors",
            expect=["model.safetensors is truncated or corrupt"], watch=[tmp_path])


def test_heads_not_divisible_by_target_tp_are_refused(hf, tmp_path):
    refused(from_hf(hf, tmp_path / "ck", "--target-tensor-parallel-size", 3), fault_class="hf import",
            case="4 heads at target tp 3", expect=["not divisible", "3"], watch=[tmp_path])


def test_unrepresentable_setting_is_refused(hf, tmp_path):
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "scale_attn_by_inverse_layer_idx": True}))
    refused(from_hf(hf, tmp_path / "ck"), fault_class="hf import", case="scale_attn_by_inverse_layer_idx true",
            expect="scale_attn_by_inverse_layer_idx", watch=[tmp_path])


def test_non_empty_save_dir_is_refused(hf, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    refused(from_hf(hf, tmp_path / "mine", "--force"), fault_class="hf import",
            case="--force onto a folder that is not a previous output", expect="not a previous output",
            watch=[tmp_path])
    assert run(from_hf(hf, tmp_path / "ck")).rc == 0
    refused(from_hf(hf, tmp_path / "ck"), fault_class="hf import", case="--save-dir holds an import, no --force",
            expect=["exists and is not empty", "--force"], watch=[tmp_path])
    again = run(from_hf(hf, tmp_path / "ck", "--force", "--target-pipeline-parallel-size", 2))
    assert again.rc == 0 and (tmp_path / "ck" / "release" / "mp_rank_00_001").is_dir(), again.output[-2000:]


def test_export_with_missing_tokenizer_files_is_refused(hf, tmp_path):
    from megapar.cli import convert_from_hf
    write_hf_gpt2(hf, vocab=265)                                     # the byte-level vocabulary
    vocab, merges = byte_gpt2_files(str(tmp_path))
    assert convert_from_hf.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "ck"), "--vocab-file", vocab,
                                 "--merge-file", merges]) == 0
    Path(vocab).unlink()                  # the checkpoint's args name it; it is gone
    refused(["python", TO_HF, "--load-dir", tmp_path / "ck", "--save-dir", tmp_path / "out"],
            fault_class="hf export", case="tokenizer --vocab-file gone",
            expect=["cannot export the tokenizer", "cannot read --vocab-file", "--no-tokenizer"], watch=[tmp_path])
