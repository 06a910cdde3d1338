"""The Format registry: each name finds its format, and `detect` tells the formats' real folders apart
(a legacy checkpoint written as training writes it, and its torch_dist conversion)."""
import os
import shutil

import pytest

from ckpt_fixtures import save_tiny_checkpoint
from megapar.checkpoint import detect, format_named, iter_dir, legacy
from megapar.checkpoint.dist import COMMON_FILE, DistFormat
from megapar.checkpoint.formats import NAMES
from megapar.config.settings import CheckpointConfig
from megapar.reshard import open_source
from megapar.reshard.torch_dist import write_dist

ITERATION = 20


def test_each_format_is_found_by_the_name_the_flag_takes():
    """--ckpt-format's choices (the config cannot import the checkpoint package) are the registry's names."""
    assert set(CheckpointConfig.__dataclass_fields__["ckpt_format"].metadata["choices"]) == set(NAMES)
    assert all(format_named(n).name == n for n in NAMES)
    assert format_named("torch") is legacy.FORMAT and isinstance(format_named("torch_dist"), DistFormat)
    with pytest.raises(ValueError, match="'zarr' is not one of"):
        format_named("zarr")


def test_legacy_refuses_a_background_save():
    with pytest.raises(ValueError, match="saves synchronously only"):
        legacy.FORMAT.save("unused", 1, None, None, saves=object())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(legacy root, torch_dist root) of one tiny model."""
    base = tmp_path_factory.mktemp("formats")
    root, dist_root = str(base / "legacy"), str(base / "dist")
    save_tiny_checkpoint(root, tp=1, pp=1, iteration=ITERATION)
    write_dist(open_source(root), dist_root, log=lambda *_: None)
    return root, dist_root


def test_detect_tells_the_formats_apart(saved, tmp_path):
    root, dist_root = saved
    assert detect(iter_dir(root, ITERATION)) is legacy.FORMAT
    assert detect(iter_dir(dist_root, ITERATION)).name == "torch_dist"
    assert legacy.FORMAT.holds(iter_dir(root, ITERATION)) and not legacy.FORMAT.holds(iter_dir(dist_root, ITERATION))
    assert not format_named("torch_dist").holds(iter_dir(root, ITERATION))
    # a missing or empty folder is read as legacy, whose loader names what is missing
    assert detect(str(tmp_path / "nowhere")) is legacy.FORMAT
    assert detect(str(tmp_path)) is legacy.FORMAT


def test_a_torch_dist_folder_that_lost_a_file_is_still_torch_dist(saved, tmp_path):
    """Reported as an incomplete torch_dist checkpoint, never misread as a legacy one."""
    _, dist_root = saved
    for lost in (COMMON_FILE, ".metadata"):
        copy = str(tmp_path / lost.strip("."))
        shutil.copytree(iter_dir(dist_root, ITERATION), copy)
        os.remove(os.path.join(copy, lost))
        assert detect(copy).name == "torch_dist", lost
