"""The user tools' code. Each module has `main(argv=None)` returning the exit status and is
reachable three ways: `python tools/<tool>.py` (a shim, the Megatron habit), the console script
`megapar-<tool>` (setup.py's entry points, underscores as dashes) and `python -m megapar.cli.<tool>`.
Bad input ends with one `error: ...` line on stderr and a nonzero status, never a traceback."""
