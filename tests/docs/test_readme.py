"""Every command in the README's (and docs/guide.md's) ```bash blocks works as written.

Each command line is checked by what it runs:
  * cheap ones run for real: `--help`, tools/estimate_memory.py, tools/plan_layout.py (and the training command
    it prints is checked as below; `--calibrate` needs a GPU: parsed, and the default calibration written to its
    --out for the next command), tools/preprocess_data.py on a small JSON-lines
    file (with the GPT-2 BPE files shipped in tests/data), `python -m megapar.data.validate`, modules that take no
    argparse flags, tools/convert_from_hf.py (on a small random GPT-2 folder when --load-dir does not exist);
  * training (`bash scripts/pretrain_gpt2.sh`, `python -m megapar.pretrain_gpt2`) is parsed and validated by
    megapar.pretrain_gpt2.parse at the world size the launcher would start (tp x pp on CPU), in the block's
    scratch directory (a --load an earlier command wrote exists), so a bad layout or batch fails here too;
  * every other Python tool is run in-process and stopped the moment its own argparse parser has accepted the
    flags (a checkpoint, a GPU or a download would be needed past that point);
  * shell scripts with their own flag loops (prepare_openwebtext.sh, run_tests.sh, gpu_checks.sh) are run or
    matched against the flags they handle; wrappers around one tools/*.py script check that script's flags.
A misspelled flag, an unknown recipe or config name, or a command this file has no checker for fails the test
(test_a_misspelled_flag_fails shows it can).

Sample outputs: a ```bash block of one command followed (after blank lines only) by a plain ``` block shows that
command's output. The command must print every line of the sample, in order, each whole (trailing blanks ignored);
the sample may leave lines out (a preamble, a table's |---| row), never change one
(test_a_stale_sample_fails shows it can).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from data_dirs import GPT2_DIR
from megapar.launch import LAUNCHER_FLAGS as LAUNCHER_SCRIPT_FLAGS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/guide.md"]
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# ---- extracting commands ----------------------------------------------------------------------
def bash_blocks(doc: str) -> list[tuple[int, list[str]]]:
    """(first line number, command lines) of every ```bash block; continuation lines joined."""
    blocks, lines = [], (ROOT / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            commands, pending = [], ""
            for line in body:
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                full = (pending + line).strip()
                pending = ""
                if full and not full.startswith("#"):
                    commands.append(full)
            blocks.append((start + 1, commands))
        i += 1
    return blocks


def all_blocks() -> list[tuple[str, list[str]]]:
    return [(f"{doc}:{line}", cmds) for doc in DOCS for line, cmds in bash_blocks(doc)]


def sample_outputs(doc: str) -> dict[str, list[str]]:
    """{"doc:line" of a one-command ```bash block (as all_blocks names it): the lines of the plain ``` block
    right after it}."""
    lines, samples = (ROOT / doc).read_text().splitlines(), {}
    for line, cmds in bash_blocks(doc):
        i = next(j for j in range(line - 1, len(lines)) if lines[j].strip() == "```") + 1   # past the bash block
        while i < len(lines) and not lines[i].strip():
            i += 1
        if len(cmds) == 1 and i < len(lines) and lines[i].strip() == "```":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            samples[f"{doc}:{line}"] = lines[i + 1:end]
    return samples


def missing_sample_lines(sample: list[str], printed: str) -> list[str]:
    """The sample's lines that the printed output does not contain in the sample's order (none: it matches)."""
    out = [line.rstrip() for line in printed.splitlines()]
    missing, at = [], 0
    for line in (s.rstrip() for s in sample):
        try:
            at = out.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


# ---- running a Python entry point in-process ----------------------------------------------------
class _Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args once a tool's parser accepted its flags."""


@contextlib.contextmanager
def stop_after_parse():
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        yield


