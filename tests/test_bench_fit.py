"""benchmarks.fit: bad --ablations exit 2 with one line before any work (the report compares every
row with `ours`; a run without it crashed at the report after its fits, an hour in on WanWorld)."""

import pytest

from benchmarks.fit import main


@pytest.mark.parametrize("ablations, says", [("ours_lambda0,ours_wide_base", "must include ours"),
                                             ("ours,ours_nosuch", "unknown ours_nosuch")])
def test_bad_ablations_exit_2_with_one_line(ablations, says, tmp_path, capsys):
    assert main(["--ablations", ablations, "--out", str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --ablations") and says in err[0]
    assert not any(tmp_path.iterdir())  # nothing written, nothing fitted


def test_a_report_name_that_is_not_a_plain_file_name_exits_2(tmp_path, capsys):
    assert main(["--name", "../fit", "--out", str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --name")
