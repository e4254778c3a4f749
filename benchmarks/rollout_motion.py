"""Study: does each model's full-precision rollout keep moving with the camera, and does a 2-bit cache damp it?

    python -m benchmarks.rollout_motion [--models tinyworld,wanworld] [--frames 256]
        [--schemes ours,nvfp4,kivi4,kivi2,naive2] [--name rollout_motion]

Every late-window number in the README is PSNR against the model's own full-precision rollout.
That rollout is only a demanding reference while it keeps changing: a rollout that stops
following the camera shows the cache the same frame again and again, which any predictive code
stores almost for free. For each model, this rolls out the held-out set of `fit.md` and
`compare.md` (evaluation seeds, one trajectory per family, window and sinks from the model's
preset) with the fp cache and with each scheme (`ours`: the model's shipped recipe; the others
are baselines that need no calibration data), and reports per family and window the mean
frame-to-frame change, mean over pixels of (x_f - x_(f-1))^2 (metrics.frame_change), of the true
frames (the renderer along the trajectory), of the fp rollout and of each scheme's rollout.
`kept` = fp rollout's change / the truth's: near 1 the model moves as the camera does, below
evaluate/motion.FROZEN_BELOW it has frozen; the still camera (truth 0) shows the model's change
alone. A scheme's change / the fp rollout's says whether its cache changes how much the rollout
moves (below 1: it damps the motion; above: it jitters).

Writes `<name>.md` + `.json`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

from benchmarks import command_line, shipped_setup, window_note, write_report
from calibrate.cache import KVCache
from calibrate.evaluate.metrics import frame_change
from calibrate.evaluate.motion import FROZEN_BELOW
from calibrate.fastcache import FastKVCache
from calibrate.replay import rollout_batch
from calibrate.schemes import build_baseline
from calibrate.world.trajectories import make_trajectories

FAMILIES = ("orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static")
WINDOWS = ((1, 16), (16, 64), (64, 128), (128, 256))


def scheme_recipes(names: list[str], world, shipped):
    """{name: recipe}: `ours` is the shipped recipe, the others baselines (ValueError in one line
    for one that needs calibration data or does not exist)."""
    return {n: shipped if n == "ours" else build_baseline(n, world.info) for n in names}


def measure(model: str, frames: int, schemes: list[str]) -> dict:
    cfg, world, path, shipped = shipped_setup(model)
    recipes = scheme_recipes(schemes, world, shipped)
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    trajs = make_trajectories(list(FAMILIES), "evaluation", len(FAMILIES), frames)
    cpu = torch.device("cpu")
    fp, truth = rollout_batch(world, trajs, KVCache(world.info.num_layers, window, sinks), cpu, desc=f"{model} fp")
    change = {"truth": frame_change(truth), "fp": frame_change(fp)}
    for name, recipe in recipes.items():
        frames_q, _ = rollout_batch(world, trajs, FastKVCache(recipe, window, sinks), cpu, truth=truth, desc=f"{model} {name}")
        change[name] = frame_change(frames_q)
    rows = {}
    for i, fam in enumerate(FAMILIES):
        rows[fam] = {}
        for a, b in WINDOWS:
            if a >= frames - 1:
                continue
            part = {name: float(c[i, a - 1:min(b, frames) - 1].mean()) for name, c in change.items()}
            rows[fam][f"{a}-{b}"] = {
                "truth": part["truth"], "fp": part["fp"],
                "kept": part["fp"] / part["truth"] if part["truth"] > 0 else None,
                "schemes": {n: {"change": part[n], "over_fp": part[n] / part["fp"] if part["fp"] > 0 else None}
                            for n in recipes}}
    return {"recipe": os.path.relpath(path), "window": window, "sink_frames": sinks, "frames": frames,
            "schemes": list(recipes), "families": rows}


def markdown(res: dict, command: str, minutes: float) -> str:
    lines = ["# Does the full-precision rollout keep moving with the camera, and does a 2-bit cache damp it?", "",
             f"Command: `{command}`, {minutes:.1f} min (torch threads {torch.get_num_threads()}). The method is in "
             "`benchmarks/rollout_motion.py`'s docstring. Change = mean squared pixel difference of consecutive "
             f"frames. `kept` = the fp rollout's change over the true frames' (below {FROZEN_BELOW}: frozen, in "
             "bold); each scheme's change over the fp rollout's (below 1: its cache damps the motion).", ""]
    for model, r in res.items():
        wins = [w for w in (f"{a}-{b}" for a, b in WINDOWS) if w in r["families"][FAMILIES[0]]]
        heads = [w + window_note(w, r["frames"]) for w in wins]
        lines += [f"## {model}", "",
                  f"Held-out evaluation seeds, one {r['frames']}-frame trajectory per family, window {r['window']} + "
                  f"{r['sink_frames']} sink; `ours` = `{r['recipe']}`.", "",
                  "The fp rollout: its change (kept).", "",
                  "| family | " + " | ".join(heads) + " |", "|---|" + "---|" * len(wins)]
        for fam, per in r["families"].items():
            cells = []
            for w in wins:
                kept = per[w]["kept"]
                shown = "truth still" if kept is None else (f"**{kept:.3f}**" if kept < FROZEN_BELOW else f"{kept:.3f}")
                cells.append(f"{per[w]['fp']:.1e} ({shown})")
            lines.append(f"| {fam} | " + " | ".join(cells) + " |")
        late = wins[-1]
        lines += ["", f"Each scheme's change over the fp rollout's, frames {late}{window_note(late, r['frames'])}:", "",
                  "| scheme | " + " | ".join(FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
        for name in r["schemes"]:
            cells = [r["families"][f][late]["schemes"][name]["over_fp"] for f in FAMILIES]
            lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tinyworld,wanworld", help="conf/model presets with a shipped recipe")
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--schemes", default="ours,nvfp4,kivi4,kivi2,naive2",
                   help="ours (the shipped recipe) and baselines that need no calibration data")
    p.add_argument("--name", default="rollout_motion", help="the report's file stem under --out")
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    if args.frames < 3:
        print("rollout_motion: --frames must be at least 3", file=sys.stderr)
        return 2
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.name):
        print(f"rollout_motion: --name {args.name!r}: letters, digits, _ and - only (a file name under --out)",
              file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        res = {m: measure(m, args.frames, [n for n in args.schemes.split(",") if n]) for m in args.models.split(",") if m}
    except ValueError as err:
        print(f"rollout_motion: {err}", file=sys.stderr)
        return 2
    write_report(args.out, args.name, markdown(res, command_line("rollout_motion", argv), (time.time() - t0) / 60), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
