"""The harness itself: a refused command passes, an accepted one or a traceback fails the check."""
import pytest

from harness import refused


def test_missing_checkpoint_directory_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    refused(["python", "tools/checkpoint_util.py", "--load-dir", tmp_path / "nope", "--save-dir", tmp_path / "out"],
            fault_class="checkpoint", case="--load-dir does not exist", expect="does not exist", watch=[tmp_path])


def test_harness_catches_a_traceback_and_a_success(tmp_path):
    with pytest.raises(AssertionError, match="traceback"):
        refused(["python", "-c", "raise ValueError('x')"], fault_class="harness", case="traceback", expect="x")
    with pytest.raises(AssertionError, match="exited 0"):
        refused(["python", "-c", "print('error: fine')"], fault_class="harness", case="success", expect="fine")
    from harness import ROWS
    del ROWS[-2:]  # not user faults: keep them out of the table
