"""Every default that docs/guide.md quotes for a flag is the flag's real default.

The patterns read (F is a backquoted flag, `--flag` or `--flag value`; X the quoted default):
  * F (default X ...)        `--cuda-graph-warmup-steps` (default 3)
  * F, default X             `--make-vocab-size-divisible-by`, default 128
  * F (...; default X)       `--master-port` (a free port there; default 29500)
  * F word (default X        `--request-timeout` seconds (default 30; ...)
  * F (N) with N a number    `--max-micro-batch` (16)
  * `--flag value` (default)            `--fp8-recipe tensorwise` (default)
  * `--flag a|b|c` (..., a = ..., default; ...) or (..., a, the default, ...): a choice named the default
X is checked when it is a number (10, 0.5, 2^32), a percentage (90%: a fraction), a size (1 MiB) or a choice;
anything else (`--save`/wandb, "the world size up to 8", "every visible GPU") describes a default computed at run
time and is not checked. A training flag's default is megapar.config.settings.default_of of its setting (resolved for
"auto"/None where the flag's own help says what it picks); the other tools' flags come from their own parsers, and
scripts/pretrain_gpt2.sh's launcher flags from torchrun's (which it passes them to).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megapar.config.settings import build_parser, default_of

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"

FLAG = r"`(--[a-z0-9-]+)`"
QUOTED = [   # (flag, value) per match; value None: the flag's value inside the backquotes is the default
    re.compile(FLAG + r"(?: [a-z]+)? \((?:[^()`]*?; )?default:? ([^,;)]+)"),
    re.compile(FLAG + r",\s+default:? ([^,;)]+)"),
    re.compile(r"`(--[a-z0-9-]+) ([a-z0-9_.-]+)` \(default\)"),
    re.compile(FLAG + r" \((\d+(?:\.\d+)?)\)"),
]
CHOICES = re.compile(r"`(--[a-z0-9-]+) ([a-z0-9_]+(?:\|[a-z0-9_]+)+)` \(([^)]*)\)")
CHOSEN = re.compile(r"\b([a-z0-9_]+)(?: = [^,;]*)?, (?:the )?default\b")
NUMBER = re.compile(r"^(\d+(?:\.\d+)?)(?:\^(\d+))?(%| MiB| GiB)?$")
UNITS = {None: 1, "%": 0.01, " MiB": 2 ** 20, " GiB": 2 ** 30}


def quoted_defaults(text: str) -> list[tuple[str, str]]:
    """(flag, quoted default) for each pattern of the module docstring, in the order of the text."""
    text = re.sub(r"\s*\n\s*", " ", text)   # a quote may wrap
    found = []
    for pattern in QUOTED:
        found += [(m.start(), m.group(1), m.group(2).strip()) for m in pattern.finditer(text)]
    for m in CHOICES.finditer(text):
        choices = m.group(2).split("|")
        found += [(m.start(), m.group(1), c.group(1)) for c in CHOSEN.finditer(m.group(3)) if c.group(1) in choices]
    return [(flag, value) for _, flag, value in sorted(found)]


def _other_tools() -> dict[str, argparse.ArgumentParser]:
    from torch.distributed.run import get_args_parser
    from megapar.cli import generate_text, plan_layout
    return {"plan_layout": plan_layout._parser(), "generate_text": generate_text.build_parser(),
            "torchrun": get_args_parser()}


def _dest(parser: argparse.ArgumentParser, flag: str) -> str | None:
    return next((a.dest for a in parser._actions if flag in a.option_strings), None)


def real_default(flag: str):
    """The default of `flag`: training flags first, then the other tools the guide quotes defaults of."""
    dest = _dest(build_parser(), flag)
    if dest is not None:
        return default_of(dest)
    for parser in _other_tools().values():
        action = next((a for a in parser._actions if flag in a.option_strings), None)
        if action is not None and action.default is None and action.help:   # torchrun fills some in after parsing
            said = re.search(r"Defaults to (\d+)\.", action.help)
            return int(said.group(1)) if said else None
        if action is not None:
            return action.default
    raise AssertionError(f"docs/guide.md quotes a default for {flag}, which no parser this test reads has")


def matches(quoted: str, default) -> bool | None:
    """Whether the quoted text is the default; None when it describes one instead of giving a value."""
    m = NUMBER.match(quoted)
    if m:
        value = float(m.group(1)) ** (int(m.group(2)) if m.group(2) else 1) * UNITS[m.group(3)]
        return isinstance(default, (int, float)) and abs(value - default) <= 1e-9 * max(1.0, abs(value))
    if re.fullmatch(r"[a-z0-9_]+", quoted):
        return quoted == default
    return None


def test_quoted_defaults_are_the_real_ones():
    quotes = quoted_defaults(GUIDE.read_text())
    checked, wrong = 0, []
    for flag, quoted in quotes:
        default = real_default(flag)
        ok = matches(quoted, default)
        checked += ok is not None
        if ok is False:
            wrong.append(f"{flag}: the guide says default {quoted!r}, the code's default is {default!r}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 10, quotes   # the guide's patterns still match (a reworded guide would check nothing)


@pytest.mark.parametrize("text,expected", [
    ("`--eval-iters` (default 10; ...)", [("--eval-iters", "10")]),
    ("the `--gpu-memory`, default 90%, of", [("--gpu-memory", "90%")]),
    ("`--port` (a free one; default 29500)", [("--port", "29500")]),
    ("`--timeout` seconds (default\n30)", [("--timeout", "30")]),
    ("`--fp8-recipe rowwise` (default) scales", [("--fp8-recipe", "rowwise")]),
    ("`--max-micro-batch` (16), `--top` (10 layouts)", [("--max-micro-batch", "16")]),
    ("`--backend auto|flash|torch` (auto, the default, picks; flash = SDPA)", [("--backend", "auto")]),
    ("`--backend flash|torch` (flash = torch SDPA, default; torch = reference)", [("--backend", "flash")]),
])
def test_the_patterns(text, expected):
    assert quoted_defaults(text) == expected


def test_a_wrong_quote_fails():
    assert matches("10", 10.0) and matches("90%", 0.9) and matches("1 MiB", 1 << 20) and matches("2^32", 2.0 ** 32)
    assert matches("auto", "auto") and matches("the world size up to 8", None) is None
    assert matches("3", 4) is False and matches("flash", "auto") is False and matches("1 MiB", 1000) is False
