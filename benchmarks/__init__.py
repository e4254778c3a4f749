"""Benchmark scripts: each prints a table, writes JSON + Markdown, and says how to rerun it.

They measure the project and write the reports under `artifacts/benchmarks/`; they are not part
of the installed tool. Run them from the repository root: `python -m benchmarks.<name>`.
"""

import shlex
import sys


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reruns `python -m benchmarks.<module>` with `argv` (default: this
    process's arguments), shell-quoted so that it can be pasted as it is."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])
