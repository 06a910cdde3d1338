"""Every entry point answers `--help` with its usage and exits 0, doing nothing else.

The entry points are discovered, so a new one is covered without editing this file: every file in scripts/ (run with
bash), every Python file in tools/ and benchmarks/ that runs as a program, and every module of megapar/ and data_prep/
that does (`python -m`). Each runs in a copy of the repository with its own empty temporary folder; nothing may appear
in either.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPIED = ["scripts", "tools", "benchmarks", "megapar", "data_prep", "configs", "csrc", "setup.py", "pyproject.toml",
          "requirements.txt", "requirements-dev.txt"]
MAIN = '__name__ == "__main__"'


def _programs(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if MAIN in p.read_text())


def entry_points() -> list[tuple[str, list[str]]]:
    """(name, command relative to the repository root) for every entry point."""
    found = [(f"scripts/{p.name}", ["bash", f"scripts/{p.name}", "--help"])
             for p in sorted((ROOT / "scripts").iterdir()) if p.is_file()]
    for folder in ("tools", "benchmarks"):
        found += [(str(p.relative_to(ROOT)), [sys.executable, str(p.relative_to(ROOT)), "--help"])
                  for p in _programs(folder)]
    for package in ("megapar", "data_prep"):
        for p in _programs(package):
            module = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            found.append((f"-m {module}", [sys.executable, "-m", module, "--help"]))
    return found


def _files(folder: Path) -> set[str]:
    """The files under folder, less torch's compile cache folder that importing torch may create in TMPDIR."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "torchinductor_" not in str(p)}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of what the entry points run from: whatever one writes shows up here."""
    root = tmp_path_factory.mktemp("help_tree")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
        elif src.exists():
            shutil.copy2(src, root / name)
    (root / "tmp").mkdir()
    return root


def test_entry_points_are_found():
    names = [n for n, _ in entry_points()]
    assert {"scripts/install.sh", "scripts/layout_check.sh", "tools/compare_losses.py",
            "-m megapar.config.recipes"} <= set(names)


def _params():
    """The scripts and tools in every tier; the benchmarks and modules (each a torch import) in the full suite."""
    return [pytest.param(n, c, id=n, marks=[] if n.startswith(("scripts/", "tools/")) else [pytest.mark.slow])
            for n, c in entry_points()]


@pytest.mark.parametrize("name,cmd", _params())
def test_help(tree, name, cmd):
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(tree / "tmp"),
           "OMP_NUM_THREADS": "1"}
    before = _files(tree)
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"{name} --help: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert "usage" in r.stdout.lower() and len(r.stdout.splitlines()) >= 2, f"{name}: no usage:\n{r.stdout}"
    assert _files(tree) == before, f"{name} --help wrote {sorted(_files(tree) - before)}"
