"""Closed-loop selection: the fitted recipe must also win where it matters, in real rollouts.

The fitter scores candidates teacher-forced (objective.py), which cannot see errors feeding on
themselves. So the fitted recipe and, when mixed precision changed anything, the recipe before
mixed precision (every tensor at 2 bits) both roll out with the real runtime on calibration
trajectories; the one with the higher mean PSNR vs the full-precision rollout is kept (PSNR
rounded to 1e-3 dB, ties: lower flicker). The choice and its scores go into the fit record, and
what the dropped recipe's record describes (upgrades, compensators, logit correction) is moved
aside under `<key>_dropped`, so the record always describes the recipe that ships. The
predictive code's candidates are its recipe with the inter steps scaled (`fit.closed_loop_scales`,
[1.0] by default: one candidate, so nothing rolls out and the record has no `closed_loop`).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from calibrate.adapters.base import WorldAdapter
from calibrate.evaluate.run import evaluate
from calibrate.recipe import Recipe
from calibrate.types import Trajectory

WHY = "highest mean PSNR vs the fp rollout over real quantized rollouts (ties: lower flicker)"
DROPPED_WITH_BASE = ("upgrades", "compensators", "logit_correction")  # what the base recipe does not have


def closed_loop_scores(world: WorldAdapter, candidates: dict[str, Recipe], trajs: list[Trajectory], window: int,
                       sink_frames: int, device: torch.device, batch_size: int) -> dict[str, dict]:
    """Real quantized rollouts of each candidate (through the runtime, as evaluation runs them):
    mean psnr_ref and flicker over `trajs`."""
    runs = evaluate(world, candidates, trajs, window, sink_frames, device, batch_size, attention=False)
    out = {}
    for name, run in runs.items():
        out[name] = {
            "psnr_ref": sum(float(r.series["psnr_ref"].mean()) for r in run.trajs) / len(run.trajs),
            "flicker": sum(float(r.series["flicker"].mean()) for r in run.trajs) / len(run.trajs),
        }
    return out


def choose(scores: dict[str, dict]) -> str:
    return max(scores, key=lambda n: (round(scores[n]["psnr_ref"], 3), -scores[n]["flicker"]))


def record_choice(record: dict, scores: dict[str, dict], chosen: str, recipe: Recipe) -> None:
    """Write the selection into the fit `record` (in place) so that it describes `recipe`."""
    record["closed_loop"] = {"scores": scores, "chosen": chosen, "why": WHY}
    if chosen.startswith("inter_x"):  # a predictive recipe with rescaled inter steps: the same bits
        record["inter_scale"] = float(chosen[len("inter_x"):])
    elif chosen != "fitted":  # the base recipe: no mixed precision, no compensation
        for key in DROPPED_WITH_BASE:
            record[f"{key}_dropped"], record[key] = record.get(key, []), []
        record["bits_per_element"] = record["base_bits"]
        record["policy"] = asdict(recipe.scheme.policy)
