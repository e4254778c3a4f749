"""Study: a sink hold whose reference is refreshed every P frames (a golden frame), bits counted.

    python -m benchmarks.refresh_study [--frames 256] [--variants 0,16,8L,8La8] [--recipe PATH] [--name NAME]

Writes `refresh_study.md` + `.json` (or `<NAME>.md`). The sink hold (format 1.4) lets a token's
uncoded components take the sink frame's values. On a still camera that is the right idea with
the wrong frame: the scene drifts slowly away from frame 0 (on TinyWorld's held-out still camera
the uncoded part of a key moves ~100% of its energy away from frame 0's over 256 frames, 2-4%
over any 16 frames, 0.0% from one frame to the next), so only ~44% of its tokens still choose the
sink's values late and most of its stored error stays in the uncoded components (82-94% of it in
layers 0-1). Video codecs keep a long-term reference for the same reason and refresh it (VP8's
golden frame, H.264's long-term pictures).

The variants, rolled out through `coherence_study.FakePredictiveCache` (the predictive code as the
runtime reconstructs it) next to their noise twins: frame f's hold takes its uncoded components
from the *reference* frame P * floor(f / P), frame 0 being the sink; each reference frame f > 0
stores its uncoded components in the sink code (the sink's step and widths) besides its own code.
The chain, its states and the hold rule are the format's (quant/predictive.sink_hold); only the
source of g changes. Variant `0` is the rule before format 1.5 (the sink for every frame); `PxM`
codes the reference frames on M times the sink's step (fewer bits, as wide as the sink's reach
needs there); a trailing `L` holds one reference, the latest: every held token in the cache, of
any frame, takes the latest reference's components (its hold bit was still chosen against the
reference of its time). `8L` is what format 1.5 made of it (`fit.sink_refresh=8`). A trailing
`aA` codes the reference from the mean of the last A frames (the refresh frame and the A - 1 before
it) instead of the refresh frame alone: a reference nearer a moving scene's recent average, which
the decoder reads as it reads any other (the same bits; an encoder would keep a running sum).

Bits: a frame in a window of W needs its reference while it is kept, so up to ceil((W - 1) / P) + 1
refresh codes are held besides the sink (2 for P >= W; 1 with `L`), each of sum_{b_i = 0} z_i bits
per token and head (z: the sink widths); the report adds their largest count over the steady state
to the recipe's own bits per element (memory.bits_per_element; less its own reference's, for a
recipe that already has one: format 1.5, where memory.py counts them in whole bytes per token, so
the sum may differ from the recipe's in the third decimal). `--recipe` rolls out another
recipe, e.g. one fitted at a lower budget so that the total stays within 2.5 bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time

import torch

from benchmarks import command_line, sink_code_setup, write_report
from benchmarks.coherence_study import FakePredictiveCache, roll_variant
from benchmarks.sink_hold_study import FIT_ORDER, variant_table
from calibrate import memory
from calibrate.cache import kept_frames
from calibrate.predictive_roles import head_params
from calibrate.quant import predictive as P
from calibrate.world.trajectories import make_trajectories


class RefreshCoder:
    """One head's predictive code (its `HeadCoder`'s parameters): frame 0 in the sink code, later
    frames as quant/predictive.encode codes them, with the sink hold against the latest reference
    frame (every `period` frames; 0: the sink only)."""

    def __init__(self, coder, period: int, step_mult: int = 1, average: int = 1):
        self.p, self.period, self.frame = coder.p, period, 0
        self.coarse = refresh_params(coder.p, step_mult)
        self.average, self.last = average, []  # the reference codes the mean of the last `average` frames

    def code(self, x: torch.Tensor) -> torch.Tensor:
        base, hold = self.code_parts(x)
        return base if hold is None else P.held_values(base, hold, self.h)

    def code_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the frame's values without the hold, its hold bits [B, T]; None for the sink frame)."""
        p, f = self.p, self.frame
        self.frame += 1
        self.last = (self.last + [x.float()])[-self.average:]
        if f == 0:
            self.w = P.sink_code(x, p)
            self.v, self.h = P.sink_states(self.w, p), P.sink_hold_part(self.w, p)
            return P.sink_values(self.w, p), None
        if self.period and f % self.period == 0:  # a reference frame: its uncoded part in the sink code
            w = P.sink_code(torch.stack(self.last).mean(0), self.coarse)  # on the refresh grid: m times the sink's step
            self.w = w * (self.coarse.sink_unit_D / p.sink_unit_D).round().long()
            self.h = P.sink_hold_part(self.w, p)
        _, _, self.v = P.encode(x, p, self.v)
        return P.values(self.v, p), P.sink_hold(x, self.w, p)


def refresh_params(p: P.PredictiveParams, step_mult: int) -> P.PredictiveParams:
    """The refresh code's parameters: the sink code on a step `step_mult` times the sink's, as wide
    as the sink's reach needs there: one bit less per doubling (at least 2), `step_mult` a power of 2."""
    widths = (p.sink_bits_D - int(math.log2(step_mult))).clamp_min(2)  # one bit less per doubling
    widths = torch.where(p.sink_bits_D > 0, widths, 0)
    return dataclasses.replace(p, sink_unit_D=p.sink_unit_D * step_mult, sink_bits_D=widths)


