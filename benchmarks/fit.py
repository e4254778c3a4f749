"""Benchmark: the fitted recipe (`ours`) and its ablations against the baselines.

    python -m benchmarks.fit [--out artifacts/benchmarks] [--frames 256] [--trajectories 7]

Fits `ours` with the default config, with one mechanism off at a time (temporal term,
rotation, outlier channels, anchor policy, mixed precision, dense-and-sparse), and at a
3.25-bit budget (about kvquant2's measured bits), evaluates every recipe and every
baseline on held-out evaluation seeds (all families, 256-frame rollouts), and writes
`fit.md` + `fit.json`: PSNR vs the fp rollout in windows 0-64 and 64-256, flicker, PSNR vs
ground truth and measured bits per element, plus the targets of the fitting issue, each
marked met or not met. Run outputs (recipes, per-scheme report) go to --run-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from calibrate import pipeline
from calibrate.config import Config, TrajectoriesConfig
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import evaluate
from calibrate.io import write_text_atomic
from calibrate.recipe import save_recipe

ABLATIONS = {
    "ours": {},
    "ours_lambda0": {"lambda_temporal": 0.0},
    "ours_no_rotation": {"rotations": ["none"]},
    "ours_no_outliers": {"outlier_channels": 0},
    "ours_no_anchors": {"anchors": False},
    "ours_no_mixed": {"mixed_precision": False},
    "ours_no_sparse": {"sparse_fraction": 0.0},
    "ours_no_logit": {"logit_correction": False},
    "ours_3.25bit": {"budget_bits": 3.25},  # about kvquant2's measured bits: equal-memory comparison
}
BASELINES_2BIT = ("naive2", "kivi2", "quarot2", "kvquant2", "qvg2")


def window_mean(run, key: str, lo: int, hi: int) -> float:
    vals = [float(r.series[key][lo:hi].mean()) for r in run.trajs if len(r.series[key]) > lo]
    return sum(vals) / len(vals) if vals else float("nan")


def table(runs, rep) -> list[dict]:
    rows = []
    for name, run in runs.items():
        mem = rep["schemes"][name]["memory"]
        rows.append({
            "scheme": name,
            "psnr_ref_0_64": window_mean(run, "psnr_ref", 0, 64),
            "psnr_ref_64_256": window_mean(run, "psnr_ref", 64, 256),
            "flicker": sum(float(r.series["flicker"].mean()) for r in run.trajs) / len(run.trajs),
            "psnr_gt": sum(float(r.series["psnr_gt"].mean()) for r in run.trajs) / len(run.trajs),
            "psnr_fp_gt": sum(float(r.series["psnr_fp_gt"].mean()) for r in run.trajs) / len(run.trajs),
            "bits": mem["bits_per_element"],
            "bytes": mem["bytes"],
            "revisit": rep["schemes"][name]["metrics"]["revisit"]["quant"],
        })
    return rows


def targets(rows: list[dict]) -> list[dict]:
    by = {r["scheme"]: r for r in rows}
    ours = by["ours"]
    base = [by[b] for b in BASELINES_2BIT if b in by]
    best_bytes = min(b["bytes"] for b in base)
    out = [
        {"target": "ours beats every 2-bit baseline on psnr_ref 0-64",
         "met": all(ours["psnr_ref_0_64"] > b["psnr_ref_0_64"] for b in base)},
        {"target": "ours beats every 2-bit baseline on psnr_ref 64-256",
         "met": all(ours["psnr_ref_64_256"] > b["psnr_ref_64_256"] for b in base)},
        {"target": "ours beats every 2-bit baseline on flicker", "met": all(ours["flicker"] < b["flicker"] for b in base)},
        {"target": "... at no more memory than the smallest of them",
         "met": ours["bytes"] <= best_bytes, "detail": f"ours {ours['bytes']} B vs smallest 2-bit baseline {best_bytes} B"},
    ]
    if "kivi4" in by:
        k4 = by["kivi4"]
        out += [
            {"target": "ours flicker <= kivi4 flicker", "met": ours["flicker"] <= k4["flicker"],
             "detail": f"{ours['flicker']:.5f} vs {k4['flicker']:.5f}"},
            {"target": "ours bytes <= 60% of kivi4", "met": ours["bytes"] <= 0.6 * k4["bytes"],
             "detail": f"{ours['bytes'] / k4['bytes']:.1%} of kivi4"},
        ]
    return out


def markdown(rows, tgts, fit_records, command: str, elapsed: float, ntraj: int, frames: int) -> str:
    lines = [
        "# Fitting benchmark: `ours` and ablations vs baselines",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {elapsed / 60:.1f} min on this CPU.  ",
        f"Held-out evaluation seeds, {ntraj} trajectories (all families), {frames} frames, window 16 + 1 sink frame.",
        "",
        "| scheme | bits/elem (measured) | PSNR_ref 0-64 | PSNR_ref 64-256 | flicker | PSNR_gt (fp: same row) | revisit consistency |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['bits']:.3f} | {r['psnr_ref_0_64']:.2f} | {r['psnr_ref_64_256']:.2f} | "
                     f"{r['flicker']:.5f} | {r['psnr_gt']:.2f} ({r['psnr_fp_gt']:.2f}) | "
                     f"{'-' if r['revisit'] is None else format(r['revisit'], '.2f')} |")
    lines += ["", "## Targets", "", "| target | met | detail |", "|---|---|---|"]
    for t in tgts:
        lines.append(f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t.get('detail', '')} |")
    lines += ["", "## What the fitter chose (default `ours`)", "", "```", json.dumps(fit_records.get("ours", {}), indent=1)[:6000], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--run-dir", default="artifacts/runs/bench_fit")
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--trajectories", type=int, default=7)
    p.add_argument("--calib-frames", type=int, default=256, help="frames of each calibration trajectory")
    p.add_argument("--calib-trajectories", type=int, default=7)
    p.add_argument("--ablations", default=",".join(ABLATIONS))
    p.add_argument("--baselines", default="naive2,kivi2,quarot2,kvquant2,qvg2,kivi4")
    args = p.parse_args(argv)
    t0 = time.time()
    cfg = Config()
    cfg.trajectories = replace(cfg.trajectories, num_frames=args.calib_frames, num_trajectories=args.calib_trajectories)
    device = pipeline.resolve_device(cfg.device)
    try:
        model = pipeline.load_world(cfg, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    recipes, records = {}, {}
    recording = pipeline.calibration_recording(cfg, model, device)  # one replay serves every variant
    for name in args.ablations.split(","):
        fit_cfg = replace(cfg, fit=replace(cfg.fit, **ABLATIONS[name]))
        recipe, record = pipeline.fit(fit_cfg, model, device, recording)
        save_recipe(recipe, run_dir / f"{name}.safetensors")
        recipes[name], records[name] = recipe, record
    baselines = [b for b in args.baselines.split(",") if b]
    recipes.update(pipeline.resolve_schemes(cfg, baselines, model, device, pipeline.kv_sample(recording)))
    eval_cfg = replace(cfg, trajectories=TrajectoriesConfig(split="evaluation", num_trajectories=args.trajectories,
                                                            num_frames=args.frames))
    trajs = pipeline.trajectory_set(eval_cfg)
    runs = evaluate(model, recipes, trajs, cfg.model.cache.window, cfg.model.cache.sink_frames, device,
                    cfg.trajectories.batch_size, attention=False)
    rep = report_mod.build(runs, [], {}, cfg.eval.psnr_threshold_db)
    rows = table(runs, rep)
    tgts = targets(rows)
    command = "python -m benchmarks.fit " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(rows, tgts, records, command, time.time() - t0, len(trajs), args.frames)
    out = Path(args.out)
    write_text_atomic(out / "fit.md", md)
    write_text_atomic(out / "fit.json", json.dumps({"rows": rows, "targets": tgts, "fit": records}, indent=1, sort_keys=True))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
