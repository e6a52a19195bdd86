"""The research subcommands of `splitstack`. Each module has `build_parser()` (its own flags,
`prog` `splitstack <name>`) and `run(argv) -> exit code`; bad settings raise ValueError,
which `splitstack`'s `main` reports as one line."""
from __future__ import annotations

import sys


def log(message: str) -> None:
    """Progress goes to stderr, so stdout carries only the command's result."""
    print(message, file=sys.stderr, flush=True)
