"""benchmarks/compare.py says which evaluations a run reused from its run directory."""

import os

from benchmarks.compare import partial_stamps, reused_schemes


def test_a_scheme_is_reused_only_when_every_batch_file_stayed(tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("turbo2.5.0", "turbo2.5.1", "ours.0", "kivi2.0"):
        (partial / f"{name}.safetensors").write_bytes(b"x")
        os.utime(partial / f"{name}.safetensors", ns=(1, 1))
    before = partial_stamps(tmp_path)
    os.utime(partial / "ours.0.safetensors", ns=(2, 2))  # recomputed
    os.utime(partial / "turbo2.5.1.safetensors", ns=(2, 2))  # one of its two batches recomputed
    (partial / "naive2.0.safetensors").write_bytes(b"x")  # new in this run
    assert reused_schemes(before, partial_stamps(tmp_path)) == ["kivi2"]
    assert reused_schemes({}, partial_stamps(tmp_path)) == []
