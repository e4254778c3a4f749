"""Benchmark scripts: each prints a table, writes JSON + Markdown, and says how to rerun it."""
