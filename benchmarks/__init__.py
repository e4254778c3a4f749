"""Benchmark scripts: each prints a table, writes JSON + Markdown, and says how to rerun it.

They measure the project and write the reports under `artifacts/benchmarks/`; they are not part
of the installed tool. Run them from the repository root: `python -m benchmarks.<name>`.
"""