def run_python(target, args: list[str], *, module: bool, parse_only: bool, cwd: Path) -> str:
    """Run `python [-m] target args` in this process (cwd = `cwd`); a callable target is a
    console script's main(argv). With parse_only, stop once argparse accepted the flags.
    Returns captured stdout; raises AssertionError on failure."""
    out, err = io.StringIO(), io.StringIO()
    argv0 = target.__module__ if callable(target) else target if module else str(ROOT / target)
    old_argv, old_cwd, old_path = sys.argv, os.getcwd(), list(sys.path)
    sys.argv = [argv0, *args]
    os.chdir(cwd)
    stopper = stop_after_parse() if parse_only else contextlib.nullcontext()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), stopper:
            if callable(target):
                sys.exit(target(args))
            elif module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv0, run_name="__main__")
    except _Parsed:
        return out.getvalue()
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(f"exit status {e.code}: {err.getvalue().strip()[-2000:]}") from None
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        os.chdir(old_cwd)
    return out.getvalue()


def run_subprocess(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


# ---- checkers -----------------------------------------------------------------------------------
def flag_value(args: list[str], flag: str, default=None):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def check_training(args: list[str], world_size: int, cwd: Path | None = None) -> None:
    """Parse and validate training flags as megapar.pretrain_gpt2 does at this world size (relative
    paths such as --load from `cwd`, where earlier commands of the block wrote)."""
    from megapar.pretrain_gpt2 import parse
    from megapar.topology import ConfigError
    import torch

    err, old_cwd = io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or old_cwd)
        with contextlib.redirect_stderr(err):
            parse(args, world_size)
    except SystemExit:
        raise AssertionError(f"training flags rejected: {err.getvalue().strip()[-2000:]}") from None
    except ConfigError as e:  # flags parsed; a GPU-only combination is refused on a CPU machine, and so is a
        # logger whose optional package (tensorboard, wandb) this machine lacks
        if re.search(r"needs the \w+ package, which is not installed", str(e)):
            return
        if torch.cuda.is_available() or not re.search(r"CUDA|GPU", str(e)):
            raise AssertionError(f"training flags rejected: {e}") from None
    finally:
        os.chdir(old_cwd)


LAUNCHER_FLAGS = tuple(flag for flag, _, _ in LAUNCHER_SCRIPT_FLAGS)   # scripts/pretrain_gpt2.sh's own


def check_pretrain_script(args: list[str], script_text: str, cwd: Path | None = None) -> None:
    """scripts/pretrain_gpt2.sh: launcher flags are its own, the rest goes to megapar.pretrain_gpt2.
    World size as the script picks it on a CPU machine: --nproc-per-node, else tp x pp."""
    for flag in LAUNCHER_FLAGS:
        assert flag in script_text, f"scripts/pretrain_gpt2.sh no longer handles {flag}"
    rest, launcher, i = [], {}, 0
    while i < len(args):
        if args[i] in LAUNCHER_FLAGS:
            launcher[args[i]] = args[i + 1]
            i += 2
        else:
            rest.append(args[i])
            i += 1
    tp = int(flag_value(rest, "--tensor-parallel", flag_value(rest, "--tensor-model-parallel-size", 1)))
    pp = int(flag_value(rest, "--pipeline-parallel", flag_value(rest, "--pipeline-model-parallel-size", 1)))
    nproc = int(launcher.get("--nproc-per-node", tp * pp))
    check_training(rest, nproc * int(launcher.get("--nnodes", 1)), cwd)


def check_prepare_openwebtext(args: list[str], cwd: Path) -> None:
    """Run it for real where --dumps does not exist: it must get past its flag loop (no
    'unknown argument') and stop at the --dumps folder check."""
    dumps = flag_value(args, "--dumps")
    assert dumps, "prepare_openwebtext.sh needs --dumps"
    assert not (cwd / dumps).exists()
    proc = run_subprocess(["bash", str(ROOT / "scripts/prepare_openwebtext.sh"), *args], cwd)
    assert "unknown argument" not in proc.stderr, proc.stderr
    assert proc.returncode != 0 and "--dumps" in proc.stderr, proc.stderr


def check_run_tests(args: list[str], script_text: str) -> None:
    """Never run the suite from inside it: each --flag must be one the script handles."""
    for a in args:
        assert not a.startswith("--") or re.search(rf'"{re.escape(a)}"', script_text), \
            f"scripts/run_tests.sh does not handle {a}"


