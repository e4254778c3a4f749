"""Choose a memory plan under a device budget: window x bits x recall, scored in real rollouts.

`task=calibrate memory.device_budget=...` turns the token policy into a memory plan
(`calibrate/plan.py`): which of the candidate codes (the recipe this run made, float16, other
presets), how many newest frames on the device, and how many frames recalled from a host tier.
At one device budget these trade against each other: 16 float16 frames cost what ~100 frames of
a 2.5-bit cache cost, which can hold a longer window or leave room for recall slots.

1. **Candidates**: every scheme x window x recall-slot count of the `memory` config (sinks from
   `model.cache.sink_frames`, a host tier of `memory.host_frames` when there are slots). One
   whose device tier at steady state (`tiers.steady_device_bytes`, every byte counted) exceeds
   the budget is refused here and recorded with the bytes it needs; so is a predictive recipe
   at a window other than the one its codes were fitted for (`memory.check_fitted_window`:
   for such a recipe only the recall slots vary; another window needs its own fit).
2. **Score**: each admitted plan rolls out (the fast runtime, free rollouts) on calibration
   trajectories of the `long_revisit` family: the camera wanders away for 64-512 frames and
   comes back. Two numbers per plan, each against the reference plan (float16, window
   `model.cache.window` + sinks, no recall: the cache the budget is usually quoted from):
   - return frames (a return to a pose seen >= 64 frames earlier, `revisit_pairs`): the gain
     in self-consistency, PSNR of the return frame against the same rollout's frame at the
     earlier visit (what memory buys; in free rollouts PSNR against the truth cannot show it,
     because both the earlier view and any return to it are mostly the model's own invention);
   - every other generated frame: the gain in PSNR against the truth (what the plan costs).
   score = mean of the two gains (dB), so a plan can buy neither at the other's expense
   unnoticed. The highest score wins; ties go to fewer device bytes.
3. **Record**: every candidate, scored or refused, with its bytes, both gains and the reason,
   goes into the fit record (`plan_search`), and the chosen plan into `scheme.policy.plan`.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import Tensor

from calibrate.adapters.base import WorldAdapter
from calibrate.config_memory import byte_count
from calibrate.evaluate.metrics import psnr
from calibrate.fastcache import FastKVCache
from calibrate.memory import check_fitted_window, fp16_cache_bytes, memory_section, steady_state_frames
from calibrate.plan import MemoryPlan
from calibrate.recipe import Recipe
from calibrate.replay import batches, rollout_batch
from calibrate.tiers import host_frame_nbytes, slot_nbytes, steady_device_bytes
from calibrate.types import ModelInfo, Trajectory
from calibrate.world.trajectories import LONG_AWAY_FRAMES, revisit_pairs

log = logging.getLogger(__name__)

SCORE = ("mean of two gains over the reference plan, dB: self-consistency of return frames (>= 64 frames away) "
         "and PSNR vs truth of every other frame")
WHY = "highest score (ties: fewer device bytes)"


def parse_budget(text: str, info: ModelInfo, window: int, sink_frames: int) -> int:
    """Bytes per trajectory of `memory.device_budget`: a byte count with an optional unit (`835584`,
    `816KiB`, `0.8MB`) or `fp16` = the float16 cache of `window` + `sink_frames` frames."""
    count = byte_count(text)
    if count is None:
        return fp16_cache_bytes(info, steady_state_frames(window, sink_frames), window, sink_frames)
    return count


def with_plan(recipe: Recipe, plan: MemoryPlan | None) -> Recipe:
    """The recipe with `plan` as its memory plan (tensors shared, metadata copied)."""
    scheme = replace(recipe.scheme, policy=replace(recipe.scheme.policy, plan=plan))
    return Recipe(recipe.model, scheme, recipe.tensors, dict(recipe.metadata), recipe.path)


def candidates(recipes: dict[str, Recipe], budget: int, windows: list[int], recall_slots: list[int],
               sink_frames: int, host_frames: int, yaw_radius: float) -> list[dict]:
    """Every scheme x window x slot count, with the device bytes it needs; over-budget ones refused."""
    out = []
    for scheme, recipe in recipes.items():
        for window in windows:
            for slots in recall_slots:
                plan = MemoryPlan(budget, window=window, sink_frames=sink_frames, recall_slots=slots,
                                  host_frames=host_frames if slots else 0, yaw_radius=yaw_radius)
                need = steady_device_bytes(recipe.model, recipe.scheme, plan)
                row = {"name": f"{scheme}/{plan.label()}", "scheme": scheme, "plan": plan, "device_bytes": need,
                       "host_bytes_per_frame": host_frame_nbytes(recipe.model, recipe.scheme, plan) if slots else 0,
                       "slot_bytes": slot_nbytes(recipe.model, recipe.scheme)}
                try:  # codes across frames run only under the window they were fitted for
                    check_fitted_window(recipe, window, sink_frames)
                except ValueError:
                    fitted = recipe.section("memory").get("window")
                    row.update(status="refused", reason=f"its predictive codes were fitted for window {fitted}")
                    out.append(row)
                    continue
                if need > budget:
                    row.update(status="refused", reason=f"device tier needs {need} B > budget {budget} B")
                else:
                    row.update(status="admitted")
                out.append(row)
    return out


def split_frames(traj: Trajectory, min_gap: int = LONG_AWAY_FRAMES[0]) -> tuple[list[tuple[int, int]], list[int]]:
    """(return pairs (t, s) with t - s >= min_gap, the other generated frames: in no revisit pair)."""
    pairs = revisit_pairs(traj)
    returns = [(t, s) for t, s in pairs if t - s >= min_gap]
    in_pair = {t for t, _ in pairs}
    return returns, [t for t in range(1, traj.num_frames) if t not in in_pair]


def frame_scores(frames_NCHW: Tensor, truth_NCHW: Tensor, traj: Trajectory) -> dict[str, list[float]]:
    """Per-frame numbers of one rollout: return self-consistency and truth PSNR, other frames' truth PSNR."""
    returns, others = split_frames(traj)
    gt = psnr(frames_NCHW, truth_NCHW)
    return {"return_consistency": [psnr(frames_NCHW[t:t + 1], frames_NCHW[s:s + 1]).item() for t, s in returns],
            "return_truth": [gt[t].item() for t, _ in returns],
            "other_truth": [gt[t].item() for t in others]}


