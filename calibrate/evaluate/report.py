"""Turn evaluation runs into report.json, report.md, plots, strips and the blind-spot table.

report.json schema (version 1; every number finite):

    {"schema": "kv-eval-report/1",
     "trajectories": [{"family", "seed", "num_frames"}, ...],
     "config": {...resolved config...},
     "schemes": {NAME: {
         "recipe": {"path": str|null, "sha256": str, "scheme": str},
         "memory": {"bytes", "peak_bytes", "predicted_bytes", "fp16_bytes", "ratio_to_fp16", "bits_per_element"},
         "metrics": {
            "psnr_ref" | "ssim_ref" | "psnr_gt": {
                "windows": {"0-16": {"mean", "p95", "worst"}, ...},  # over trajectories
                "first16": {...}, "all": {...}},                      # per-trajectory means
            "flicker": {"windows": {...}, "all": {...}},
            "motion": {"windows": {...}},   # the rollout's frame-to-frame change over the fp rollout's
            "psnr_by_regime": {} | {WINDOW: {"moving" | "frozen" | "still": {"mean", "motion_kept", "trajectories"}}},
            "drift": {"slope": {...}, "first_below": {"threshold_db", "per_trajectory": [...]}},
            "flicker_static": {"quant": x|null, "fp": y|null},
            "revisit": {"quant": x|null, "fp": y|null},
            "attention": {"kl": [L], "top_agreement": [L], "rel_err": [L], "temporal": [L]},
            "twin": {} | {"families": {FAMILY: {"trajectories": n,              # with eval.noise_twin
                                                "sqnr_db": {"k": [L], "v": [L]},  # stored vs fp, teacher-forced
                                                "windows": {"0-16": {"scheme", "twin", "gap"}, ...}}},
                          "all": {"sqnr_db": {...}, "windows": {...}}}},
         "per_frame": {"psnr_ref": [N], "flicker": [N-1]}}},
     "reference_motion": {} | {"frozen_below": x, "families": {FAMILY: {WINDOW: {"fp", "truth", "kept"}}}}}

`mean` is over trajectories (and frames within the window); `p95` and `worst` point to the bad
side (5th percentile / minimum for PSNR and SSIM, 95th percentile / maximum for flicker).
`twin`: the scheme's PSNR vs the fp rollout next to its noise twin's (evaluate/twin.py), mean
over the family's trajectories; gap = scheme - twin (below 0: the error's structure costs more
than its size). SQNR in dB is the mean over trajectories of each layer's stored K or V SQNR.
`motion` (per scheme: its rollout's frame-to-frame change over the fp rollout's; p95 and worst
are the most damped trajectories), `psnr_by_regime` (PSNR_ref over the trajectories whose fp
rollout moves, froze, or whose truth stands still, per window) and `reference_motion` (the fp
rollout's change over the truth's, per family, with a renderer's ground truth) are explained in
evaluate/motion.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from calibrate.evaluate import metrics as M
from calibrate.evaluate import motion
from calibrate.evaluate.run import SchemeRun
from calibrate.shadow import AttentionError

SCHEMA = "kv-eval-report/1"
SHORT = 16  # the benchmark blind spot: the first 16 frames
TRAP_SHORT_DB = 35.0  # at or above this PSNR vs the fp rollout a clip looks lossless
TRAP_LONG_DB = 30.0  # below this the long rollout is visibly off


def _windowed(run: SchemeRun, key: str, higher: bool) -> dict:
    per_traj = [r.series[key] for r in run.trajs]
    windows: dict[str, list[float]] = {}
    for s in per_traj:
        for label, value in M.window_means(s).items():
            windows.setdefault(label, []).append(value)
    return {
        "windows": {w: M.summarize(v, higher) for w, v in windows.items()},
        "first16": M.summarize([float(s[:SHORT].mean()) for s in per_traj], higher),
        "all": M.summarize([float(s.mean()) for s in per_traj], higher),
    }


def _mean_series(run: SchemeRun, key: str) -> list[float]:
    """Per-frame mean over trajectories of the longest length present."""
    longest = max(len(r.series[key]) for r in run.trajs)
    rows = [r.series[key] for r in run.trajs if len(r.series[key]) == longest]
    return [M.json_safe(float(x)) for x in torch.stack(rows).mean(0)]


def _twin_group(trajs) -> dict:
    L = len(trajs[0].sqnr_db["k"])
    windows = {}
    for key in ("psnr_ref", "psnr_twin"):
        for r in trajs:
            for w, v in M.window_means(r.series[key]).items():
                windows.setdefault(w, {}).setdefault(key, []).append(v)
    table = {}
    for w, v in windows.items():
        scheme, twin = (sum(v[k]) / len(v[k]) for k in ("psnr_ref", "psnr_twin"))
        table[w] = {"scheme": M.json_safe(scheme), "twin": M.json_safe(twin), "gap": M.json_safe(scheme - twin, False)}
    sqnr = {kv: [M.json_safe(sum(r.sqnr_db[kv][i] for r in trajs) / len(trajs)) for i in range(L)] for kv in ("k", "v")}
    return {"trajectories": len(trajs), "sqnr_db": sqnr, "windows": table}


def twin_summary(run: SchemeRun) -> dict:
    """The scheme against its noise twin, per family and over all trajectories ({} without a twin)."""
    trajs = [r for r in run.trajs if "psnr_twin" in r.series and r.sqnr_db is not None]
    if not trajs:
        return {}
    families: dict[str, list] = {}
    for r in trajs:
        families.setdefault(r.family, []).append(r)
    return {"families": {f: _twin_group(rs) for f, rs in families.items()}, "all": _twin_group(trajs)}


def scheme_report(name: str, run: SchemeRun, threshold_db: float) -> dict:
    mem = run.memory
    elements = mem["fp16_bytes"] / 2
    peak = mem.get("peak_bytes", mem["bytes"])  # partial files written before peaks were measured have none
    attn = AttentionError(len(run.attention.get("rows", [])) or 1, {k: list(v) for k, v in run.attention.items()}) if run.attention else None
    recipe_bytes = Path(run.recipe.path).read_bytes() if run.recipe.path else b""
    return {
        "recipe": {
            "path": run.recipe.path,
            "sha256": hashlib.sha256(recipe_bytes).hexdigest() if recipe_bytes else None,
            "scheme": run.recipe.scheme.name,
        },
        "memory": {  # bytes at the end of the rollouts; the ratio and bits at the peak over their frames
            "bytes": mem["bytes"],
            "peak_bytes": peak,
            "predicted_bytes": mem["predicted_bytes"],
            "fp16_bytes": mem["fp16_bytes"],
            "ratio_to_fp16": peak / mem["fp16_bytes"],
            "bits_per_element": 8 * peak / elements,
        },
        "metrics": {
            "psnr_ref": _windowed(run, "psnr_ref", True),
            "ssim_ref": _windowed(run, "ssim_ref", True),
            "psnr_gt": _windowed(run, "psnr_gt", True),
            "psnr_fp_gt": _windowed(run, "psnr_fp_gt", True),
            "flicker": _windowed(run, "flicker", False),
            "motion": motion.motion_kept(run),
            "psnr_by_regime": motion.psnr_by_regime(run),
            "drift": {
                "slope": M.summarize([float(M.drift_slope(r.series["err"])) for r in run.trajs], False),
                "first_below": {
                    "threshold_db": threshold_db,
                    "per_trajectory": [M.first_below(r.series["psnr_ref"], threshold_db) for r in run.trajs],
                },
            },
            "flicker_static": {"quant": M.optional_mean(r.static_q for r in run.trajs),
                               "fp": M.optional_mean(r.static_fp for r in run.trajs)},
            "revisit": {"quant": M.optional_mean(r.revisit_q for r in run.trajs),
                        "fp": M.optional_mean(r.revisit_fp for r in run.trajs)},
            "attention": {} if attn is None else {
                "kl": [M.json_safe(x, False) for x in attn.kl()],
                "top_agreement": [M.json_safe(x) for x in attn.top_agreement()],
                "rel_err": [M.json_safe(x, False) for x in attn.rel_err()],
                "temporal": [M.json_safe(x, False) for x in attn.temporal()],
            },
            "twin": twin_summary(run),
        },
        "per_frame": {"psnr_ref": _mean_series(run, "psnr_ref"), "flicker": _mean_series(run, "flicker")},
    }


def build(runs: dict[str, SchemeRun], trajectories: list[dict], config: dict, threshold_db: float) -> dict:
    return {
        "schema": SCHEMA,
        "trajectories": trajectories,
        "config": config,
        "schemes": {name: scheme_report(name, run, threshold_db) for name, run in runs.items()},
        "reference_motion": motion.reference_motion(runs),
    }


# ---- the blind-spot table ---------------------------------------------------------------------
def summary_metrics(rep: dict) -> dict:
    """The few numbers a recipe records about itself (and that task=check compares against),
    from a report of that one recipe."""
    (s,) = rep["schemes"].values()
    m = s["metrics"]
    return {"psnr_ref_all": m["psnr_ref"]["all"]["mean"], "psnr_ref_first16": m["psnr_ref"]["first16"]["mean"],
            "psnr_ref_windows": {w: v["mean"] for w, v in m["psnr_ref"]["windows"].items()},
            "flicker": m["flicker"]["all"]["mean"], "psnr_gt_all": m["psnr_gt"]["all"]["mean"],
            "bits_per_element": s["memory"]["bits_per_element"]}


def _fmt(x, digits=1):
    if x is None:
        return "-"
    if isinstance(x, float) and abs(x) >= 1e29:
        return "inf"
    return f"{x:.{digits}f}"


def blind_spot_rows(report: dict) -> list[dict]:
    rows = []
    for name, s in report["schemes"].items():
        m = s["metrics"]
        short = m["psnr_ref"]["first16"]["mean"]
        late = [v["mean"] for w, v in m["psnr_ref"]["windows"].items() if w not in ("0-16", "16-64")]
        long_mean = min(late) if late else m["psnr_ref"]["all"]["mean"]
        rows.append({
            "scheme": name,
            "bits": s["memory"]["bits_per_element"],
            "ratio": s["memory"]["ratio_to_fp16"],
            "short_psnr_ref": short,
            "short_ssim_ref": m["ssim_ref"]["first16"]["mean"],
            "short_psnr_gt": m["psnr_gt"]["first16"]["mean"],
            "long_psnr_ref": long_mean,
            "p95_psnr_ref": m["psnr_ref"]["all"]["p95"],
            "worst_window": min(v["worst"] for v in m["psnr_ref"]["windows"].values()),
            "flicker": m["flicker"]["all"]["mean"],
            "drift_slope": m["drift"]["slope"]["mean"],
            "revisit": m["revisit"]["quant"],
            "revisit_fp": m["revisit"]["fp"],
            "psnr_gt": m["psnr_gt"]["all"]["mean"],
            "trap": short >= TRAP_SHORT_DB and long_mean < TRAP_LONG_DB,
        })
    return rows


def blind_spot_markdown(report: dict) -> str:
    head = ("| scheme | bits/elem | x fp16 | short: PSNR_ref 0-16 | short: SSIM 0-16 | short: PSNR_gt 0-16 "
            "| long: PSNR_ref (worst late window mean) | tail: p95 PSNR_ref | tail: worst window | flicker "
            "| drift (err/frame) | revisit (fp) | PSNR_gt all | short-clip trap? |")
    lines = [head, "|" + "---|" * 14]
    for r in blind_spot_rows(report):
        lines.append(
            f"| {r['scheme']} | {r['bits']:.2f} | {r['ratio']:.3f} | {_fmt(r['short_psnr_ref'])} | {_fmt(r['short_ssim_ref'], 3)} "
            f"| {_fmt(r['short_psnr_gt'])} | {_fmt(r['long_psnr_ref'])} | {_fmt(r['p95_psnr_ref'])} | {_fmt(r['worst_window'])} "
            f"| {r['flicker']:.5f} | {r['drift_slope']:.2e} | {_fmt(r['revisit'])} ({_fmt(r['revisit_fp'])}) "
            f"| {_fmt(r['psnr_gt'])} | {'YES' if r['trap'] else 'no'} |"
        )
    return "\n".join(lines)


def windows_markdown(report: dict, key: str = "psnr_ref", digits: int = 2) -> str:
    names = list(report["schemes"])
    windows = M.sorted_windows(next(iter(report["schemes"].values()))["metrics"][key]["windows"])
    lines = ["| scheme | " + " | ".join(windows) + " |", "|---|" + "---|" * len(windows)]
    for n in names:
        w = report["schemes"][n]["metrics"][key]["windows"]
        lines.append(f"| {n} | " + " | ".join(f"{_fmt(w[x]['mean'], digits)} ({_fmt(w[x]['p95'], digits)})" if x in w else "-"
                                             for x in windows) + " |")
    return "\n".join(lines)


def twin_table(report: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the noise-twin table: per scheme and family (then "all"), stored SQNR
    (mean over layers) and scheme / twin PSNR (gap) per window; no rows without a twin."""
    groups = []
    for name, s in report["schemes"].items():
        twin = s["metrics"].get("twin") or {}
        groups += [(name, fam, g) for fam, g in twin.get("families", {}).items()]
        if twin:
            groups.append((name, "all", twin["all"]))
    if not groups:
        return [], []
    windows = M.sorted_windows(groups[0][2]["windows"])
    head = ["scheme", "family", "K SQNR dB", "V SQNR dB"] + [f"{w}: scheme / twin (gap)" for w in windows]
    rows = [[name, fam, *(f"{x:.1f}" for x in mean_sqnr(g))] + [twin_cell(g["windows"].get(w)) for w in windows]
            for name, fam, g in groups]
    return head, rows


