"""The user tools: each megapar/cli module has main(argv), setup.py names it as a console script,
tools/<tool>.py is a shim onto it, and neither tools/ nor benchmarks/ patches sys.path."""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli_tools() -> list[str]:
    """setup.py's CLI_TOOLS list (read, not run: running setup.py would install)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "CLI_TOOLS")
    return ast.literal_eval(node.value)


def test_console_scripts_cover_every_cli_module():
    modules = sorted(p.stem for p in (ROOT / "megapar" / "cli").glob("*.py") if p.stem != "__init__")
    assert sorted(cli_tools()) == modules


@pytest.mark.parametrize("tool", cli_tools())
def test_tool_shim_runs_the_package_main(tool):
    main = importlib.import_module(f"megapar.cli.{tool}").main
    assert callable(main)
    shim = (ROOT / "tools" / f"{tool}.py").read_text()
    assert f"from megapar.cli.{tool} import main" in shim and len(shim.splitlines()) <= 6


def test_no_sys_path_patches_in_tools_or_benchmarks():
    for folder in ("tools", "benchmarks"):
        for path in (ROOT / folder).glob("*.py"):
            assert "sys.path.insert" not in path.read_text(), path


def test_shim_gives_one_line_errors():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_losses.py"), "/dev/null", "/dev/null"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_generate_text_help_shows_the_sampling_defaults_and_an_example_that_exists():
    """--help shows each sampling default, and its first example loads the folder that the training script
    saves to when run with no flags."""
    from megapar.cli.generate_text import build_parser
    from megapar.pretrain_gpt2 import parse
    text = build_parser().format_help()
    assert text.startswith("usage: python tools/generate_text.py --load CKPT")
    for flag, default in (("--temperature", "1.0"), ("--top-k", "0"), ("--top-p", "0.0"), ("--out-seq-length", "128")):
        block = text[text.index(f"  {flag} "):]
        assert f"(default: {default})" in " ".join(block.split("\n  --")[0].split()), flag
    first = next(line for line in text.splitlines() if line.strip().startswith("python tools/generate_text.py"))
    assert first.split()[3] == parse([], 1).ckpt.save, first


def test_compare_losses_missing_log_is_one_error_line(tmp_path):
    from harness import refused
    refused([sys.executable, str(ROOT / "tools" / "compare_losses.py"), str(tmp_path / "a.log"), "/dev/null"],
            fault_class="bad input", case="compare_losses: a missing log", expect=["no such log file", "a.log"],
            watch=[tmp_path])


def test_every_tool_flag_is_explained():
    """Every flag of the tools (megapar/cli, tools/) has a help text; plan_layout, which prints its own usage
    text instead of argparse's, names every flag in it."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    missing = []
    for path in [*sorted((root / "megapar" / "cli").glob("*.py")), *sorted((root / "tools").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        own_usage = ast.get_docstring(tree) or ""
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                continue
            if any(k.arg == "help" for k in node.keywords):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if path.name == "plan_layout.py" and (not names or all(n in own_usage for n in names)):
                continue          # the loop over shape flags (no literal names) and the flags the usage text names
            missing.append(f"{path.relative_to(root)}:{node.lineno} {names}")
    assert not missing, "flags without help:\n" + "\n".join(missing)
