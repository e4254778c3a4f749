"""benchmarks/rollout_motion.py on a short rollout."""

import json

import pytest

from benchmarks import rollout_motion


def test_rollout_motion_reports_every_family_against_the_truth_and_each_scheme_against_the_fp_rollout(tmp_path):
    assert rollout_motion.main(["--models", "tinyworld", "--frames", "6", "--schemes", "ours,naive2",
                                "--out", str(tmp_path), "--name", "short"]) == 0
    res = json.loads((tmp_path / "short.json").read_text())["tinyworld"]
    assert list(res["families"]) == list(rollout_motion.FAMILIES) and res["schemes"] == ["ours", "naive2"]
    pan = res["families"]["pan"]["1-16"]
    assert pan["truth"] > 0 and pan["kept"] == pan["fp"] / pan["truth"]
    assert pan["schemes"]["naive2"]["over_fp"] == pan["schemes"]["naive2"]["change"] / pan["fp"]
    assert res["families"]["static"]["1-16"]["kept"] is None  # the still camera's truth does not move
    md = (tmp_path / "short.md").read_text()
    assert "| static | " in md and "| naive2 | " in md


@pytest.mark.parametrize("args", [["--models", "nope"], ["--schemes", "kvquant2"], ["--name", "a/b"]])
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    assert rollout_motion.main(["--models", "tinyworld", "--frames", "6", *args]) == 2
    assert capsys.readouterr().err.count("\n") == 1