def rollout_scores(world: WorldAdapter, recipe: Recipe, trajs: list[Trajectory], truth: list[Tensor],
                   device: torch.device, batch_size: int) -> dict[str, float]:
    """Mean return self-consistency, return and other-frame truth PSNR of `recipe`'s free rollouts."""
    sums: dict[str, list[float]] = {"return_consistency": [], "return_truth": [], "other_truth": []}
    first = 0
    for group in batches(trajs, batch_size):
        g = torch.cat(truth[first:first + len(group)]).to(device)
        cache = FastKVCache.from_recipe(recipe, recipe.scheme.policy.plan.window, recipe.scheme.policy.plan.sink_frames, device)
        frames, _ = rollout_batch(world, group, cache, device, truth=g)
        for b, traj in enumerate(group):
            for key, values in frame_scores(frames[b], g[b], traj).items():
                sums[key] += values
        first += len(group)
    if not sums["return_consistency"]:
        raise ValueError("memory plan search: the search trajectories have no return after >= "
                         f"{LONG_AWAY_FRAMES[0]} frames (use more memory.search_frames)")
    return {k: sum(v) / len(v) for k, v in sums.items()} | {"num_returns": len(sums["return_consistency"])}


def search(world: WorldAdapter, recipes: dict[str, Recipe], reference: Recipe, budget: int, trajs: list[Trajectory],
           device: torch.device, *, windows: list[int], recall_slots: list[int], sink_frames: int, host_frames: int,
           yaw_radius: float, reference_window: int, batch_size: int = 8) -> tuple[str, Recipe, dict]:
    """Score every admitted plan; returns (chosen candidate's name, its recipe with the plan, record)."""
    rows = candidates(recipes, budget, windows, recall_slots, sink_frames, host_frames, yaw_radius)
    admitted = [r for r in rows if r["status"] == "admitted"]
    if not admitted:
        smallest = min(rows, key=lambda r: r["device_bytes"])
        raise ValueError(f"config: memory.device_budget={budget} bytes per trajectory admits no plan; the smallest "
                         f"candidate ({smallest['name']}) needs {smallest['device_bytes']} bytes")
    truth = [world.ground_truth([t], device) for t in trajs]
    if truth[0] is None:
        raise ValueError(f"memory plan search: model {world.info.name} renders no ground truth to score plans against")
    truth = [t.cpu() for t in truth]
    ref_plan = MemoryPlan(budget, window=reference_window, sink_frames=sink_frames)
    ref = rollout_scores(world, with_plan(reference, replace(ref_plan, device_budget_bytes=10**15)), trajs, truth,
                         device, batch_size)
    for row in admitted:
        got = rollout_scores(world, with_plan(recipes[row["scheme"]], row["plan"]), trajs, truth, device, batch_size)
        gain_r = got["return_consistency"] - ref["return_consistency"]
        gain_o = got["other_truth"] - ref["other_truth"]
        row.update(got, return_gain_db=gain_r, other_gain_db=gain_o, score=(gain_r + gain_o) / 2,
                   status="scored", reason=f"score {(gain_r + gain_o) / 2:+.2f} dB: returns {gain_r:+.2f} dB "
                                           f"self-consistency, other frames {gain_o:+.2f} dB vs truth")
        log.info("plan %s: %s", row["name"], row["reason"])
    chosen = max(admitted, key=lambda r: (round(r["score"], 3), -r["device_bytes"]))
    record = {"budget_bytes": budget, "score": SCORE, "why": WHY, "chosen": chosen["name"],
              "reference": {"name": f"fp16/{ref_plan.label()}", **ref},
              "trajectories": [[t.family, t.seed, t.num_frames] for t in trajs],
              "candidates": [{k: (vars(v) if k == "plan" else v) for k, v in r.items()} for r in rows]}
    return chosen["name"], with_plan(recipes[chosen["scheme"]], chosen["plan"]), record


def plan_memory_section(recipe: Recipe) -> dict:
    """The `memory` metadata of a recipe with a plan: the usual section at the plan's window and
    sinks, plus the device tier, slot and host-frame bytes (per trajectory)."""
    plan = recipe.scheme.policy.plan
    out = memory_section(recipe, plan.window, plan.sink_frames)
    out["plan"] = {"device_bytes_steady": steady_device_bytes(recipe.model, recipe.scheme, plan),
                   "slot_bytes": slot_nbytes(recipe.model, recipe.scheme),
                   "host_bytes_per_frame": host_frame_nbytes(recipe.model, recipe.scheme, plan),
                   "host_bits_per_element": 8 * slot_nbytes(recipe.model, recipe.scheme)
                   / (recipe.model.num_layers * recipe.model.elements_per_frame)}
    return out


__all__ = ["candidates", "frame_scores", "parse_budget", "plan_memory_section", "search", "split_frames", "with_plan"]
