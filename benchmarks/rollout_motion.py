"""Study: does each model's full-precision rollout keep moving with the camera?

    python -m benchmarks.rollout_motion [--models tinyworld,wanworld] [--frames 256]

Every late-window number in the README is PSNR against the model's own full-precision rollout.
That rollout is only a demanding reference while it keeps changing: a rollout that stops
following the camera shows the cache the same frame again and again, which any predictive code
stores almost for free. For each model, this rolls out the held-out set of `fit.md` and
`compare.md` (evaluation seeds, one trajectory per family, window and sinks from the model's
preset) with the fp cache and with the shipped recipe, and reports per family and window the mean
frame-to-frame change, mean over pixels of (x_f - x_(f-1))^2, of the true frames (the renderer
along the trajectory), of the fp rollout, and of the rollout through the shipped recipe. `kept`
= fp rollout's change / the truth's: near 1 the model moves as the camera does, far below 1 it
has frozen; the still camera (truth 0) shows the model's change alone. `ours / fp` says whether
the 2-bit cache changes how much the rollout moves (below 1: it freezes more; above: it jitters).

Writes `rollout_motion.md` + `.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks import command_line, shipped_setup, window_note, write_report
from calibrate.cache import KVCache
from calibrate.evaluate.metrics import frame_change
from calibrate.fastcache import FastKVCache
from calibrate.replay import rollout_batch
from calibrate.world.trajectories import make_trajectories

FAMILIES = ("orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static")
WINDOWS = ((1, 16), (16, 64), (64, 128), (128, 256))
FROZEN = 0.05  # `kept` below this: the rollout has all but stopped following the camera


def measure(model: str, frames: int) -> dict:
    cfg, world, path, recipe = shipped_setup(model)
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    trajs = make_trajectories(list(FAMILIES), "evaluation", len(FAMILIES), frames)
    cpu = torch.device("cpu")
    fp, truth = rollout_batch(world, trajs, KVCache(world.info.num_layers, window, sinks), cpu, desc=f"{model} fp")
    ours, _ = rollout_batch(world, trajs, FastKVCache(recipe, window, sinks), cpu, truth=truth, desc=f"{model} ours")
    change = {name: frame_change(x) for name, x in (("truth", truth), ("fp", fp), ("ours", ours))}
    rows = {}
    for i, fam in enumerate(FAMILIES):
        rows[fam] = {}
        for a, b in WINDOWS:
            if a >= frames - 1:
                continue
            part = {name: float(c[i, a - 1:min(b, frames) - 1].mean()) for name, c in change.items()}
            rows[fam][f"{a}-{b}"] = part | {
                "kept": part["fp"] / part["truth"] if part["truth"] > 0 else None,
                "ours_over_fp": part["ours"] / part["fp"] if part["fp"] > 0 else None}
    return {"recipe": os.path.relpath(path), "window": window, "sink_frames": sinks, "frames": frames, "families": rows}


def markdown(res: dict, command: str, minutes: float) -> str:
    lines = ["# Does the full-precision rollout keep moving with the camera?", "",
             f"Command: `{command}`, {minutes:.1f} min (torch threads {torch.get_num_threads()}). The method is in "
             "`benchmarks/rollout_motion.py`'s docstring: per family and window, the mean frame-to-frame change "
             "(mean squared pixel difference of consecutive frames) of the fp rollout, `kept` = that over the true "
             f"frames' change (below {FROZEN}: frozen, in bold), and the rollout through the shipped recipe over "
             "the fp rollout's (`ours / fp`).", ""]
    for model, r in res.items():
        wins = [w for w in (f"{a}-{b}" for a, b in WINDOWS) if w in r["families"][FAMILIES[0]]]
        lines += [f"## {model}", "",
                  f"Held-out evaluation seeds, one {r['frames']}-frame trajectory per family, window {r['window']} + "
                  f"{r['sink_frames']} sink; `{r['recipe']}`. Cells: fp change (kept; ours / fp).", "",
                  "| family | " + " | ".join(w + window_note(w, r["frames"]) for w in wins) + " |",
                  "|---|" + "---|" * len(wins)]
        for fam, per in r["families"].items():
            cells = []
            for w in wins:
                c = per[w]
                kept = "truth still" if c["kept"] is None else (
                    f"**{c['kept']:.3f}**" if c["kept"] < FROZEN else f"{c['kept']:.3f}")
                ratio = "-" if c["ours_over_fp"] is None else f"{c['ours_over_fp']:.2f}"
                cells.append(f"{c['fp']:.1e} ({kept}; {ratio})")
            lines.append(f"| {fam} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tinyworld,wanworld", help="conf/model presets with a shipped recipe")
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    if args.frames < 3:
        print("rollout_motion: --frames must be at least 3", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        res = {m: measure(m, args.frames) for m in args.models.split(",") if m}
    except ValueError as err:
        print(f"rollout_motion: {err}", file=sys.stderr)
        return 2
    write_report(args.out, "rollout_motion", markdown(res, command_line("rollout_motion", argv), (time.time() - t0) / 60), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
