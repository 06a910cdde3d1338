"""Fault injection: run a real command on real files and check that a user's mistake is refused
the way megapar promises -- a non-zero exit, one line `error: ...` that names the problem, no
Python traceback, and every file that existed before byte-identical afterwards.

    case = refused(["python", "tools/checkpoint_util.py", "--load-dir", ck, "--save-dir", parent, "--force"],
                   watch=[tmp_path], expect="lies inside")

`watch` lists files or folders whose every file is hashed before and compared after (nothing
lost, nothing changed); new files are allowed only under `allow_new` (e.g. a log). Each call also
adds a row to the session's table, which `tests/conftest.py` prints at the end:
class, case, refused with message, nothing lost.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
ROWS: list["Row"] = []


@dataclass
class Row:
    fault_class: str
    case: str
    refused: bool
    nothing_lost: bool


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def snapshot(paths: Iterable[os.PathLike]) -> dict[str, str]:
    """{file path: sha256} of every file under `paths` (files or folders)."""
    out = {}
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else []
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def run(cmd: Sequence[str], *, input: Optional[str] = None, timeout: float = 300, env: Optional[dict] = None,
        cwd: Optional[os.PathLike] = None) -> Outcome:
    """Run `cmd` (python -> this interpreter) with the repo as working directory."""
    cmd = [sys.executable if c == "python" else str(c) for c in cmd]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, env=full_env,
                       cwd=str(cwd or ROOT))
    return Outcome(p.returncode, p.stdout, p.stderr)


def refused(cmd: Sequence[str], *, fault_class: str, case: str, expect: str | Sequence[str],
            watch: Iterable[os.PathLike] = (), allow_new: Iterable[os.PathLike] = (), **kw) -> Outcome:
    """Run `cmd`, which must fail: assert a non-zero exit, exactly one line starting `error:` that
    contains every `expect` fragment, no traceback, and that every watched file is unchanged and
    no file appeared under a watched folder (except under `allow_new`). Records a table row."""
    watch = list(watch)
    before = snapshot(watch)
    out = run(cmd, **kw)
    after = snapshot(watch)
    allowed = [str(Path(a)) for a in allow_new]
    new = [f for f in set(after) - set(before) if not any(f.startswith(a) for a in allowed)]
    nothing_lost = all(after.get(f) == h for f, h in before.items()) and not new
    errors = [line for line in out.output.splitlines() if line.startswith("error:")]
    fragments = [expect] if isinstance(expect, str) else list(expect)
    ok = (out.rc != 0 and len(errors) == 1 and "Traceback" not in out.output
          and all(x in errors[0] for x in fragments))
    ROWS.append(Row(fault_class, case, ok, nothing_lost))
    assert out.rc != 0, f"{case}: exited 0\n{out.output[-3000:]}"
    assert "Traceback" not in out.output, f"{case}: traceback in the output\n{out.output[-3000:]}"
    assert len(errors) == 1, f"{case}: expected one 'error:' line, got {errors}\n{out.output[-3000:]}"
    for x in fragments:
        assert x in errors[0], f"{case}: {x!r} not in {errors[0]!r}"
    changed = [f for f, h in before.items() if after.get(f) != h]
    assert not changed, f"{case}: files changed or lost: {changed[:5]}"
    assert not new, f"{case}: files appeared: {new[:5]}"
    return out


def table() -> str:
    """The session's rows as a markdown table, with totals."""
    lines = ["| class | case | refused with message | nothing lost |", "|---|---|---|---|"]
    lines += [f"| {r.fault_class} | {r.case} | {'yes' if r.refused else 'NO'} | {'yes' if r.nothing_lost else 'NO'} |"
              for r in ROWS]
    lines.append(f"| total | {len(ROWS)} cases | {sum(r.refused for r in ROWS)} | "
                 f"{sum(r.nothing_lost for r in ROWS)} |")
    return "\n".join(lines)