def mean_sqnr(group: dict) -> tuple[float, float]:
    """A twin group's stored K and V SQNR, mean over layers (dB)."""
    k, v = (sum(group["sqnr_db"][x]) / len(group["sqnr_db"][x]) for x in ("k", "v"))
    return k, v


def twin_cell(window: dict | None) -> str:
    """One window of a twin group as "scheme / twin (gap)"; "-" when the rollouts did not reach it."""
    return "-" if window is None else f"{_fmt(window['scheme'])} / {_fmt(window['twin'])} ({window['gap']:+.1f})"


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def twin_markdown(report: dict) -> str:
    head, rows = twin_table(report)
    if not rows:
        return ""
    return "\n".join(markdown_table(head, rows))


def motion_markdown(report: dict) -> str:
    """motion.motion_table with bold frozen cells, its frozen note and motion.regime_table ("" without a
    ground truth)."""
    head, rows = motion.motion_table(report)
    if not rows:
        return ""
    lines = markdown_table(head, [[f"**{text}**" if frozen else text for text, frozen in row] for row in rows])
    note = motion.frozen_note(report)
    lines += ["", note] if note else []
    head, rows = motion.regime_table(report)
    if rows:
        lines += ["", f"**{motion.REGIME_TITLE}** (moving / frozen / still)", "", motion.REGIME_SENTENCE, ""]
        lines += markdown_table(head, rows)
    return "\n".join(lines)


