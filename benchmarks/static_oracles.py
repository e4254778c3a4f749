"""Study: which part of the shipped recipe's error keeps the still camera low, by oracles.

    python -m benchmarks.static_oracles [--frames 256] [--out artifacts/benchmarks]

Writes `static_oracles.md` + `.json`. Each oracle makes one part of the shipped TinyWorld recipe's
code exact in `coherence_study.FakePredictiveCache` (the float cache that reconstructs every frame
as the predictive code does) and rolls it out next to its noise twin (evaluate/twin.py):

- `uncoded exact`: the components the recipe gives 0 bits (the weakest PCA directions, held at
  the mean by the code) take their true value in every frame, K and V; the coded ones as shipped;
- `uncoded held 8`: the same components take their true value only every 8th frame (component i
  at frames f with (i + f) % 8 = 0, staggered) and hold it in between: what a code that refreshes
  them now and then, instead of never, could reach if its refresh were exact;
- `K exact`, `V exact`: one tensor stored exactly in every layer;
- `V exact, uncoded K held 8`: both at once.

No oracle counts the bits its exact values would cost: they bound what coding that part better
can earn. Two held-out trajectory sets: `fit.md`'s (evaluation seeds 0-6, one trajectory per
family; issue 28's targets are measured there) and `coherence_study.md`'s (seeds 0-3: static,
pan, orbit, dolly), each cut to the families static, pan, orbit and dolly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from benchmarks.coherence_study import FakePredictiveCache, roll_variant
from calibrate import pipeline
from calibrate.adapters import as_world
from calibrate.config import CONF_DIR, to_config
from calibrate.io import write_text_atomic
from calibrate.recipe import load_recipe
from calibrate.world.trajectories import make_trajectories

FAMILIES = ("static", "pan", "orbit", "dolly")
FIT_ORDER = ["orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static"]  # conf/trajectories: fit.md's set
EXACT_DB = 200.0  # a stored SQNR above this is an exact tensor (float rounding only)
ORACLES = {"shipped": {}, "uncoded exact": {"k": 1, "v": 1}, "uncoded held 8": {"k": 8, "v": 8},
           "K exact": {"k": "exact"}, "V exact": {"v": "exact"}, "V exact, uncoded K held 8": {"k": 8, "v": "exact"}}


class OracleCoder:
    """A `coherence_study.HeadCoder` with one part made exact: `mode` "exact" (every component) or
    P >= 1 (the 0-bit components take their true value every P frames, staggered, and hold it)."""

    def __init__(self, coder, mode):
        self.coder, self.mode, self.frame, self.held = coder, mode, 0, None

    def code(self, x_BTD: torch.Tensor) -> torch.Tensor:
        out = self.coder.code(x_BTD)
        if self.mode == "exact":
            return x_BTD.float()
        c, p = self.coder, self.coder.p
        tau = ((x_BTD.float() - p.mean_D) @ p.rotation_DD) / c.unit
        due = (torch.arange(tau.shape[-1]) + self.frame) % self.mode == 0
        self.held = tau if self.held is None else torch.where(due, tau, self.held)
        self.frame += 1
        x = torch.where(p.bits_D == 0, self.held, c.x.float())
        return (c.unit * x) @ p.rotation_DD.T + p.mean_D


def oracle_cache(recipe, window: int, sinks: int, modes: dict) -> FakePredictiveCache:
    cache = FakePredictiveCache(recipe, window, sinks)
    for layer in cache.coders:
        for kv, mode in modes.items():
            layer[kv] = [OracleCoder(c, mode) for c in layer[kv]]
    return cache


def markdown(results: dict, command: str, minutes: float, frames: int) -> str:
    lines = ["# Oracles: which part of the shipped recipe's error keeps the still camera low", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}). "
             f"`recipes/tinyworld-ours-2bit.safetensors`, {frames} frames; the oracles and trajectory sets are in "
             "the module docstring of `benchmarks/static_oracles.py`. No oracle counts the bits its exact values "
             "would cost.", ""]
    for set_name, rows in results.items():
        fams = list(next(iter(rows.values())))
        late = list(next(iter(rows.values()))[fams[0]]["scheme"])[-1]
        lines += [f"## {set_name}", "", f"PSNR vs the fp rollout, frames {late}: oracle / its noise twin; "
                  "SQNR = stored K / V dB, mean over layers.", "",
                  "| oracle | " + " | ".join(fams) + " | flicker |", "|---|" + "---|" * (len(fams) + 1)]
        for name, res in rows.items():
            db = lambda x: "exact" if x > EXACT_DB else f"{x:.1f}"
            cells = [f"{res[f]['scheme'][late]:.1f} / {res[f]['twin'][late]:.1f}; SQNR {db(res[f]['sqnr_k'])} / "
                     f"{db(res[f]['sqnr_v'])}" for f in fams]
            flick = sum(res[f]["flicker"] for f in fams) / len(fams)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {flick:.5f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    t0 = time.time()
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["model=tinyworld"]))
    device = torch.device("cpu")
    world = as_world(pipeline.load_world(cfg, device))
    recipe = load_recipe(pipeline.ours_recipe(world.info), world.info)
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    sets = {"fit.md's trajectories (evaluation seeds 0-6)":
            [t for t in make_trajectories(FIT_ORDER, "evaluation", 7, args.frames) if t.family in FAMILIES],
            "coherence_study.md's trajectories (evaluation seeds 0-3)":
            make_trajectories(list(FAMILIES), "evaluation", 4, args.frames)}
    results = {name: {oracle: roll_variant(world, recipe, trajs, "nearest", 0, 1.0, window, sinks, device,
                                           make=lambda m=modes: oracle_cache(recipe, window, sinks, m))
                      for oracle, modes in ORACLES.items()}
               for name, trajs in sets.items()}
    command = "python -m benchmarks.static_oracles " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(results, command, (time.time() - t0) / 60, args.frames)
    out = Path(args.out)
    write_text_atomic(out / "static_oracles.md", md)
    write_text_atomic(out / "static_oracles.json", json.dumps(results, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
