"""Study: are the shipped recipe's steps where the rollout wants them? (issue 28 item 4)

    python -m benchmarks.step_scale [--recipe recipes/tinyworld-ours-2bit.safetensors] [--scales 1,1.25,1.5]
                                    [--out artifacts/benchmarks/step_scale.md]

Every head's `unit` in the recipe (all its levels and steps, the anchors' reach) times each scale:
the same bits, nothing refitted. Each scaled recipe is written under
artifacts/runs/step_scale/<time>/ and evaluated by `python -m calibrate task=evaluate` on the
held-out rollouts the default run evaluates on (TinyWorld: 7 families x 256 frames), noise twins
and attention metrics off. If a scale other than 1 wins late, the objective that chose the steps
(teacher-forced, fit/predictive_search.py) still disagrees with the rollout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from benchmarks import command_line
from calibrate.io import write_text_atomic

WINDOWS = ("0-16", "16-64", "64-128", "128-256")


def scaled(recipe: Path, scale: float, out: Path) -> Path:
    """`recipe` with every `*.unit` tensor times `scale`, metadata unchanged."""
    tensors = load_file(str(recipe))
    with safe_open(str(recipe), "pt") as f:
        metadata = f.metadata()
    save_file({k: v * scale if k.endswith(".unit") else v for k, v in tensors.items()}, str(out), metadata=metadata)
    return out


def evaluate(recipe: Path, run_dir: Path) -> dict:
    """`task=evaluate` of one recipe; its metrics (report.json) and wall time."""
    t0 = time.time()
    run = subprocess.run([sys.executable, "-m", "calibrate", "task=evaluate", f"recipe={recipe}",
                          "eval.noise_twin=false", "eval.attention=false", f"hydra.run.dir={run_dir}"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"error: task=evaluate of {recipe} failed (exit {run.returncode}): "
                 f"{run.stderr.strip().splitlines()[-1:]}")
    report = json.loads((run_dir / "report.json").read_text())
    (scheme,) = report["schemes"].values()
    m = scheme["metrics"]
    return {"wall_s": round(time.time() - t0, 1), "bits": scheme["memory"]["bits_per_element"],
            "psnr": {w: m["psnr_ref"]["windows"][w] for w in WINDOWS},
            "flicker": {w: m["flicker"]["windows"][w]["mean"] for w in WINDOWS},
            "revisit": m["revisit"]}


def markdown(rows: dict[float, dict], command: str, date: str, recipe: Path) -> str:
    lines = ["# Step scale: the shipped recipe's steps against coarser and finer ones", "",
             f"- command: `{command}`; date: {date}",
             f"- recipe: `{recipe}`, every head's `unit` times the scale (same bits, nothing refitted); "
             "held-out rollouts of the default run, `task=evaluate`, noise twins and attention metrics off",
             "- PSNR vs the fp rollout; worst = the worst trajectory's mean in the window (on TinyWorld the "
             "still camera); p95 toward the bad side over trajectories and frames", "",
             "| unit x | bits | 0-16 | 16-64 | 64-128 | 128-256 mean | 128-256 p95 | 128-256 worst | "
             "flicker 128-256 | revisit (fp) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for scale, r in rows.items():
        p = r["psnr"]
        lines.append(f"| {scale:g} | {r['bits']:.2f} | {p['0-16']['mean']:.2f} | {p['16-64']['mean']:.2f} | "
                     f"{p['64-128']['mean']:.2f} | {p['128-256']['mean']:.2f} | {p['128-256']['p95']:.2f} | "
                     f"{p['128-256']['worst']:.2f} | {r['flicker']['128-256']:.5f} | "
                     f"{r['revisit']['quant']:.2f} ({r['revisit']['fp']:.2f}) |")
    best = max(rows, key=lambda s: rows[s]["psnr"]["128-256"]["mean"])
    lines += ["", f"Best late mean: unit x{best:g}" + (" (the fitted steps)." if best == 1 else
                                                      ": the fitted steps are finer than the rollout wants."), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/tinyworld-ours-2bit.safetensors")
    p.add_argument("--scales", default="1,1.25,1.5")
    p.add_argument("--out", default="artifacts/benchmarks/step_scale.md")
    args = p.parse_args(argv)
    recipe = Path(args.recipe)
    try:
        scales = [float(s) for s in args.scales.split(",")]
    except ValueError:
        print(f"error: --scales {args.scales!r}: expected numbers separated by commas, e.g. 1,1.25,1.5", file=sys.stderr)
        return 2
    if not recipe.is_file():
        print(f"error: {recipe}: no such recipe file", file=sys.stderr)
        return 2
    if any(s <= 0 for s in scales):
        print(f"error: --scales {args.scales!r}: every scale must be > 0", file=sys.stderr)
        return 2
    run_dir = Path("artifacts/runs/step_scale") / datetime.now(timezone.utc).strftime("%Y-%m-%d_%H-%M-%S")
    run_dir.mkdir(parents=True)
    rows = {}
    for scale in scales:
        print(f"unit x{scale:g} ...", flush=True)
        rows[scale] = evaluate(scaled(recipe, scale, run_dir / f"x{scale:g}.safetensors"), run_dir / f"x{scale:g}")
    command = command_line("step_scale", argv)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = markdown(rows, command, date, recipe)
    out = Path(args.out)
    write_text_atomic(out, md)
    write_text_atomic(out.with_suffix(".json"), json.dumps({"date": date, "recipe": str(recipe), "rows": rows}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