def check_gpu_checks(args: list[str], script_text: str, cwd: Path) -> None:
    """kernels | tests [pytest selections] | bench RECIPE...: selections must exist and the bench
    names must be accepted by the benchmark's own parser."""
    parts, current = {}, None
    for a in args:
        if a in ("kernels", "tests", "bench"):
            current = parts.setdefault(a, [])
        else:
            assert current is not None, f"gpu_checks.sh: unknown part {a}"
            current.append(a)
    assert parts, "gpu_checks.sh without a part does nothing"
    for sel in parts.get("tests", []):
        assert (ROOT / sel.split("::")[0]).exists(), f"gpu_checks.sh tests: {sel} does not exist"
    if parts.get("bench") is not None:
        assert parts["bench"], "gpu_checks.sh bench needs recipe names"
        bench = re.search(r"python3? (\S*bench_train\.py)", script_text)
        assert bench, "gpu_checks.sh no longer names its benchmark script"
        run_python(bench.group(1), ["--vocab-file", "v", "--merge-file", "m", "--configs", *parts["bench"]],
                   module=False, parse_only=True, cwd=cwd)


def check_preprocess(args: list[str], cwd: Path) -> None:
    """Run it for real on a small JSON-lines file when it uses the GPT-2 BPE tokenizer (files in tests/data)."""
    if flag_value(args, "--tokenizer-type") != "GPT2BPETokenizer":
        run_python("tools/preprocess_data.py", args, module=False, parse_only=True, cwd=cwd)
        return
    for flag, source in (("--vocab-file", "encoder.json"), ("--merge-file", "vocab.bpe")):
        path = cwd / flag_value(args, flag)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.symlink_to(GPT2_DIR / source)
    inp = cwd / flag_value(args, "--input")
    inp.parent.mkdir(parents=True, exist_ok=True)
    keys = (flag_value(args, "--json-keys") or "text",)
    with open(inp, "w") as f:
        for i in range(12):
            f.write(json.dumps({k: f"Document {i}: the quick brown fox jumps over the lazy dog." for k in keys}) + "\n")
    proc = run_subprocess([sys.executable, str(ROOT / "tools/preprocess_data.py"), *args], cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prefix = cwd / f"{flag_value(args, '--output-prefix')}_{keys[0]}_document"
    assert prefix.with_suffix(".idx").is_file() and prefix.with_suffix(".bin").is_file()


def check_validate(args: list[str], cwd: Path) -> None:
    """Run it for real; when no earlier command wrote the prefix, write a small one first."""
    from megapar.data.indexed_dataset import IndexedDatasetBuilder
    import numpy as np

    for prefix in args:
        if not (cwd / f"{prefix}.idx").exists():
            (cwd / prefix).parent.mkdir(parents=True, exist_ok=True)
            b = IndexedDatasetBuilder(str(cwd / f"{prefix}.bin"), dtype=np.uint16)
            b.add_document([1, 2, 3])
            b.add_document([4, 5])
            b.finalize(str(cwd / f"{prefix}.idx"))
    out = run_python("megapar.data.validate", args, module=True, parse_only=False, cwd=cwd)
    assert out.count(": OK") == len(args), out


def check_convert_from_hf(args: list[str], cwd: Path) -> None:
    """Run it for real; when --load-dir does not exist, write a small random GPT-2 folder there
    first (so a later command of the block can --load what it wrote)."""
    from ckpt_fixtures import write_hf_gpt2
    load = cwd / flag_value(args, "--load-dir", flag_value(args, "--load", ""))
    if "--help" not in args and not load.exists():
        write_hf_gpt2(load, n_layer=2, n_embd=32, n_head=4)
    run_python("tools/convert_from_hf.py", args, module=False, parse_only=False, cwd=cwd)


REAL_TOOLS = {"tools/estimate_memory.py", "tools/plan_layout.py"}   # cheap: run for real (not --calibrate: GPU)


def check_python(tokens: list[str], cwd: Path) -> str | None:
    """Check one python command; returns what it printed when it ran for real."""
    if tokens[0] == "-m":
        module, args = tokens[1], tokens[2:]
        if module == "megapar.pretrain_gpt2":
            return check_training(args, 1, cwd)
        if module == "megapar.data.validate":
            return check_validate(args, cwd)
        run_python(module, args, module=True, parse_only="--help" not in args, cwd=cwd)
        return
    script, args = tokens[0], tokens[1:]
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if script == "tools/preprocess_data.py" and "--help" not in args:
        return check_preprocess(args, cwd)
    if script == "tools/convert_from_hf.py":
        return check_convert_from_hf(args, cwd)
    real = (script in REAL_TOOLS and "--calibrate" not in args) or "--help" in args
    out = run_python(script, args, module=False, parse_only=not real, cwd=cwd)
    if script == "tools/estimate_memory.py":
        assert "tp " in out and "pp " in out, out
    if script == "tools/plan_layout.py" and "--calibrate" in args:   # stands in for the GPU: the defaults
        from megapar.planner.calibration import H100
        (cwd / flag_value(args, "--out")).write_text(H100.to_json())
    if script == "tools/plan_layout.py" and real and "--help" not in args:   # its pick must train
        assert "| tp | pp |" in out, out
        best = next(line for line in out.splitlines() if line.startswith("bash scripts/pretrain_gpt2.sh"))
        check_pretrain_script(shlex.split(best, comments=True)[2:], (ROOT / "scripts/pretrain_gpt2.sh").read_text(),
                              cwd)
    return out if real else None


def check_bash(tokens: list[str], env: dict, cwd: Path) -> None:
    script, args = tokens[0], tokens[1:]
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    text = path.read_text()
    for name in env:
        assert name in text, f"{script} does not read the environment variable {name}"
    name = path.name
    if name == "pretrain_gpt2.sh":
        return check_pretrain_script(args, text, cwd)
    if name == "prepare_openwebtext.sh":
        return check_prepare_openwebtext(args, cwd)
    if name == "run_tests.sh":
        return check_run_tests(args, text)
    if name == "gpu_checks.sh":
        return check_gpu_checks(args, text, cwd)
    if name in ("layout_check.sh", "gpu_kernel_checks.sh", "install.sh"):
        assert not args, f"{script} takes no arguments (settings come from the environment)"
        return
    tools = sorted(set(re.findall(r"tools/\w+\.py", text)))
    assert len(tools) == 1, f"no checker for {script}"
    check_python([tools[0], *args], cwd)


def check_sbatch(args: list[str]) -> None:
    """sbatch [options] scripts/slurm_pretrain_gpt2.sbatch [training flags]: the script starts
    scripts/pretrain_gpt2.sh on every node with --nnodes from --nodes and --nproc-per-node from
    --gpus-per-node; the training flags are checked at that world size."""
    scripts = [i for i, a in enumerate(args) if a.endswith(".sbatch")]
    assert scripts, "sbatch: no .sbatch script"
    i = scripts[0]
    options, script, training = args[:i], args[i], args[i + 1:]
    assert (ROOT / script).is_file(), f"{script} does not exist"
    text = (ROOT / script).read_text()
    assert "scripts/pretrain_gpt2.sh" in text and '"$@"' in text, f"{script} no longer passes its flags on"
    nodes = flag_value(options, "--nodes", flag_value(options, "-N", 1))
    gpus = flag_value(options, "--gpus-per-node", 1)
    check_pretrain_script(["--nnodes", str(nodes), "--nproc-per-node", str(gpus), *training],
                          (ROOT / "scripts/pretrain_gpt2.sh").read_text())


def check_command(line: str, cwd: Path) -> str | None:
    """Check one command line; returns what it printed when it ran for real (python tools only)."""
    tokens = shlex.split(line, comments=True)
    env = {}
    while tokens and ENV_ASSIGN.match(tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    assert tokens, f"empty command: {line}"
    prog, rest = tokens[0], tokens[1:]
    if prog == "bash":
        check_bash(rest, env, cwd)
    elif prog in ("python", "python3"):
        return check_python(rest, cwd)
    elif prog == "sbatch":
        check_sbatch(rest)
    elif prog.startswith("megapar-"):  # console entry point megapar-x-y = megapar.cli.x_y:main (setup.py)
        tool = prog[len("megapar-"):].replace("-", "_")
        assert re.search(rf'"{tool}"', (ROOT / "setup.py").read_text()), f"setup.py installs no {prog}"
        main = importlib.import_module(f"megapar.cli.{tool}").main
        run_python(main, rest, module=False, parse_only="--help" not in rest, cwd=cwd)
    else:
        raise AssertionError(f"no checker for {prog!r} commands; add one to tests/docs/test_readme.py")


# ---- tests --------------------------------------------------------------------------------------
BLOCKS = all_blocks()
SAMPLES = {where: sample for doc in DOCS for where, sample in sample_outputs(doc).items()}


def test_readme_has_commands():
    assert sum(len(cmds) for where, cmds in BLOCKS if where.startswith("README.md")) >= 10


@pytest.mark.parametrize("where,commands", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_commands_work(where, commands, tmp_path):
    """The commands of one block, in order, in one scratch directory (a later command may read
    what an earlier one wrote). The repository's example configs are there too, as in a checkout."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for line in commands:
        try:
            printed = check_command(line, tmp_path)
        except AssertionError as e:
            pytest.fail(f"{where}: `{line}`\n{e}")
    if where in SAMPLES:
        assert printed is not None, f"{where}: the sample output after this block is of a command that does not run"
        missing = missing_sample_lines(SAMPLES[where], printed)
        assert not missing, (f"{where}: the sample output after this block no longer matches what `{commands[0]}` "
                             "prints; these lines are stale:\n" + "\n".join(missing) + f"\nit printed:\n{printed}")


def test_the_guide_shows_sample_outputs():
    """The guide's planner and memory-estimator samples are checked (a rename of the blocks would drop them)."""
    shown = [SAMPLES[w] for w in SAMPLES if w.startswith("docs/guide.md")]
    assert any(line.startswith("| tp | pp | v | dp | ZeRO | offload |") for s in shown for line in s), shown
    assert sum(any(line.startswith("GPU: fits") for line in s) for s in shown) >= 2


def test_a_stale_sample_fails():
    printed = "header\n| a | b |\n|---|---|\n| 1 | 2.5 |\nbest: 2.5 ms  \n"
    assert missing_sample_lines(["| a | b |", "| 1 | 2.5 |", "best: 2.5 ms"], printed) == []
    assert missing_sample_lines(["| a | b |", "| 1 | 2.4 |"], printed) == ["| 1 | 2.4 |"]
    assert missing_sample_lines(["best: 2.5 ms", "| a | b |"], printed) == ["| a | b |"]   # order counts


@pytest.mark.parametrize("line", [
    "python tools/checkpoint_util.py --load-dir a --save-dir b --target-tensor-paralel-size 1",
    "python tools/convert_to_hf.py --load-dir a --save-dir b --dtype bf61",
    "python tools/convert_from_hf.py --load-dir a --save-dir b --target-tensor-paralel-size 2",
    "bash scripts/pretrain_gpt2.sh --tensor-paralel 2",
    "bash scripts/pretrain_gpt2.sh --tensor-parallel 3 --num-attention-heads 8",
    "bash scripts/generate_text.sh --load ckpt --top_p 0.9",
    "bash scripts/prepare_openwebtext.sh --dumps pushshift/ --output owt/ --wokers 8",
    "bash scripts/gpu_checks.sh bench 345m-grph",
    "bash scripts/run_tests.sh --quik",
    "sbatch --nodes 2 --gpus-per-node 8 scripts/slurm_pretrain_gpt2.sbatch --tensor-paralel 8",
    "sbatch --nodes 2 --gpus-per-node 3 scripts/slurm_pretrain_gpt2.sbatch --tensor-parallel 4",
    "python tools/preprocess_data.py --input docs.jsonl --output-prefix x --vocab-file v --merge-file m",
    "python tools/estimate_memory.py --world-size 4 --tensor-parallel 2 --micro-batch 8 --global-batch-size 6",
    "python tools/plan_layout.py --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--global-batch-size 8 --gpus 2 --gpu-memmory 80GB",
    "python tools/plan_layout.py --calibrate --out calib.json --gpu h300",
    "megapar-checkpoint-util --load-dir a --save-dir b --to-fulll",
    "megapar-no-such-tool --help",
    "curl http://localhost:5000/api",
])
def test_a_misspelled_flag_fails(line, tmp_path):
    with pytest.raises(AssertionError):
        check_command(line, tmp_path)