TWIN_SENTENCE = ("Each scheme's noise twin rolls out with the fp cache plus independent Gaussian error of the scheme's "
                 "own stored error power (per trajectory, layer, K/V, head and window of frames, measured "
                 "teacher-forced). gap = scheme - twin PSNR vs the fp rollout: near 0 the scheme's error acts like "
                 "noise of its size; well below 0 it is coherent (it repeats or follows the content and adds up). "
                 "SQNR: stored vs fp K/V, mean over layers.")


def markdown(report: dict, command: str, images: dict[str, str]) -> str:
    parts = [
        "# Evaluation report",
        "",
        f"Command: `{command}`",
        "",
        f"{len(report['trajectories'])} held-out trajectories: "
        + ", ".join(sorted({t['family'] for t in report['trajectories']}))
        + f"; {max(t['num_frames'] for t in report['trajectories'])} frames.",
        "",
        "## Blind spot: short-clip metrics next to long-rollout, temporal and tail metrics",
        "",
        "'short' = frames 0-16 (what per-frame, short-clip benchmarks see); 'long' = the worst mean over the "
        "windows from frame 64 on; p95/worst are taken toward the bad side over trajectories and windows. "
        f"A scheme is flagged as a short-clip trap when it scores >= {TRAP_SHORT_DB:.0f} dB on frames 0-16 (looks "
        f"lossless) but its worst late window falls below {TRAP_LONG_DB:.0f} dB.",
        "",
        blind_spot_markdown(report),
        "",
        "## PSNR vs the fp rollout per window: mean (p95)",
        "",
        windows_markdown(report, "psnr_ref"),
        "",
        "## Flicker per window: mean (p95)",
        "",
        windows_markdown(report, "flicker", digits=5),
        "",
        "## Motion kept per window: mean (most damped 5%)",
        "",
        motion.MOTION_KEPT_SENTENCE,
        "",
        windows_markdown(report, "motion"),
        "",
    ]
    twin = twin_markdown(report)
    if twin:
        parts += ["## Coherent error: each scheme against its noise twin", "", TWIN_SENTENCE, "", twin, ""]
    moving = motion_markdown(report)
    if moving:
        parts += [f"## {motion.MOTION_TITLE}", "", motion.MOTION_SENTENCE, "", moving, ""]
    for title, path in images.items():
        parts += [f"## {title}", "", f"![{title}]({path})", ""]
    return "\n".join(parts)
