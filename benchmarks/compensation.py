"""Benchmark: error compensation (issue 6) on and off at equal total budget.

    python -m benchmarks.compensation [--out artifacts/benchmarks] [--budgets 2.5,3.25]
    python -m benchmarks.compensation --quick --out /tmp/bench   # a few minutes: sanity run

Fits `ours` once per mechanism from one calibration replay, every variant under the same
`fit.budget_bits` (per-frame bytes of every mechanism counted inside it: key frames spend it,
the compensator and the logit correction are static recipe tensors, reported as static bytes):

- `off`: compensator, logit correction and key frames off (the defaults before this benchmark; the logit correction is on by default since it earned it here);
- `comp_r<r>`: the low-rank residual compensator of rank r (fit/compensate.py);
- `logit`: the key-noise logit correction (fit/logit_correction.py);
- `keyframes`: the allocator may spend the budget on key frames (fit/search.py);
- `all`: the three together.

Each recipe is evaluated on held-out trajectories (all families): PSNR vs the fp rollout per
window (0-16/16-64/64-128/128-256), flicker, drift (error slope per frame and first frame
below 30 dB), attention KL to the fp rollout (teacher-forced), measured bits per element,
static bytes, and CPU time per generated frame of the quantized rollout (time.process_time
around one rollout of the first batch, divided by the frames it generated; the fp16 cache is
timed the same way for reference). A mechanism *earns* its place as a default when, at the same
budget, its long-window PSNR (windows from frame 64 on) is higher than `off`'s and its flicker
is not worse (at most 1% above, the run-to-run noise of the mean). Writes
`compensation.md` and `compensation.json` under --out; fitted recipes go to --run-dir.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import command_line
from calibrate import calibration, pipeline
from calibrate.cache import KVCache
from calibrate.config import Config, TrajectoriesConfig
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import evaluate
from calibrate.io import write_text_atomic
from calibrate.memory import memory_section
from calibrate.recipe import save_recipe
from calibrate.replay import rollout_batch
from calibrate.fastcache import FastKVCache

LONG_FROM = 64  # windows starting here or later are "long"
FLICKER_TOLERANCE = 0.01  # relative: "not worse" allows this much (noise of the mean)


def variants(comp_rank: int) -> dict[str, dict]:
    off = {"comp_rank": 0, "logit_correction": False, "keyframes": False}  # explicit: defaults may change
    return {
        "off": off,
        f"comp_r{comp_rank}": {**off, "comp_rank": comp_rank},
        "logit": {**off, "logit_correction": True},
        "keyframes": {**off, "keyframes": True},
        "all": {"comp_rank": comp_rank, "logit_correction": True, "keyframes": True},
    }


def cpu_ms_per_frame(model, recipe, trajs, window: int, sink: int, device) -> float:
    """process_time of one rollout of `trajs` (one batch), per generated frame, in ms."""
    cache = KVCache(model.info.num_layers, window, sink) if recipe is None else \
        FastKVCache.from_recipe(recipe, window, sink, device)
    start = time.process_time()
    rollout_batch(model, trajs, cache, device)
    generated = len(trajs) * (trajs[0].num_frames - 1)
    return 1000 * (time.process_time() - start) / generated


def row(name: str, rep: dict, recipe, record: dict, cpu_ms: float, window: int, sink: int) -> dict:
    s = rep["schemes"][name]
    m = s["metrics"]
    psnr = {w: v["mean"] for w, v in m["psnr_ref"]["windows"].items()}
    long = [v for w, v in psnr.items() if int(w.split("-")[0].rstrip("+")) >= LONG_FROM]
    kl = m["attention"].get("kl") or []
    firsts = [f for f in m["drift"]["first_below"]["per_trajectory"] if f is not None]
    policy = recipe.scheme.policy
    return {
        "scheme": name,
        "psnr_ref": psnr,
        "psnr_long": sum(long) / len(long) if long else float("nan"),
        "flicker": m["flicker"]["all"]["mean"],
        "drift_slope": m["drift"]["slope"]["mean"],
        "first_below_30db": min(firsts) if firsts else None,
        "attention_kl": sum(kl) / len(kl) if kl else None,
        "bits_measured": s["memory"]["bits_per_element"],
        "bits_budgeted": memory_section(recipe, window, sink)["bits_per_element"],
        "static_bytes": memory_section(recipe, window, sink)["static_bytes"],
        "cpu_ms_per_frame": cpu_ms,
        "keyframes": f"every {policy.keyframe_interval} at {policy.keyframe_bits} bits" if policy.keyframe_interval else "none",
        "compensators": len(record.get("compensators", [])),
        "logit_alpha": [l["alpha"] for l in record.get("logit_correction", [])],
        "closed_loop_chosen": record.get("closed_loop", {}).get("chosen"),
    }


def kept(r: dict) -> dict[str, bool]:
    """Whether the fitter kept each mechanism in a recipe (it may decline what it was offered)."""
    return {"comp_rank": r["compensators"] > 0, "keyframes": r["keyframes"] != "none",
            "logit_correction": any(a > 0 for layer in r["logit_alpha"] for a in layer)}


def verdicts(rows: dict[str, dict], budgets: list[float], offered: dict[str, dict]) -> list[dict]:
    """Each variant against `off` at the same budget; `offered` = variant -> its fit overrides."""
    out = []
    for b in budgets:
        off = rows.get(_label("off", b, budgets))
        for name, overrides in offered.items():
            r = rows.get(_label(name, b, budgets))
            if name == "off" or r is None or off is None:
                continue
            better_long = r["psnr_long"] > off["psnr_long"]
            flicker_ok = r["flicker"] <= off["flicker"] * (1 + FLICKER_TOLERANCE)
            declined = [k for k, on in overrides.items() if on and not kept(r)[k]]  # offered, not taken
            out.append({"mechanism": name, "budget_bits": b, "earns": better_long and flicker_ok,
                        "psnr_long_delta_db": r["psnr_long"] - off["psnr_long"],
                        "flicker_rel_change": r["flicker"] / off["flicker"] - 1,
                        "static_bytes_delta": r["static_bytes"] - off["static_bytes"],
                        "cpu_ms_delta": r["cpu_ms_per_frame"] - off["cpu_ms_per_frame"],
                        "note": f"the fitter declined {', '.join(declined)} (no objective gain worth it)" if declined else ""})
    return out


def _label(name: str, budget: float, budgets: list[float]) -> str:
    return name if len(budgets) == 1 else f"{name}@{budget:g}"


def markdown(rows: dict[str, dict], verdict: list[dict], fp_ms: float, command: str, elapsed: float, setup: str) -> str:
    windows = list(next(iter(rows.values()))["psnr_ref"])
    lines = [
        "# Error compensation: compensator, logit correction, key frames (equal total budget)",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {elapsed / 60:.1f} min on "
        f"{platform.machine()} / {platform.processor() or platform.platform()} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} thread(s)).  ",
        setup,
        "",
        "PSNR vs the fp rollout per window (mean over trajectories), flicker, drift, attention KL (mean over layers), "
        "bits per element (measured at the end of the rollout / budgeted worst phase), static recipe bytes and CPU "
        f"time per generated frame (fp16 cache: {fp_ms:.2f} ms).",
        "",
        "| scheme | " + " | ".join(f"PSNR {w}" for w in windows) + " | PSNR long | flicker | drift slope | "
        "first < 30 dB | attn KL | bits (meas/budget) | static bytes | CPU ms/frame | key frames | compensators | logit alpha |",
        "|---|" + "---|" * (len(windows) + 11),
    ]
    for r in rows.values():
        kl = "-" if r["attention_kl"] is None else f"{r['attention_kl']:.4f}"
        lines.append(
            f"| {r['scheme']} | " + " | ".join(f"{r['psnr_ref'][w]:.2f}" for w in windows)
            + f" | {r['psnr_long']:.2f} | {r['flicker']:.5f} | {r['drift_slope']:.2e} | {r['first_below_30db']} | {kl} "
            f"| {r['bits_measured']:.3f} / {r['bits_budgeted']:.3f} | {r['static_bytes']:,} | {r['cpu_ms_per_frame']:.2f} "
            f"| {r['keyframes']} | {r['compensators']} | {r['logit_alpha'] or '-'} |")
    lines += ["", "## Does each mechanism earn a default?", "",
              f"Earns = higher long-window PSNR (windows from frame {LONG_FROM}) than `off` at the same budget and "
              f"flicker at most {FLICKER_TOLERANCE:.0%} above it.", "",
              "| mechanism | budget | PSNR long delta (dB) | flicker change | static bytes added | CPU ms/frame added "
              "| earns | note |", "|---|---|---|---|---|---|---|---|"]
    for v in verdict:
        lines.append(f"| {v['mechanism']} | {v['budget_bits']:g} | {v['psnr_long_delta_db']:+.2f} | "
                     f"{v['flicker_rel_change']:+.1%} | {v['static_bytes_delta']:+,} | {v['cpu_ms_delta']:+.2f} | "
                     f"{'yes' if v['earns'] else 'no'} | {v['note']} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--run-dir", default="artifacts/runs/bench_compensation")
    p.add_argument("--budgets", default="2.5", help="comma-separated fit.budget_bits values")
    p.add_argument("--comp-rank", type=int, default=8)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--trajectories", type=int, default=7)
    p.add_argument("--calib-frames", type=int, default=256, help="frames of each calibration trajectory")
    p.add_argument("--calib-trajectories", type=int, default=7)
    p.add_argument("--quick", action="store_true",
                   help="sanity run: 2 x 64-frame calibration, 24 traced frames, 3 x 96-frame evaluation")
    args = p.parse_args(argv)
    if args.quick:
        args.frames, args.trajectories, args.calib_frames, args.calib_trajectories = 96, 3, 64, 2
    budgets = [float(b) for b in args.budgets.split(",") if b]
    t0 = time.time()
    cfg = Config()
    cfg.trajectories = replace(cfg.trajectories, num_frames=args.calib_frames, num_trajectories=args.calib_trajectories)
    if args.quick:
        cfg.fit = replace(cfg.fit, trace_frames=24, trace_trajectories=2, closed_loop_frames=32,
                          closed_loop_trajectories=1, sample_tokens=1024)
    window, sink = cfg.model.cache.window, cfg.model.cache.sink_frames
    device = pipeline.resolve_device(cfg.device)
    try:
        model = pipeline.load_world(cfg, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    recording = calibration.calibration_recording(cfg, model, device)  # one replay serves every variant
    recipes, records = {}, {}
    for budget in budgets:
        for name, overrides in variants(args.comp_rank).items():
            label = _label(name, budget, budgets)
            fit_cfg = replace(cfg, fit=replace(cfg.fit, budget_bits=budget, **overrides))
            recipe, record = calibration.fit(fit_cfg, model, device, recording)
            save_recipe(recipe, Path(args.run_dir) / f"{label}.safetensors")
            recipes[label], records[label] = recipe, record
    eval_cfg = replace(cfg, trajectories=TrajectoriesConfig(split="evaluation", num_trajectories=args.trajectories,
                                                            num_frames=args.frames))
    trajs = pipeline.trajectory_set(eval_cfg)
    runs = evaluate(model, recipes, trajs, window, sink, device, cfg.trajectories.batch_size, attention=True)
    rep = report_mod.build(runs, [], {}, cfg.eval.psnr_threshold_db)
    timed = trajs[: cfg.trajectories.batch_size]
    fp_ms = cpu_ms_per_frame(model, None, timed, window, sink, device)
    rows = {n: row(n, rep, r, records[n], cpu_ms_per_frame(model, r, timed, window, sink, device), window, sink)
            for n, r in recipes.items()}
    verdict = verdicts(rows, budgets, variants(args.comp_rank))
    command = command_line("compensation", argv)
    setup = (f"Calibration: {args.calib_trajectories} x {args.calib_frames} frames; held-out evaluation: "
             f"{len(trajs)} trajectories (all families) x {args.frames} frames; window {window} + {sink} sink; "
             f"budget(s) {', '.join(f'{b:g}' for b in budgets)} bits/element; compensator rank {args.comp_rank}."
             + (" QUICK MODE: a sanity run, not a measurement to decide defaults on." if args.quick else ""))
    md = markdown(rows, verdict, fp_ms, command, time.time() - t0, setup)
    out = Path(args.out)
    write_text_atomic(out / "compensation.md", md)
    write_text_atomic(out / "compensation.json", json.dumps(
        {"rows": rows, "verdicts": verdict, "fp16_cpu_ms_per_frame": fp_ms, "fit": records, "command": command,
         "setup": setup}, indent=1, sort_keys=True, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
