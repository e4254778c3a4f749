"""Does the rollout move? The reference's motion against the camera, and each scheme's against the reference.

Every PSNR_ref compares a scheme's rollout with the model's own full-precision rollout, which is a
demanding reference only while it keeps changing. Two views, from the frame-to-frame change of
metrics.frame_change (each trajectory's `motion_quant`, `motion_fp` and, with a renderer's ground
truth, `motion_gt` series, evaluate/run.py):

- `reference_motion`: per family and window, the fp rollout's change over the true frames' (kept).
  Below `FROZEN_BELOW` the model has all but stopped following the camera; a still camera's truth
  does not move, so there is no ratio. The same for every scheme of an evaluation.
- `motion_kept`: per scheme and window, its rollout's change over the fp rollout's, per trajectory:
  below 1 the quantized cache damps the motion (the rollout lags and smooths), above 1 it jitters.
- `psnr_by_regime`: per scheme and window, its PSNR_ref averaged separately over the trajectories
  whose fp rollout moves there, those whose fp rollout froze (as above, per trajectory) and those
  whose truth stands still, so a mean over near-still images does not hide what happens where the
  reference moves.
"""

from __future__ import annotations

from calibrate.evaluate import metrics as M
from calibrate.evaluate.run import SchemeRun

FROZEN_BELOW = 0.05  # the fp rollout moves less than this share of the truth's frame-to-frame change
MOTION_TITLE = "Does the reference move? The fp rollout against the camera"
MOTION_KEPT_SENTENCE = ("How much each scheme's rollout moves (frame-to-frame change) over how much the fp rollout "
                        "does, per trajectory: below 1 the quantized cache damps the motion (the rollout lags and "
                        "smooths), above 1 it adds jitter. PSNR_ref counts both as error; this says which it is.")

MOTION_SENTENCE = ("Every PSNR_ref above compares against the model's own full-precision rollout. It is a demanding "
                   "reference only while it keeps moving: per family and window, the fp rollout's frame-to-frame "
                   "change (mean squared difference of consecutive frames) over the true frames' (1: it moves as the "
                   f"camera does; below {FROZEN_BELOW}, in bold: frozen).")


def kept_per_window(series: dict) -> dict[str, float | None]:
    """One trajectory's rollout change over its fp rollout's change, per window (None where the fp
    rollout did not change)."""
    quant, fp = M.window_means(series["motion_quant"]), M.window_means(series["motion_fp"])
    return {w: v / fp[w] if fp[w] > 0 else None for w, v in quant.items()}


def motion_kept(run: SchemeRun) -> dict:
    """Per window, summarize over trajectories of (rollout's change) / (fp rollout's change)."""
    windows: dict[str, list[float]] = {}
    for r in run.trajs:
        for w, kept in kept_per_window(r.series).items():
            if kept is not None:
                windows.setdefault(w, []).append(kept)
    return {"windows": {w: M.summarize(v, True) for w, v in windows.items()}}


REGIMES = ("moving", "frozen", "still")
REGIME_TITLE = "PSNR_ref where the reference moves, where it froze, on a still camera"
REGIME_SENTENCE = ("Per window, each scheme's PSNR vs the fp rollout averaged over the trajectories whose fp "
                   "rollout keeps moving there, those whose fp rollout froze (it changes less than "
                   f"{FROZEN_BELOW} of the true frames' change) and those whose true frames stand still, with "
                   "its motion kept there in brackets (its rollout's change over the fp rollout's: below 1 it "
                   "damps the motion); the number of trajectories in each is in the header.")


def regime(fp_change: float, truth_change: float) -> str:
    """One trajectory's regime in one window, from the window means of its changes."""
    if truth_change <= 0:
        return "still"
    return "frozen" if fp_change / truth_change < FROZEN_BELOW else "moving"


def psnr_by_regime(run: SchemeRun) -> dict:
    """{window: {regime: {"mean", "motion_kept", "trajectories"}}}: over the trajectories of each
    regime, the mean of their window-mean PSNR_ref and of their motion kept (the rollout's change
    over the fp rollout's; None where the fp rollout did not change); {} without a ground truth."""
    if not run.trajs or "motion_gt" not in run.trajs[0].series:
        return {}
    groups: dict[str, dict[str, list[tuple[float, float | None]]]] = {}
    for r in run.trajs:
        fp, truth = M.window_means(r.series["motion_fp"]), M.window_means(r.series["motion_gt"])
        kept = kept_per_window(r.series)
        for w, psnr in M.window_means(r.series["psnr_ref"]).items():
            if w in fp:  # a window holding only the last frame has no change in it
                groups.setdefault(w, {}).setdefault(regime(fp[w], truth[w]), []).append((psnr, kept[w]))
    return {w: {g: {"mean": M.optional_mean(p for p, _ in v), "trajectories": len(v),
                    "motion_kept": M.optional_mean(k for _, k in v)} for g, v in per.items()}
            for w, per in groups.items()}


