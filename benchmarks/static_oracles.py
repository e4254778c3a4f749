"""Study: which part of the shipped recipe's error keeps the still camera low, by oracles.

    python -m benchmarks.static_oracles [--frames 256] [--out artifacts/benchmarks] [--recipe PATH]
                                        [--oracle NAME ...] [--model tinyworld]

Writes `static_oracles.md` + `.json` (`static_oracles_<model>` for another model than TinyWorld,
`static_oracles_<recipe stem>` with `--recipe`, any predictive recipe of the model, e.g. a refit at
a higher `fit.budget_bits`). Each oracle makes one part of the recipe's code exact (or refreshes
it) in `coherence_study.FakePredictiveCache` (the float cache that reconstructs every frame as the
predictive code does) and rolls it out next to its noise twin (evaluate/twin.py):

- `uncoded exact`: the components the recipe gives 0 bits (the weakest PCA directions, held at
  the mean by the code) take their true value in every frame, K and V; the coded ones as shipped;
- `uncoded held 8`: the same components take their true value only every 8th frame (component i
  at frames f with (i + f) % 8 = 0, staggered) and hold it in between: what a code that refreshes
  them now and then, instead of never, could reach if its refresh were exact;
- `K exact`, `V exact`: one tensor stored exactly in every layer;
- `V exact, uncoded K held 8`: both at once;
- `uncoded refreshed P x r`: a code one could build, bits counted: every P frames (staggered as
  above) each uncoded component is coded with r bits, 2^r uniform mid-rise levels over +-3 sigma,
  and held in between. Sigma is the component's standard deviation over the first frame's tokens
  of each rollout (the study's shortcut: a format would store a range per component from
  calibration). "+ bits" = the added bits per element, r / P per uncoded component;
- `round robin m x r (P)`: the same as a format would code it (the design the numbers above argue
  for): every frame refreshes the same m = ceil(|U| / P) of a head's uncoded components U, in turn
  (component U[(f m + j) mod |U|], j < m, at frame f), so each frame costs the same m r bits per
  token; the others hold their last refreshed value whatever the token's mode (0, the mean, before
  their first refresh). Sigma per component comes from calibration rollouts (one per family of
  `FAMILIES`, calibration seeds, 64 frames, the recipe's own code), not from the held-out ones.

The exact oracles do not count the bits their exact values would cost: they bound what coding
that part better can earn. Two held-out trajectory sets: `fit.md`'s (evaluation seeds 0-6, one
trajectory per family; issue 28's targets are measured there) and `coherence_study.md`'s (seeds
0-3: static, pan, orbit, dolly), each cut to the families static, pan, orbit and dolly.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks import command_line, report_name, shipped_setup, window_note, write_report
from benchmarks.coherence_study import FakePredictiveCache, roll_variant
from calibrate.replay import rollout_batch
from calibrate.world.trajectories import make_trajectories

FAMILIES = ("static", "pan", "orbit", "dolly")
FIT_ORDER = ["orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static"]  # conf/trajectories: fit.md's set
EXACT_DB = 200.0  # a stored SQNR above this is an exact tensor (float rounding only)
REFRESH_SPREAD = 3.0  # a refresh's levels cover +- this many standard deviations
CALIBRATION_FRAMES = 64  # frames of each calibration rollout that sigma of the round robin comes from
ORACLES = {"shipped": {}, "uncoded exact": {"k": 1, "v": 1}, "uncoded held 8": {"k": 8, "v": 8},
           "K exact": {"k": "exact"}, "V exact": {"v": "exact"}, "V exact, uncoded K held 8": {"k": 8, "v": "exact"},
           **{f"uncoded refreshed {P} x {r}": {"k": (P, r), "v": (P, r)} for P, r in ((8, 4), (16, 4), (32, 4), (32, 3))},
           **{f"round robin m x {r} ({P})": {"k": ("rr", P, r), "v": ("rr", P, r)} for P, r in ((16, 4), (32, 4), (32, 3))}}


class OracleCoder:
    """A `coherence_study.HeadCoder` with one part made exact: `mode` "exact" (every component),
    P >= 1 (the 0-bit components take their true value every P frames, staggered, and hold it) or
    (P, r) (the same with the value coded by r bits, `refreshed`)."""

    def __init__(self, coder, mode, sigma: torch.Tensor | None = None):
        self.coder, self.frame, self.held, self.sigma = coder, 0, None, sigma
        self.round_robin = isinstance(mode, tuple) and mode[0] == "rr"
        self.mode, self.bits = mode[-2:] if isinstance(mode, tuple) else (mode, None)

    def code(self, x_BTD: torch.Tensor) -> torch.Tensor:
        out = self.coder.code(x_BTD)
        if self.mode == "exact":
            return x_BTD.float()
        c, p = self.coder, self.coder.p
        tau = c.units(x_BTD)
        if self.bits is not None:
            if self.sigma is None:
                self.sigma = tau.flatten(0, -2).std(0)
            tau = refreshed(tau, self.sigma, self.bits)
        if self.round_robin:
            due = round_robin_due(p.bits_D == 0, self.mode, self.frame)
            self.held = torch.where(due, tau, 0.0 if self.held is None else self.held)
        else:
            due = (torch.arange(tau.shape[-1]) + self.frame) % self.mode == 0
            self.held = tau if self.held is None else torch.where(due, tau, self.held)
        self.frame += 1
        x = torch.where(p.bits_D == 0, self.held, c.x.float())
        return (c.unit * x) @ p.rotation_DD.T + p.mean_D


def refreshed(tau: torch.Tensor, sigma: torch.Tensor, bits: int) -> torch.Tensor:
    """tau on 2^bits uniform mid-rise levels over +- REFRESH_SPREAD sigma (the outer ones take the tails)."""
    n = 2**bits
    step = (2 * REFRESH_SPREAD * sigma).clamp_min(1e-12) / n
    return (torch.floor(tau / step).clamp(-n // 2, n // 2 - 1) + 0.5) * step


def round_robin_due(uncoded_D: torch.Tensor, period: int, frame: int) -> torch.Tensor:
    """[D] bool: the m = ceil(|U| / period) uncoded components U[(frame m + j) mod |U|], j < m,
    that frame `frame` refreshes (U in component order)."""
    U = uncoded_D.nonzero().flatten()
    due = torch.zeros_like(uncoded_D)
    if len(U):
        m = -(-len(U) // period)
        due[U[(frame * m + torch.arange(m)) % len(U)]] = True
    return due


def added_bits(recipe, modes: dict) -> float:
    """Bits per element a refresh adds: r / P per 0-bit component (round robin: m r per head and
    token, m = ceil(|U| / P)) of the tensors it codes."""
    added = total = 0.0
    for layer in range(recipe.model.num_layers):
        for kv in "kv":
            bits = recipe.layer_tensors(layer, kv)["channel_bits"]  # [H, D]
            total += bits.numel()
            mode = modes.get(kv)
            if isinstance(mode, tuple) and mode[0] == "rr":
                _, P, r = mode
                added += sum(-(-int(u) // P) * r for u in (bits == 0).sum(-1))
            elif isinstance(mode, tuple):
                P, r = mode
                added += int((bits == 0).sum()) * r / P
    return added / total


class SigmaRecorder:
    """Wraps a head's coder: codes as it does and sums tau and tau^2 per component (recipe units)."""

    def __init__(self, coder):
        self.coder, self.n, self.s1, self.s2 = coder, 0, 0.0, 0.0

    def code(self, x_BTD: torch.Tensor) -> torch.Tensor:
        tau = self.coder.units(x_BTD).flatten(0, -2).double()
        self.n, self.s1, self.s2 = self.n + len(tau), self.s1 + tau.sum(0), self.s2 + (tau * tau).sum(0)
        return self.coder.code(x_BTD)

    def sigma(self) -> torch.Tensor:
        mean = self.s1 / self.n
        return (self.s2 / self.n - mean * mean).clamp_min(0).sqrt().float()


