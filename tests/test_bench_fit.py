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


def test_rollouts_too_short_for_the_late_window_exit_2_before_any_fit(tmp_path, capsys):
    assert main(["--frames", "96", "--out", str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --frames 96")
    assert not any(tmp_path.iterdir())


def test_a_report_name_that_is_not_a_plain_file_name_exits_2(tmp_path, capsys):
    assert main(["--name", "../fit", "--out", str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --name")


def test_a_familys_late_frames_give_its_mean_and_its_spread_over_trajectories():
    from types import SimpleNamespace

    import torch

    from benchmarks.fit import family_late, family_means, family_spread, family_target

    def traj(family, late, frames=256):  # frames 128-256 at `late` dB, earlier frames at 99 (not counted)
        series = torch.cat([torch.full((128,), 99.0), torch.full((frames - 128,), late)])
        return SimpleNamespace(family=family, series={"psnr_ref": series})

    run = SimpleNamespace(trajs=[traj("pan", 40.0), traj("pan", 30.0), traj("pan", 44.0), traj("pan", 46.0),
                                 traj("static", 35.0), traj("orbit", 50.0, frames=128)])  # orbit: no late frames
    late = family_late(run)
    assert family_means(late) == {"pan": 40.0, "static": 35.0}
    assert family_spread(late) == {"pan": [30.0, 42.0, 46.0, 4], "static": [35.0, 35.0, 35.0, 1]}
    ours = {"by_family": family_means(late), "family_late": late}
    pan = family_target(ours, "pan", "pan", 42)
    assert not pan["met"] and pan["detail"] == "40.00 (mean of 4; 30.0-46.0, 2 of 4 below 42)"
    static = family_target(ours, "static", "still camera", 30)  # one rollout: that rollout decides
    assert static["met"] and static["detail"] == "35.00" and static["target"] == "still camera, frames 128-256 >= 30 dB"
    ours["by_family"]["pan"], ours["family_late"]["pan"] = 45.5, [41.0, 50.0]  # the mean passes, one rollout does not
    assert not family_target(ours, "pan", "pan", 42)["met"]
    ours["family_late"]["pan"] = [43.0, 48.0]
    assert family_target(ours, "pan", "pan", 42)["met"]
    assert not family_target(ours, "revisit", "revisit", 30)["met"]  # no rollout of the family: not met


def test_what_ours_gains_is_paired_rollout_by_rollout():
    from benchmarks.fit import paired_gain

    ours = {"pan": [40.0, 50.0], "static": [30.0]}
    g = paired_gain(ours, {"pan": [38.0, 51.0], "static": [27.0]})  # gains 2, -1, 3
    assert g["mean"] == pytest.approx(4 / 3) and g["n"] == 3 and g["leads"] == 2
    assert g["se"] == pytest.approx((13 / 3) ** 0.5 / 3 ** 0.5)  # sample variance (4/9 + 49/9 + 25/9) / 2 = 13/3
    assert (g["min"], g["max"]) == (-1.0, 3.0) and g["by_family"] == {"pan": 0.5, "static": 3.0}
    assert paired_gain({"pan": [40.0]}, {"pan": [38.0]}) is None  # one rollout: no spread to pair
    with pytest.raises(ValueError):  # rows of different trajectory sets never pair silently
        paired_gain(ours, {"pan": [38.0], "static": [27.0]})


def test_how_much_more_a_row_flickers_is_paired_rollout_by_rollout():
    from benchmarks.fit import paired_flicker

    ours = {"pan": [0.002, 0.004], "static": [0.001]}
    f = paired_flicker(ours, {"pan": [0.003, 0.004], "static": [0.0009]})  # row / ours - 1: +50%, 0, -10%
    assert f["mean"] == pytest.approx(0.4 / 3) and f["more"] == 1 and f["n"] == 3
    assert f["se"] == pytest.approx(statistics_stdev([0.5, 0.0, -0.1]) / 3 ** 0.5)
    assert paired_flicker({"pan": [0.002]}, {"pan": [0.003]}) is None


def statistics_stdev(xs):
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def test_the_paired_plot_is_one_png_written_whole(tmp_path):
    from benchmarks.fit import plot_paired

    by = {"ours": {"family_late": {"pan": [40.0, 50.0], "static": [30.0, 31.0]}},
          "ours_x": {"family_late": {"pan": [38.0, 51.0], "static": [27.0, 30.0]}}}
    plot_paired(by, tmp_path / "gains.png")
    assert (tmp_path / "gains.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["gains.png"]  # no temporary file left
    by["ours_x"]["family_late"]["pan"] = [38.0]  # another trajectory set: refused, not plotted
    with pytest.raises(ValueError):
        plot_paired(by, tmp_path / "other.png")
    assert not (tmp_path / "other.png").exists()
