import dataclasses
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # `from distributed import run_distributed`
sys.path.insert(0, str(ROOT / "tests" / "faults"))  # `from harness import refused`
from data_dirs import GPT2_DIR, SHIPPED, UNSHIPPED  # noqa: E402
from harness import ROWS, Row, table  # noqa: E402
from tiers import TIER_SIZES, TIERS  # noqa: E402


SYSTEM_TEMP = Path(tempfile.gettempdir())


def _temp_entries() -> set[str]:
    """The system temp folder's entries, less pytest's own and multiprocessing's (both removed at exit)."""
    return {p.name for p in SYSTEM_TEMP.iterdir() if not p.name.startswith(("pytest-of-", "pymp-"))}


def pytest_configure(config):
    config.stash_temp_before = _temp_entries()  # what the system temp folder held before the session
    config.addinivalue_line("markers", "training_runs(*runs): GPU training runs (tests/gpu_runs.py Run) a test "
                                       "reads; the session starts them together")


def pytest_collection_modifyitems(config, items):
    # before -m/-k deselect any (pytest calls conftest hooks before its own): each tier's size, when the
    # session collected the whole suite (tests/docs/test_testing_doc.py compares them with docs/testing.md)
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    config.stash[TIER_SIZES] = {tier: sum(map(keep, items)) for tier, keep in TIERS.items()} if whole else None
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:  # tests that wait for training runs last: the other GPU tests run while they train
        items.sort(key=lambda item: item.get_closest_marker("training_runs") is not None)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_checks.sh on a lent GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `serial` runs while no other test of the session runs, also when pytest-xdist
    runs tests in several worker processes: it holds the session's lock file exclusively, every
    other test holds it shared (from the setup of its fixtures to their teardown). A serial test
    first takes a gate that the others pass through before they take the lock, so that workers
    starting test after test cannot keep it waiting."""
    if not hasattr(item.config, "workerinput"):  # one process runs the tests one after another
        yield
        return
    folder = Path(item.config.option.basetemp).parent  # each worker's temporary folder lies in the session's
    alone = item.get_closest_marker("serial") is not None
    mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    with open(folder / "serial.gate", "a") as gate, open(folder / "serial.lock", "a") as lock:
        fcntl.flock(gate, mode)
        fcntl.flock(lock, mode)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases the locks


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its rows of the fault table (tests/faults/harness.py) to the
    controller, which prints them with its own."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fault_rows"] = [dataclasses.astuple(r) for r in ROWS]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    ROWS.extend(Row(*r) for r in getattr(node, "workeroutput", {}).get("fault_rows", []))


def pytest_terminal_summary(terminalreporter, config):
    """The fault table: one row per refused() case the session ran, wherever it ran; and what appeared in the system
    temp folder during the session (the tests' own files go to the session's folder, see _session_temp_folder; other
    programs running at the same time may show up here too)."""
    new = sorted(_temp_entries() - getattr(config, "stash_temp_before", set()))
    if new and not hasattr(config, "workerinput"):
        terminalreporter.write_sep("-", f"new in {SYSTEM_TEMP} during the session (nothing should be)")
        terminalreporter.write_line(", ".join(new[:20]) + (f" and {len(new) - 20} more" if len(new) > 20 else ""))
    if ROWS:
        terminalreporter.write_sep("-", "fault injection")
        terminalreporter.write_line(table())


@pytest.fixture(scope="session")
def real_data() -> Path:
    """tests/data: the real GPT-2 BPE files and corpora shipped with megapar."""
    return SHIPPED


@pytest.fixture(scope="session")
def unshipped_data():
    """unshipped_data(relative path) -> that path under ../shared/data; the test skips when it is absent
    (tests/data/SOURCE.md lists what is not shipped, why, and the stand-ins of tests/standin_data.py)."""
    def find(rel: str) -> Path:
        path = UNSHIPPED / rel
        if not path.exists():
            pytest.skip(f"optional data {rel} is not shipped with megapar (no licence to redistribute it); "
                        f"put it under {UNSHIPPED} (or name its folder in MEGAPAR_UNSHIPPED_DATA) to run this test")
        return path
    return find


@pytest.fixture(scope="session")
def gpt2_files() -> tuple[str, str]:
    """(vocab_file, merge_file) for GPT-2 BPE (OpenAI's originals, shipped in tests/data/gpt2)."""
    return str(GPT2_DIR / "encoder.json"), str(GPT2_DIR / "vocab.bpe")


@pytest.fixture(scope="session")
def embedded_data(tmp_path_factory):
    """The embedded-default dataset (stdlib docstrings + SentencePiece), built once per session."""
    from megapar.data.embedded import prepare_embedded_dataset
    info = prepare_embedded_dataset(str(tmp_path_factory.mktemp("embedded")))
    return ["--data-path", info["data_prefix"], "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", info["tokenizer_model"]]


@pytest.fixture(scope="session")
def gpu_data(tmp_path_factory):
    """The embedded corpus tokenised with the GPT-2 BPE files in $GPT2_DIR (default: the shipped tests/data/gpt2)."""
    from megapar.data.embedded import prepare_embedded_dataset
    d = os.environ.get("GPT2_DIR", str(GPT2_DIR))
    vocab, merges = os.path.join(d, "encoder.json"), os.path.join(d, "vocab.bpe")
    if not os.path.exists(vocab):
        pytest.skip(f"GPT-2 BPE files not found in {d}")
    info = prepare_embedded_dataset(str(tmp_path_factory.mktemp("embedded")), vocab_file=vocab, merge_file=merges)
    return ["--data-path", info["data_prefix"], "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
            "--merge-file", merges]


@pytest.fixture(scope="session")
def gpu_runs(gpu_data, tmp_path_factory, request):
    """The training runs of the selected GPU tests, started together (tests/gpu_runs.py)."""
    from gpu_runs import GpuRuns, runs_of
    runner = GpuRuns(gpu_data, str(tmp_path_factory.mktemp("gpu_runs")))
    runner.start(runs_of(request.session.items))
    yield runner
    runner.close()


@pytest.fixture(autouse=True)
def _start_training_runs(request):
    """The first GPU test of a session starts the training runs (in the background), if any
    selected test reads one."""
    if "gpu" in request.keywords and any(i.get_closest_marker("training_runs") for i in request.session.items):
        try:
            request.getfixturevalue("gpu_runs")
        except pytest.skip.Exception:  # no GPT-2 BPE files: the tests that read runs skip themselves
            pass


@pytest.fixture(scope="session", autouse=True)
def _session_temp_folder(tmp_path_factory):
    """The temporary files of the tests and of the processes they start (tempfile users, torch.multiprocessing's
    pytorch-errorfile-*.pickle) land in a folder of the session's, which pytest removes with the rest of its
    temporary folders when the session passes (tmp_path_retention_policy in pyproject.toml)."""
    import multiprocessing.util
    multiprocessing.util.get_temp_dir()  # multiprocessing's own folder stays where it removes it at exit, after pytest
    folder = tmp_path_factory.mktemp("tmp")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), str(folder)
    yield folder
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]