class LatestReferenceCache(FakePredictiveCache):
    """The refresh held once: every held token in the cache takes its uncoded components from the
    *latest* reference (the encoder still chose its hold bit against the reference of its time), so
    a frame's values change when the reference does. Frames are stored without the hold, the hold
    bits beside them, and valued at read."""

    def append(self, layer, k_BHTD, v_BHTD, key_rope) -> int:
        parts = [[c.code_parts(x[:, h]) for h, c in enumerate(self.coders[layer][kv])]
                 for kv, x in (("k", k_BHTD), ("v", v_BHTD))]
        index = self._num_appended[layer]
        self._frames[layer][index] = (parts, key_rope)
        self._num_appended[layer] = index + 1
        keep = set(kept_frames(index + 1, self.window, self.sink_frames))
        for old in [f for f in self._frames[layer] if f not in keep]:
            del self._frames[layer][old]
        return index

    def _load(self, layer, index, stored):
        parts, key_rope = stored
        k, v = (torch.stack([base if hold is None else P.held_values(base, hold, c.h)
                             for (base, hold), c in zip(parts[i], self.coders[layer][kv])], 1)
                for i, kv in enumerate("kv"))
        return key_rope.apply(k), v


def refresh_cache(recipe, window: int, sinks: int, period: int, step_mult: int = 1,
                  latest: bool = False, average: int = 1) -> FakePredictiveCache:
    cache = (LatestReferenceCache if latest else FakePredictiveCache)(recipe, window, sinks)
    for layer in cache.coders:
        for kv in "kv":
            layer[kv] = [RefreshCoder(c, period, step_mult, average) for c in layer[kv]]
    return cache


def references_held(period: int, window: int, latest: bool = False) -> int:
    """Refresh codes a window of `window` frames needs at most besides the sink: the distinct
    floor(f / period) over `window` consecutive frames (0 without refresh; 1 with `latest`)."""
    return 0 if period == 0 else 1 if latest else math.ceil((window - 1) / period) + 1


def refresh_bits(recipe, info, period: int, window: int, sinks: int, step_mult: int = 1, latest: bool = False) -> float:
    """Bits per cached element the held refresh codes add: references_held x the mean over
    tensors and heads of sum_{b_i = 0} z_i / D, over the window's and sinks' frames."""
    per_head = []
    for layer in range(info.num_layers):
        for kv in "kv":
            tensors = recipe.layer_tensors(layer, kv)
            for h in range(info.num_kv_heads):
                p = refresh_params(head_params(tensors, h), step_mult)
                per_head.append(float(p.sink_bits_D[p.bits_D == 0].sum()) / p.bits_D.numel())
    return references_held(period, window, latest) * sum(per_head) / len(per_head) / (window + sinks)


def markdown(results: dict, bits: dict, command: str, minutes: float, frames: int, recipe: str, window: int) -> str:
    lines = ["# A sink hold whose reference is refreshed every P frames (golden frame)", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}). "
             f"`{recipe}`, {frames} frames, window {window}; the method and the bit count are in "
             "`benchmarks/refresh_study.py`'s docstring. P: the refresh period (0: the shipped rule, the sink "
             "frame is every frame's reference); x M: the refresh code on M times the sink's step; L: one "
             "reference held, the latest; a A: the reference codes the mean of the last A frames.", ""]
    extra = {name: f"{b['recipe']:.3f} + {b['refresh']:.3f} = {b['recipe'] + b['refresh']:.3f}" for name, b in bits.items()}
    return "\n".join(lines + variant_table(results, frames, "P x M", extra) + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--variants", default="0,8,16,32,16x2,16x4",
                   help="comma-separated P[xM][L][aA]: refresh every P frames (0: the shipped rule) on M times the "
                        "sink's step; L: one reference held, the latest; aA: the reference codes the mean of the last A "
                        "frames")
    p.add_argument("--recipe", default=None, help="a TinyWorld recipe with a sink code (default: the shipped one)")
    p.add_argument("--name", default="refresh_study")
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    variants = {v: re.fullmatch(r"(\d+)(?:x(\d+))?(L?)(?:a(\d+))?", v) for v in args.variants.split(",")}
    variants = {v: m and (int(m[1]), int(m[2] or 1), m[3] == "L", int(m[4] or 1)) for v, m in variants.items()}
    if any(not v or v[1] < 1 or v[1] & (v[1] - 1) or v[3] < 1 for v in variants.values()):
        print(f"refresh_study: --variants must be P[xM][L][aA] (integers, M a power of 2, A >= 1), got {args.variants!r}",
              file=sys.stderr)
        return 2
    t0 = time.time()
    device = torch.device("cpu")
    try:
        cfg, world, path, recipe = sink_code_setup("tinyworld", args.recipe, "to refresh")
    except ValueError as err:
        print(f"refresh_study: {err}", file=sys.stderr)
        return 2
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    trajs = make_trajectories(FIT_ORDER, "evaluation", 7, args.frames)
    own = memory.bits_per_element(world.info, recipe.scheme, window, sinks)
    if any(getattr(spec, kind).sink_refresh for spec in recipe.scheme.layers for kind in "kv"):  # format 1.5: its own
        own -= refresh_bits(recipe, world.info, 1, window, sinks, latest=True)  # reference is the variants' to count
    results, bits = {}, {}
    for name, (period, mult, latest, average) in variants.items():
        results[name] = roll_variant(world, recipe, trajs, "nearest", 0, 1.0, window, sinks, device,
                                     make=lambda: refresh_cache(recipe, window, sinks, period, mult, latest, average))
        bits[name] = {"recipe": own, "refresh": refresh_bits(recipe, world.info, period, window, sinks, mult, latest)}
    md = markdown(results, bits, command_line("refresh_study", argv), (time.time() - t0) / 60, args.frames, str(path),
                  window)
    write_report(args.out, args.name, md, {"results": results, "bits": bits})
    return 0


if __name__ == "__main__":
    sys.exit(main())
