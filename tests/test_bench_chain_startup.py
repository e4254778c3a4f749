"""benchmarks/chain_startup.py on a short rollout."""

from benchmarks import chain_startup


def test_chain_startup_reports_error_and_signal_per_frame(tmp_path):
    assert chain_startup.main(["--frames", "10", "--families", "static", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "chain_startup.md").read_text()
    assert "| static | err | " in md and "|  | sig | " in md and "|  | chg | 0 |" in md


def test_an_unknown_family_is_one_line_and_exit_2(capsys):
    assert chain_startup.main(["--families", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
