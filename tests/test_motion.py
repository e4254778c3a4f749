"""Does the rollout move? The fp rollout against the truth, each scheme against the fp rollout (evaluate/motion.py)."""

import pytest
import torch

from calibrate.adapters import as_world
from calibrate.evaluate import motion
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import SchemeRun, TrajResult, evaluate
from calibrate.schemes import build_baseline
from calibrate.world.trajectories import make_trajectories


def motion_run(per_family: dict[str, tuple[float, float]], frames: int = 100, damping: float = 1.0):
    """A run with one trajectory per family whose fp rollout and truth change by constant amounts
    (fp, truth) per frame, and the scheme's rollout by `damping` times the fp rollout's."""
    trajs = []
    for fam, (fp, truth) in per_family.items():
        series = {"motion_fp": torch.full((frames - 1,), fp, dtype=torch.float64),
                  "motion_quant": torch.full((frames - 1,), damping * fp, dtype=torch.float64),
                  "motion_gt": torch.full((frames - 1,), truth, dtype=torch.float64)}
        trajs.append(TrajResult(fam, 0, series, None, None, None, None))
    return SchemeRun(None, trajs, {}, {})


def test_reference_motion_is_the_fp_rollouts_change_over_the_truths_per_family_and_window():
    run = motion_run({"pan": (0.004, 0.01), "orbit": (0.0001, 0.01), "static": (1e-6, 0.0)})
    ref = motion.reference_motion({"a": run})
    assert ref["frozen_below"] == motion.FROZEN_BELOW
    assert set(ref["families"]) == {"pan", "orbit", "static"}
    assert set(ref["families"]["pan"]) == {"0-16", "16-64", "64-128"}  # 99 steps: 128-256 is not reached
    assert ref["families"]["pan"]["16-64"]["kept"] == pytest.approx(0.4)
    assert ref["families"]["orbit"]["0-16"]["kept"] == pytest.approx(0.01)
    assert ref["families"]["static"]["0-16"]["kept"] is None  # the truth does not move: no ratio
    rep = {"reference_motion": ref}
    assert motion.frozen_families(rep) == {"orbit": "0-16"}
    md = report_mod.motion_markdown(rep)
    assert "| orbit | **0.010** | **0.010** | **0.010** |" in md and "| pan | 0.400 |" in md
    assert "Frozen reference: orbit from frames 0-16." in md


def test_motion_kept_is_the_rollouts_change_over_the_fp_rollouts():
    run = motion_run({"pan": (0.004, 0.01), "orbit": (0.0001, 0.01)}, damping=0.5)
    run.trajs[1].series["motion_quant"][20:] *= 1.6  # orbit: damped to 0.5 on 0-16, to 0.8 from frame 21 on
    kept = motion.motion_kept(run)["windows"]
    assert kept["0-16"]["mean"] == pytest.approx(0.5) and kept["0-16"]["worst"] == pytest.approx(0.5)
    assert kept["64-128"]["mean"] == pytest.approx(0.65) and kept["64-128"]["worst"] == pytest.approx(0.5)


def test_psnr_by_regime_averages_each_windows_psnr_over_the_trajectories_of_each_regime():
    run = motion_run({"pan": (0.004, 0.01), "orbit": (0.0001, 0.01), "static": (1e-6, 0.0)}, frames=70)
    for r, psnr in zip(run.trajs, (30.0, 50.0, 20.0)):
        r.series["psnr_ref"] = torch.full((70,), psnr, dtype=torch.float64)
    run.trajs[1].series["motion_fp"][30:] = 0.002  # orbit moves again from frame 31 on: 16-64 mixes both
    run.trajs[1].series["motion_quant"][30:] = 0.002  # (and its rollout with it: motion kept 1)
    run.trajs[1].series["psnr_ref"][16:] = 40.0
    run.trajs[0].series["motion_quant"] *= 0.5  # pan's rollout moves half as much as the fp one
    by = motion.psnr_by_regime(run)
    assert by["0-16"] == {"moving": {"mean": 30.0, "trajectories": 1, "motion_kept": 0.5},
                          "frozen": {"mean": 50.0, "trajectories": 1, "motion_kept": 1.0},
                          "still": {"mean": 20.0, "trajectories": 1, "motion_kept": 1.0}}
    # orbit on 16-64: fp change (14 x 1e-4 + 34 x 2e-3) / 48 = 1.446e-3 of 0.01: 0.145 >= 0.05, moving
    assert by["16-64"]["moving"] == {"mean": 35.0, "trajectories": 2, "motion_kept": pytest.approx(0.75)}
    assert "frozen" not in by["16-64"]
    rep = {"schemes": {"ours": {"metrics": {"psnr_by_regime": by}}, "peer": {"metrics": {"psnr_by_regime": {}}}}}
    head, rows = motion.regime_table(rep)
    assert head == ["scheme", "0-16 (1/1/1)", "16-64 (2/0/1)", "64-128 (2/0/1)"]
    assert rows == [["ours", "30.0 (0.50) / 50.0 (1.00) / 20.0 (1.00)", "35.0 (0.75) / - / 20.0 (1.00)",
                     "35.0 (0.75) / - / 20.0 (1.00)"]]
    assert motion.psnr_by_regime(SchemeRun(None, [], {}, {})) == {}
    short = motion_run({"pan": (0.004, 0.01)}, frames=17)  # frame 16 alone in 16-64: no change to judge
    short.trajs[0].series["psnr_ref"] = torch.full((17,), 30.0, dtype=torch.float64)
    assert set(motion.psnr_by_regime(short)) == {"0-16"}


def test_a_family_that_moves_again_late_is_not_called_frozen():
    run = motion_run({"orbit": (0.0001, 0.01)}, frames=130)
    run.trajs[0].series["motion_fp"][100:] = 0.01  # frozen on 16-64, moving again from frame 101 on
    assert motion.frozen_families({"reference_motion": motion.reference_motion({"a": run})}) == {}


def test_evaluate_records_how_much_the_fp_rollout_and_the_truth_move(tiny_world):
    trajs = make_trajectories(["pan"], "evaluation", 1, 6)
    runs = evaluate(as_world(tiny_world), {"naive2": build_baseline("naive2", as_world(tiny_world).info)}, trajs,
                    window=4, sink_frames=1, device=torch.device("cpu"), attention=False)
    series = runs["naive2"].trajs[0].series
    assert all(series[k].shape == (5,) for k in ("motion_quant", "motion_fp", "motion_gt"))  # TinyWorld renders the truth
    rep = report_mod.build(runs, [{"family": "pan", "seed": 0, "num_frames": 6}], {}, 30.0)
    assert set(rep["schemes"]["naive2"]["metrics"]["motion"]["windows"]) == {"0-16"}
    assert rep["schemes"]["naive2"]["metrics"]["psnr_by_regime"]["0-16"]["moving"]["trajectories"] == 1
    assert "PSNR_ref where the reference moves" in report_mod.markdown(rep, "cmd", {})
    assert "## Motion kept per window" in report_mod.markdown(rep, "cmd", {})
    assert motion.reference_motion(runs)["families"]["pan"]["0-16"]["truth"] > 0
    del series["motion_gt"]  # as for a model without a renderer
    assert motion.reference_motion(runs) == {} and report_mod.motion_markdown({"reference_motion": {}}) == ""
