"""benchmarks/twin_windows.py on a short rollout: both twins, every window's cells."""

from benchmarks import twin_windows


def test_twin_windows_reports_both_twins_per_window(tmp_path):
    assert twin_windows.main(["--frames", "20", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "twin_windows.md").read_text()
    assert "| orbit | " in md and "| static | " in md
    assert md.count("; gap ") == 7 * 2  # 7 families x windows 0-16 and 16-64
    assert "whole rollout's power" in md and "each window's power" in md


def test_too_few_frames_is_one_line_and_exit_2(capsys):
    assert twin_windows.main(["--frames", "10"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