def regime_table(report: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the PSNR_ref-by-regime table: per scheme, "moving / frozen / still" per
    window, "-" where no trajectory is in a regime; no rows without a ground truth."""
    per_scheme = {n: s["metrics"].get("psnr_by_regime") or {} for n, s in report.get("schemes", {}).items()}
    first = next((p for p in per_scheme.values() if p), None)
    if first is None:
        return [], []
    windows = M.sorted_windows(first)
    counts = ["/".join(str(first[w].get(g, {}).get("trajectories", 0)) for g in REGIMES) for w in windows]
    head = ["scheme"] + [f"{w} ({c})" for w, c in zip(windows, counts)]
    rows = [[n] + [" / ".join(_regime_cell(p.get(w, {}).get(g)) for g in REGIMES) for w in windows]
            for n, p in per_scheme.items() if p]
    return head, rows


def _regime_cell(c: dict | None) -> str:
    if c is None:
        return "-"
    kept = c.get("motion_kept")  # reports made before it was recorded have none
    return f"{c['mean']:.1f}" + ("" if kept is None else f" ({kept:.2f})")


def reference_motion(runs: dict[str, SchemeRun]) -> dict:
    """How much the fp rollout moves against the ground truth, per family and window ({} without
    a ground truth). Every scheme rolls out the same fp reference: the first run that has it."""
    trajs = next((run.trajs for run in runs.values() if run.trajs and "motion_gt" in run.trajs[0].series), None)
    if trajs is None:
        return {}
    families: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in trajs:
        for key, name in (("motion_fp", "fp"), ("motion_gt", "truth")):
            for w, v in M.window_means(r.series[key]).items():
                families.setdefault(r.family, {}).setdefault(w, {}).setdefault(name, []).append(v)
    out = {}
    for fam, windows in families.items():
        out[fam] = {}
        for w, v in windows.items():
            fp, truth = (sum(v[k]) / len(v[k]) for k in ("fp", "truth"))
            out[fam][w] = {"fp": fp, "truth": truth, "kept": M.json_safe(fp / truth) if truth > 0 else None}
    return {"frozen_below": FROZEN_BELOW, "families": out}


def frozen_families(report: dict) -> dict[str, str]:
    """{family: first window from which the fp rollout stays frozen}: kept below `frozen_below`
    in that window and every later one (the still camera, whose truth does not move, never is)."""
    motion = report.get("reference_motion") or {}
    out = {}
    for fam, windows in motion.get("families", {}).items():
        labels = M.sorted_windows(windows)
        frozen = [w for w in labels if windows[w]["kept"] is not None and windows[w]["kept"] < motion["frozen_below"]]
        tail = next((i for i in range(len(labels)) if all(w in frozen for w in labels[i:])), None)
        if tail is not None:
            out[fam] = labels[tail]
    return out


def motion_table(report: dict) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """(header, rows) of the reference-motion table: per family, the fp rollout's motion kept per
    window as (text, frozen) cells; no rows without a ground truth."""
    motion = report.get("reference_motion") or {}
    if not motion:
        return [], []
    families = motion["families"]
    windows = M.sorted_windows({w for f in families.values() for w in f})
    rows = []
    for fam, per in families.items():
        row = [(fam, False)]
        for w in windows:
            c = per.get(w)
            if c is None:
                row.append(("-", False))
            elif c["kept"] is None:
                row.append((f"truth still (fp {c['fp']:.1e})", False))
            else:
                row.append((f"{c['kept']:.3f}", c["kept"] < motion["frozen_below"]))
        rows.append(row)
    return ["family"] + windows, rows


def frozen_note(report: dict) -> str:
    """One sentence naming the families whose fp rollout froze ("" when none did)."""
    frozen = frozen_families(report)
    if not frozen:
        return ""
    return ("Frozen reference: " + "; ".join(f"{fam} from frames {w}" for fam, w in frozen.items())
            + ". There the model has all but stopped following the camera, and every scheme's PSNR vs the fp "
            "rollout scores a near-still image, which any cache that predicts across frames stores cheaply.")