def calibration_sigma(world, recipe, window: int, sinks: int, device) -> list[dict[str, list[torch.Tensor]]]:
    """Per layer, tensor and head: sigma [D] of tau over calibration rollouts (the recipe's code)."""
    cache = FakePredictiveCache(recipe, window, sinks)
    for layer in cache.coders:
        for kv in "kv":
            layer[kv] = [SigmaRecorder(c) for c in layer[kv]]
    rollout_batch(world, make_trajectories(FAMILIES, "calibration", len(FAMILIES), CALIBRATION_FRAMES), cache, device)
    return [{kv: [r.sigma() for r in layer[kv]] for kv in "kv"} for layer in cache.coders]


def oracle_cache(recipe, window: int, sinks: int, modes: dict, sigma=None) -> FakePredictiveCache:
    cache = FakePredictiveCache(recipe, window, sinks)
    for i, layer in enumerate(cache.coders):
        for kv, mode in modes.items():
            rr = isinstance(mode, tuple) and mode[0] == "rr"
            layer[kv] = [OracleCoder(c, mode, sigma[i][kv][h] if rr else None) for h, c in enumerate(layer[kv])]
    return cache


def markdown(results: dict, bits: dict, command: str, minutes: float, frames: int, recipe: str) -> str:
    lines = ["# Oracles: which part of a recipe's error keeps the still camera low, and a refresh that pays", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}). "
             f"`{recipe}`, {frames} frames; the oracles and trajectory sets are in the module docstring of "
             "`benchmarks/static_oracles.py`. The exact oracles do not count the bits their exact values would "
             "cost; the refreshes do (+ bits per element).", ""]
    for set_name, rows in results.items():
        fams = list(next(iter(rows.values())))
        late = list(next(iter(rows.values()))[fams[0]]["scheme"])[-1]
        lines += [f"## {set_name}", "", f"PSNR vs the fp rollout, frames {late}{window_note(late, frames)}: "
                  "oracle / its noise twin; "
                  "SQNR = stored K / V dB, mean over layers.", "",
                  "| oracle | + bits | " + " | ".join(fams) + " | mean | flicker |", "|---|---|" + "---|" * (len(fams) + 2)]
        for name, res in rows.items():
            db = lambda x: "exact" if x > EXACT_DB else f"{x:.1f}"
            cells = [f"{res[f]['scheme'][late]:.1f} / {res[f]['twin'][late]:.1f}; SQNR {db(res[f]['sqnr_k'])} / "
                     f"{db(res[f]['sqnr_v'])}" for f in fams]
            mean = sum(res[f]["scheme"][late] for f in fams) / len(fams)
            flick = sum(res[f]["flicker"] for f in fams) / len(fams)
            added = f"{bits[name]:.3f}" if bits[name] else "-"
            lines.append(f"| {name} | {added} | " + " | ".join(cells) + f" | {mean:.2f} | {flick:.5f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--model", default="tinyworld", help="a conf/model preset with a shipped recipe (tinyworld, wanworld)")
    p.add_argument("--recipe", default=None, help="a predictive recipe of the model (default: the shipped one)")
    p.add_argument("--oracle", action="append", default=None, help="an oracle to run, repeatable (default: all)")
    args = p.parse_args(argv)
    unknown = [name for name in args.oracle or [] if name not in ORACLES]
    if unknown:
        print(f"static_oracles: unknown --oracle {unknown[0]!r}; known: {'; '.join(ORACLES)}", file=sys.stderr)
        return 2
    oracles = {name: ORACLES[name] for name in args.oracle or ORACLES}
    t0 = time.time()
    device = torch.device("cpu")
    try:
        cfg, world, path, recipe = shipped_setup(args.model, args.recipe, device)
    except ValueError as err:
        print(f"static_oracles: {err}", file=sys.stderr)
        return 2
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    sigma = calibration_sigma(world, recipe, window, sinks, device)
    sets = {"fit.md's trajectories (evaluation seeds 0-6)":
            [t for t in make_trajectories(FIT_ORDER, "evaluation", 7, args.frames) if t.family in FAMILIES],
            "coherence_study.md's trajectories (evaluation seeds 0-3)":
            make_trajectories(list(FAMILIES), "evaluation", 4, args.frames)}
    results = {name: {oracle: roll_variant(world, recipe, trajs, "nearest", 0, 1.0, window, sinks, device,
                                           make=lambda m=modes: oracle_cache(recipe, window, sinks, m, sigma))
                      for oracle, modes in oracles.items()}
               for name, trajs in sets.items()}
    bits = {name: added_bits(recipe, modes) for name, modes in oracles.items()}
    command = command_line("static_oracles", argv)
    shown = path.resolve().relative_to(Path.cwd()) if path.resolve().is_relative_to(Path.cwd()) else path
    md = markdown(results, bits, command, (time.time() - t0) / 60, args.frames, str(shown))
    name = f"static_oracles_{path.stem}" if args.recipe else report_name("static_oracles", args.model)
    write_report(args.out, name, md, {"added_bits": bits, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
