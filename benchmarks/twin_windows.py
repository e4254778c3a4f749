"""Study: is a noise-twin gap on the first frames coherence, or those frames' larger error?

    python -m benchmarks.twin_windows [--frames 256] [--model tinyworld] [--recipe PATH]

Writes `twin_windows.md` + `.json` (`twin_windows_<model>` for another model than TinyWorld).
The evaluation's noise twin (calibrate/evaluate/twin.py) gives every stored element noise of one
power per trajectory, layer, K/V and head: the scheme's stored error measured teacher-forced and
averaged over the whole rollout. A predictive chain starts from the sink frame's states and
settles over its first frames, so its stored error need not be the same in every window: where
the scheme's error in a window is larger than its average, the twin's is smaller than the
scheme's there, and the gap (scheme minus twin) counts that difference of size as structure.

`shadow.StoredError` sums the stored error per window of steps (the held history at each step
against the fp history, in the window of the frame the step appends); this study rolls out one
twin with the whole rollout's power (`noise_std(per_window=False)`, the evaluation's twin before
this study) and one whose frames get the power of the window they are stored in (`noise_std()`,
the evaluation's twin since). Both draw from the same seed. On the model's held-out rollouts of
`fit.md` (evaluation seeds, one trajectory per family), through the runtime (`FastKVCache`) with
the model's shipped recipe: per family and window, the scheme's PSNR vs the fp rollout, each
twin's gap, and the stored SQNR of each window.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import command_line, report_name, shipped_setup, write_report
from benchmarks.sink_hold_study import FIT_ORDER
from calibrate.evaluate import metrics as M
from calibrate.evaluate.twin import TWIN_SEED, NoiseTwinCache
from calibrate.fastcache import FastKVCache
from calibrate.replay import rollout_batch
from calibrate.shadow import ShadowCache
from calibrate.world.trajectories import make_trajectories


def measure(world, recipe, trajs, window: int, sinks: int) -> dict:
    L, cpu = world.info.num_layers, torch.device("cpu")
    shadow = ShadowCache(L, window, sinks, {"ours": FastKVCache.from_recipe(recipe, window, sinks)}, attention=False,
                         stored=True)
    ref, truth = rollout_batch(world, trajs, shadow, cpu)
    quant, _ = rollout_batch(world, trajs, FastKVCache.from_recipe(recipe, window, sinks), cpu, truth=truth)
    stored = shadow.stored["ours"]
    twins = {name: rollout_batch(world, trajs, NoiseTwinCache(L, window, sinks, stored.noise_std(per_window), TWIN_SEED),
                                 cpu, truth=truth)[0] for name, per_window in (("twin", False), ("windowed", True))}
    sqnr = stored.sqnr_db(per_window=True).mean(2)  # [W, B, 2]: mean over layers
    out = {}
    for b, t in enumerate(trajs):
        row = {k: M.window_means(M.psnr(x[b], ref[b])) for k, x in (("scheme", quant), *twins.items())}
        row["sqnr"] = {M.window_label(*w): [float(sqnr[i, b, 0]), float(sqnr[i, b, 1])]
                       for i, w in enumerate(M.DEFAULT_WINDOWS) if M.window_label(*w) in row["scheme"]}
        out[t.family] = row
    return out


def markdown(res: dict, command: str, minutes: float, recipe: str) -> str:
    fams = list(res)
    windows = list(res[fams[0]]["scheme"])
    lines = ["# The noise twin's gap per window: error power of the whole rollout or of the window", "",
             f"Command: `{command}`, {minutes:.1f} min (torch threads {torch.get_num_threads()}). `{recipe}` through the "
             "runtime; the method is in `benchmarks/twin_windows.py`'s docstring. Per family and window: the scheme's "
             "PSNR vs the fp rollout; the gap to the twin with one power for the whole rollout / to the twin with each "
             "window's own power; the stored SQNR in that window, K / V dB (mean over layers).", "",
             "| family | " + " | ".join(windows) + " |", "|---|" + "---|" * len(windows)]
    for f in fams:
        r = res[f]
        cells = [f"{r['scheme'][w]:.1f}; gap {r['scheme'][w] - r['twin'][w]:+.1f} / {r['scheme'][w] - r['windowed'][w]:+.1f}; "
                 f"SQNR {r['sqnr'][w][0]:.1f} / {r['sqnr'][w][1]:.1f}" for w in windows]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    worst = {k: min(((res[f]["scheme"][w] - res[f][k][w], f, w) for f in fams for w in windows)) for k in ("twin", "windowed")}
    mean = {k: {w: sum(res[f]["scheme"][w] - res[f][k][w] for f in fams) / len(fams) for w in windows}
            for k in ("twin", "windowed")}
    lines += ["", "| twin | " + " | ".join(f"mean gap {w}" for w in windows) + " | worst gap |",
              "|---|" + "---|" * (len(windows) + 1)]
    for k, label in (("twin", "whole rollout's power (the evaluation's until this study)"),
                     ("windowed", "each window's power (the evaluation's since)")):
        g = worst[k]
        lines.append(f"| {label} | " + " | ".join(f"{mean[k][w]:+.2f}" for w in windows) + f" | {g[0]:+.1f} ({g[1]}, {g[2]}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--model", default="tinyworld", help="a conf/model preset with a shipped recipe (tinyworld, wanworld)")
    p.add_argument("--recipe", default=None, help="another recipe for the model (default: its shipped one)")
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    if args.frames < 17:
        print("twin_windows: --frames must be at least 17 (the first window is frames 0-16)", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        cfg, world, path, recipe = shipped_setup(args.model, args.recipe)
    except ValueError as err:
        print(f"twin_windows: {err}", file=sys.stderr)
        return 2
    trajs = make_trajectories(FIT_ORDER, "evaluation", len(FIT_ORDER), args.frames)
    res = measure(world, recipe, trajs, cfg.model.cache.window, cfg.model.cache.sink_frames)
    name = report_name("twin_windows", args.model)
    md = markdown(res, command_line("twin_windows", argv), (time.time() - t0) / 60, str(path))
    write_report(args.out, name, md, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
