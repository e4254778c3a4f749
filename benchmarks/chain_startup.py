"""Study: how a predictive chain's error evolves over the first frames after the sink.

    python -m benchmarks.chain_startup [--frames 64] [--model tinyworld] [--families orbit,pan,...]

Writes `chain_startup.md` + `.json` (`chain_startup_<model>` for another model than TinyWorld).
The noise-twin study (`twin_windows.md`) found the shipped recipe's stored error 8-10 dB larger
on frames 0-16 than later. This study resolves it frame by frame: the model's fp rollout of one
held-out trajectory per family, each layer's K (pre-rotary) and V coded as the predictive code
reconstructs them (`quant/predictive.fake_quant_sequence`: frame 0 in the sink code, every later
frame against the previous one's states; the sink hold and its refresh are left out, which
changes the uncoded components only), and per frame f the stored error energy, the centred
signal energy (about the code's mean) and the change energy (the fp K/V of frame f minus frame
f - 1), each over the same quantity's mean on the last quarter of the frames, summed over heads,
layers, K and V. A chain that settles slowly shows error far above 1 on its first frames while
the signal and its change stay near 1; error that follows the change says the content moved more
then (on TinyWorld's orbit the rollout stops following the camera after ~16-32 frames:
rollout_motion.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import command_line, report_name, shipped_setup, write_report
from benchmarks.kv_stats import FrameRecorder
from calibrate.predictive_roles import head_params
from calibrate.quant import predictive as P
from calibrate.replay import rollout_batch
from calibrate.world.trajectories import make_trajectories

SHOWN = (0, 1, 2, 4, 8, 12, 15, 16, 17, 20, 24, 32, 48)


def per_frame(world, recipe, family: str, frames: int, window: int, sinks: int) -> dict:
    """{"err": [...], "sig": [...], "chg": [...]}: per frame, summed over layers, K/V and heads, over the mean of
    its last quarter (chg of frame 0: 0, it has no predecessor)."""
    rec = FrameRecorder(world.info.num_layers, window, sinks)
    rollout_batch(world, make_trajectories([family], "evaluation", 1, frames), rec, torch.device("cpu"), keep_frames=False)
    n = len(next(iter(rec.frames.values())))  # frames whose K/V the model wrote (the last one's are never needed)
    err = torch.zeros(n, dtype=torch.float64)
    sig = torch.zeros(n, dtype=torch.float64)
    chg = torch.zeros(n, dtype=torch.float64)
    for (layer, kv), xs in rec.frames.items():
        x = torch.stack(xs, 2)[0]  # [H, F, T, D]
        tensors = recipe.layer_tensors(layer, kv)
        for h in range(x.shape[0]):
            p, xh = head_params(tensors, h), x[h:h + 1]
            e = P.fake_quant_sequence(xh, p, sink_frames=sinks) - xh
            err += e[0].double().pow(2).sum((-2, -1))
            sig += (xh[0] - p.mean_D).double().pow(2).sum((-2, -1))
            chg[1:] += (xh[0, 1:] - xh[0, :-1]).double().pow(2).sum((-2, -1))
    tail = slice(n - n // 4, n)
    return {key: (v / v[tail].mean()).tolist() for key, v in (("err", err), ("sig", sig), ("chg", chg))}


def markdown(res: dict, command: str, minutes: float, recipe: str) -> str:
    n = len(next(iter(res.values()))["err"])
    shown = [f for f in SHOWN if f < n]
    lines = ["# A predictive chain's first frames: stored error and signal, frame by frame", "",
             f"Command: `{command}`, {minutes:.1f} min (torch threads {torch.get_num_threads()}). `{recipe}`; the method "
             "is in `benchmarks/chain_startup.py`'s docstring. Per family: the stored error energy of frame f over its "
             f"mean on frames {n - n // 4}-{n} (err), and the same for the centred signal (sig) and for the fp "
             "K/V's change from the frame before (chg); frame 0 is the sink.", "",
             "| family | | " + " | ".join(f"f{f}" for f in shown) + " |", "|---|---|" + "---|" * len(shown)]
    for fam, r in res.items():
        for key in ("err", "sig", "chg"):
            lines.append(f"| {fam if key == 'err' else ''} | {key} | " + " | ".join(f"{r[key][f]:.3g}" for f in shown) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--model", default="tinyworld", help="a conf/model preset with a shipped recipe (tinyworld, wanworld)")
    p.add_argument("--families", default="orbit,dolly,pan,revisit,random_walk,stress,static")
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    if args.frames < 8:
        print("chain_startup: --frames must be at least 8", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        cfg, world, path, recipe = shipped_setup(args.model)
        families = [f for f in args.families.split(",") if f]
        make_trajectories(families, "evaluation", len(families), 2)  # an unknown family: one line
    except ValueError as err:
        print(f"chain_startup: {err}", file=sys.stderr)
        return 2
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    res = {f: per_frame(world, recipe, f, args.frames, window, sinks) for f in families}
    name = report_name("chain_startup", args.model)
    md = markdown(res, command_line("chain_startup", argv), (time.time() - t0) / 60, str(path))
    write_report(args.out, name, md, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
