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


def motion_kept(run: SchemeRun) -> dict:
    """Per window, summarize over trajectories of (rollout's change) / (fp rollout's change)."""
    windows: dict[str, list[float]] = {}
    for r in run.trajs:
        quant, fp = M.window_means(r.series["motion_quant"]), M.window_means(r.series["motion_fp"])
        for w, v in quant.items():
            if fp[w] > 0:
                windows.setdefault(w, []).append(v / fp[w])
    return {"windows": {w: M.summarize(v, True) for w, v in windows.items()}}


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


def motion_markdown(report: dict) -> str:
    head, rows = motion_table(report)
    if not rows:
        return ""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(f"**{text}**" if frozen else text for text, frozen in row) + " |" for row in rows]
    note = frozen_note(report)
    return "\n".join(lines + (["", note] if note else []))
