"""Study: would motion-compensated prediction help the predictive code? (issue 28, item 3)

    python -m benchmarks.motion_study [--models tinyworld,wanworld] [--frames 64] [--out artifacts/benchmarks]

The predictive code predicts each token slot from the same slot of the previous frame. On a
moving camera, content moves across slots; a codec would predict a slot from the previous frame
at a displaced slot instead. This measures the most that could win, before any format change:
full-precision rollouts (held-out evaluation seeds, window 16 + 1 sink, the cache's pre-rotary
K and V read at the seam), and per layer, K/V, head and frame t (from frame 16 on), the energy of
three residuals over the frame's token grid (TinyWorld 4 x 4 tokens, WanWorld 8 x 8):

- ``intra``: x_t minus the head's mean (what transform coding alone codes);
- ``same slot``: x_t - x_{t-1} (the shipped prediction);
- ``best shift``: x_t - S x_{t-1}, S the whole-grid shift by (dy, dx) in [-R, R]^2 in steps of
  half a token (bilinear between the four whole-token shifts around it; R = 1 on 4 x 4, 2 on
  8 x 8) with the least residual, chosen per frame and head by the encoder (side information
  log2((4R+1)^2) bits per frame and head: under 0.003 bits per element); slots whose source
  falls outside the grid keep their own previous value.

Gains are ratios of residual energy summed over heads, layers and frames (dB): `same slot` over
`intra` is what prediction saves today, `best shift` over `same slot` what motion
compensation would add. The prediction is from the true previous frame, not a reconstruction,
so each gain is an upper bound for its code.
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime, timezone

import torch

from benchmarks.kv_stats import CPU, SINK, WINDOW, FrameRecorder, load_world, run_study
from calibrate.world.trajectories import make_trajectories

FAMILIES = ("pan", "orbit", "dolly", "random_walk", "static")
START = 16


def shifted(x_BHhwD: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """x moved by (dy, dx) slots; a slot whose source is outside the grid keeps its own value."""
    out = x_BHhwD.clone()
    h, w = x_BHhwD.shape[2:4]
    ys, yd = slice(max(0, -dy), min(h, h - dy)), slice(max(0, dy), min(h, h + dy))
    xs, xd = slice(max(0, -dx), min(w, w - dx)), slice(max(0, dx), min(w, w + dx))
    out[:, :, yd, xd] = x_BHhwD[:, :, ys, xs]
    return out


def moved(x_BHhwD: torch.Tensor, fy: float, fx: float) -> torch.Tensor:
    """x moved by a fractional (fy, fx): bilinear between the whole-token shifts around it."""
    iy, ix = math.floor(fy), math.floor(fx)
    ay, ax = fy - iy, fx - ix
    out = torch.zeros_like(x_BHhwD)
    for dy, wy in ((iy, 1 - ay), (iy + 1, ay)):
        for dx, wx in ((ix, 1 - ax), (ix + 1, ax)):
            if wy * wx:
                out += wy * wx * shifted(x_BHhwD, dy, dx)
    return out


def residuals(seq: list[torch.Tensor], side: int, reach: int) -> dict[str, float]:
    """Residual energies of one layer's K or V over frames START..: [B, H, T, D] per frame."""
    x = torch.stack(seq, 2).double()  # [B, H, F, T, D]
    B, H, F, T, D = x.shape
    mean = x[:, :, START:].mean(dim=(2, 3), keepdim=True)
    grid = x.reshape(B, H, F, side, side, D)
    halves = [h / 2 for h in range(-2 * reach, 2 * reach + 1)]
    shifts = [(dy, dx) for dy in halves for dx in halves]
    out = {"intra": 0.0, "same slot": 0.0, "best shift": 0.0, "moved": 0}
    for f in range(max(START, 1), F):
        cur, prev = grid[:, :, f], grid[:, :, f - 1]
        out["intra"] += float((x[:, :, f] - mean[:, :, 0]).pow(2).sum())
        per = torch.stack([(cur - moved(prev, dy, dx)).pow(2).sum(dim=(2, 3, 4)) for dy, dx in shifts])  # [S, B, H]
        out["same slot"] += float(per[shifts.index((0, 0))].sum())
        best = per.min(0)
        out["best shift"] += float(best.values.sum())
        out["moved"] += int((best.indices != shifts.index((0, 0))).sum())
    out["decisions"] = B * H * (F - max(START, 1))
    return out


def db(a: float, b: float) -> float:
    return 10 * math.log10(a / b) if b > 0 else float("inf")


def measure(name: str, frames: int, trajectories: int) -> dict:
    world = load_world(name)
    T = world.info.tokens_per_frame
    side = math.isqrt(T)
    if side * side != T:
        raise ValueError(f"{name}: {T} tokens per frame is not a square grid")
    reach = 1 if side <= 4 else 2
    rows = {}
    for family in FAMILIES:
        trajs = make_trajectories([family], "evaluation", trajectories, frames)
        rec = FrameRecorder(world.info.num_layers, WINDOW, SINK)
        world.rollout(trajs, rec, CPU, keep_frames=False)
        for kv in "kv":
            tot = {}
            for layer in range(world.info.num_layers):
                for key, val in residuals(rec.frames[(layer, kv)], side, reach).items():
                    tot[key] = tot.get(key, 0) + val
            rows[f"{family} {kv.upper()}"] = {
                "family": family, "kv": kv.upper(), **tot,
                "prediction_gain_db": db(tot["intra"], tot["same slot"]),
                "motion_gain_db": db(tot["same slot"], tot["best shift"]),
                "moved_share": tot["moved"] / tot["decisions"]}
    return {"model": name, "grid": f"{side} x {side}", "reach": reach, "rows": rows}


def markdown(results: list[dict], command: str, minutes: float, frames: int, trajectories: int) -> str:
    lines = ["# Motion-compensated prediction: the most it could win", "",
             f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; command: `{command}`",
             f"- {minutes:.1f} min, 1 torch thread ({torch.get_num_threads()} here), the CPU shared with other jobs",
             f"- held-out evaluation seeds, {trajectories} trajectories x {frames} frames per family, frames {START} on; "
             "the method is in the module docstring of `benchmarks/motion_study.py`", "",
             "Residual energy ratios in dB (all layers and heads): *prediction* = intra over same slot (what the "
             "shipped prediction saves), *motion* = same slot over best shift (what motion compensation in half-token steps "
             "would add on top); *moved* = share of (frame, head) decisions whose best shift is not (0, 0).", ""]
    for res in results:
        lines += [f"## {res['model']} ({res['grid']} tokens, shifts up to {res['reach']})", "",
                  "| family | K prediction dB | K motion dB | K moved | V prediction dB | V motion dB | V moved |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for family in FAMILIES:
            k, v = res["rows"][f"{family} K"], res["rows"][f"{family} V"]
            lines.append(f"| {family} | {k['prediction_gain_db']:.2f} | {k['motion_gain_db']:.2f} | {k['moved_share']:.0%} "
                         f"| {v['prediction_gain_db']:.2f} | {v['motion_gain_db']:.2f} | {v['moved_share']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tinyworld,wanworld")
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--trajectories", type=int, default=2)
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    return run_study("motion_study", argv, args.models, args.frames, START, args.out,
                     lambda name: measure(name, args.frames, args.trajectories),
                     lambda results, command, minutes: markdown(results, command, minutes, args.frames,
                                                                args.trajectories))


if __name__ == "__main__":
    sys.exit(main())
