"""Study: which rule for taking a token's uncoded components from the sink frame pays.

    python -m benchmarks.sink_hold_study [--frames 256] [--model tinyworld] [--variants none,token,...]

Writes `sink_hold_study.md` + `.json` (`sink_hold_study_<model>` for another model than
TinyWorld). A component the recipe gives 0 bits decodes to the mean in every frame. The sink code
(format 1.3) stores every component of frame 0, so a decoder could take a token's uncoded
components from the sink frame's same token instead. Which rule, rolled out through
`coherence_study.FakePredictiveCache` (the predictive code as the runtime reconstructs it) with the
model's shipped recipe, frame 0 in its sink code, next to each variant's noise twin:

- `none`: the uncoded components at the mean (the code before format 1.4);
- `every`: every token of every later frame takes the sink's (no bits);
- `frame`: one choice per frame and head, the sink's where that lowers the frame's stored error
  (a bit per frame and head, not counted);
- `token`: one choice per token, the sink's where its uncoded part is nearer the sink's than the
  mean: the format's sink hold (quant/predictive.sink_hold, one bit per token and head, not
  counted here; `sink_hold.md` refits with them counted);
- `carried`: no bits: the sink frame's tokens hold, an inter token keeps its predecessor's hold,
  an intra token drops it, and the mode choice counts the uncoded components' error of each mode.

The held-out rollouts are `fit.md`'s (evaluation seeds, one trajectory per family).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import command_line, report_name, sink_code_setup, window_note, write_report
from benchmarks.coherence_study import FakePredictiveCache, roll_variant
from calibrate.quant import predictive as P
from calibrate.world.trajectories import make_trajectories

FIT_ORDER = ["orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static"]  # conf/trajectories: fit.md's set
VARIANTS = ("none", "every", "frame", "token", "carried")


class SinkRuleCoder:
    """One head's predictive code (its `HeadCoder`'s parameters), frame 0 in the sink code, later
    frames coded as quant/predictive.encode does, their uncoded components by `rule`."""

    def __init__(self, coder, rule: str):
        self.p, self.rule, self.frame = coder.p, rule, 0

    def code(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        uncoded = (p.bits_D == 0).float()
        if self.frame == 0:
            w = P.sink_code(x, p)
            self.v, self.w, self.h = P.sink_states(w, p), w, P.sink_hold_part(w, p)  # h: the sink's uncoded part
            self.s = (p.sink_unit_D * w.float()) / p.unit_D * uncoded  # ... in units
            self.hold = torch.ones(x.shape[:-1] + (1,), dtype=torch.bool)
            self.frame += 1
            return P.sink_values(w, p)
        self.frame += 1
        if self.rule != "carried":
            _, _, self.v = P.encode(x, p, self.v)
            out = P.values(self.v, p)
            if self.rule == "none":
                return out
            if self.rule == "token":
                return P.held_values(out, P.sink_hold(x, self.w, p), self.h)
            held = out + self.h
            if self.rule == "frame" and float((held - x).pow(2).sum()) >= float((out - x).pow(2).sum()):
                return out
            return held
        tau, w2 = P.to_units(x, p), p.unit_D**2
        (_, v_i), (_, v_p) = P.intra(tau, p), P.inter(tau, self.v, p)
        coded = 1 - uncoded
        e_i = (((tau - v_i.float()) ** 2 * coded + tau**2 * uncoded) * w2).sum(-1, keepdim=True)
        e_p = (((tau - v_p.float()) ** 2 * coded + (tau - self.hold * self.s) ** 2 * uncoded) * w2).sum(-1, keepdim=True)
        inter = e_p <= e_i
        self.v, self.hold = torch.where(inter, v_p, v_i), self.hold & inter
        return (p.unit_D * (self.v.float() + self.hold * self.s)) @ p.rotation_DD.T + p.mean_D


def rule_cache(recipe, window: int, sinks: int, rule: str) -> FakePredictiveCache:
    cache = FakePredictiveCache(recipe, window, sinks)
    for layer in cache.coders:
        for kv in "kv":
            layer[kv] = [SinkRuleCoder(c, rule) for c in layer[kv]]
    return cache


def variant_table(results: dict, frames: int, first: str = "variant", extra: dict | None = None) -> list[str]:
    """The studies' table (this one's and refresh_study's): per variant (`results`: name -> family ->
    `roll_variant`'s row) its PSNR on the last window / its twin's, SQNR per family, the mean of each
    window and the flicker; `extra` {name: cell} adds a column after the first."""
    fams = list(next(iter(results.values())))
    windows = list(next(iter(results.values()))[fams[0]]["scheme"])
    late = windows[-1]
    head = [first] + (["bits (recipe + refresh)"] if extra else []) + fams + ["mean"] + [f"mean {w}" for w in windows[:-1]]
    lines = [f"PSNR vs the fp rollout, frames {late}{window_note(late, frames)}: variant / its noise twin; "
             "SQNR = stored K / V dB, mean over layers.", "", "| " + " | ".join(head + ["flicker"]) + " |",
             "|" + "---|" * (len(head) + 1)]
    for name, res in results.items():
        cells = [f"{res[f]['scheme'][late]:.1f} / {res[f]['twin'][late]:.1f}; SQNR {res[f]['sqnr_k']:.1f} / "
                 f"{res[f]['sqnr_v']:.1f}" for f in fams]
        means = [sum(res[f]["scheme"][w] for f in fams) / len(fams) for w in windows]
        flick = sum(res[f]["flicker"] for f in fams) / len(fams)
        lines.append(f"| {name} | " + (f"{extra[name]} | " if extra else "") + " | ".join(cells) +
                     f" | {means[-1]:.2f} | " + " | ".join(f"{m:.2f}" for m in means[:-1]) + f" | {flick:.5f} |")
    return lines


def markdown(results: dict, command: str, minutes: float, frames: int, recipe: str) -> str:
    lines = ["# Taking uncoded components from the sink frame: which rule pays", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}). "
             f"`{recipe}`, {frames} frames, the variants in `benchmarks/sink_hold_study.py`'s docstring; bits of "
             "the choices not counted.", ""]
    return "\n".join(lines + variant_table(results, frames) + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--model", default="tinyworld", help="a conf/model preset with a shipped recipe (tinyworld, wanworld)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"sink_hold_study: unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    t0 = time.time()
    device = torch.device("cpu")
    try:
        cfg, world, path, recipe = sink_code_setup(args.model, None, "to take values from")
    except ValueError as err:
        print(f"sink_hold_study: {err}", file=sys.stderr)
        return 2
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    trajs = make_trajectories(FIT_ORDER, "evaluation", 7, args.frames)
    results = {v: roll_variant(world, recipe, trajs, "nearest", 0, 1.0, window, sinks, device,
                               make=lambda v=v: rule_cache(recipe, window, sinks, v)) for v in variants}
    name = report_name("sink_hold_study", args.model)
    md = markdown(results, command_line("sink_hold_study", argv), (time.time() - t0) / 60, args.frames, str(path))
    write_report(args.out, name, md, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
