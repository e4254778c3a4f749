"""benchmarks/rollout_motion.py on a short rollout."""

import json

from benchmarks import rollout_motion


def test_rollout_motion_reports_every_family_against_the_truth(tmp_path):
    assert rollout_motion.main(["--models", "tinyworld", "--frames", "6", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "rollout_motion.json").read_text())["tinyworld"]["families"]
    assert list(res) == list(rollout_motion.FAMILIES)
    pan = res["pan"]["1-16"]
    assert pan["truth"] > 0 and pan["kept"] == pan["fp"] / pan["truth"] and pan["ours_over_fp"] == pan["ours"] / pan["fp"]
    assert res["static"]["1-16"]["kept"] is None  # the still camera's truth does not move
    assert "| static | " in (tmp_path / "rollout_motion.md").read_text()


def test_an_unknown_model_is_one_line_and_exit_2(capsys):
    assert rollout_motion.main(["--models", "nope", "--frames", "6"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
