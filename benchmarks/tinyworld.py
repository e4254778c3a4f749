"""Does TinyWorld meet its bars? Measured on held-out rooms (the evaluation seed range).

    python -m benchmarks.tinyworld [--weights PATH] [--out artifacts/benchmarks]
                                             [--num-trajectories N] [--num-frames N]

Writes ``tinyworld.json`` and ``tinyworld.md`` into ``--out`` and prints the table. Numbers are
reported as measured; a bar that fails is reported as failing. Bars 1 and 2 use the PSNR of the
squared error pooled over frames and trajectories (:func:`pooled_psnr`); the memory bars use the
mean of per-frame PSNR (dB, :func:`calibrate.evaluate.metrics.psnr`), with the pooled version
reported next to it.

The bars (model vs a trivial baseline; the bar families are orbit, dolly, pan, random_walk;
revisit, stress and static are reported for information):

1. ``one_step``: teacher-forced (true frame t-1 as context), PSNR of frames 1..N-1 vs ground
   truth, against "copy the previous true frame" (PSNR(true[t-1], true[t])). Gain >= 3 dB on
   every bar family.
2. ``rollout_1_16`` / ``rollout_17_64``: free rollout (own outputs fed back), against "hold
   the first frame" (PSNR(true[0], true[t])), in frames 1-16 and 17-64 (inclusive frame
   numbers; 65+ is reported too). Gain >= 3 dB in 1-16 and > 0 dB in 17-64, every bar family.
3. Memory through the cache, on the turn-away-and-return episodes of ``revisit``
   trajectories (the camera turned >= 60 degrees away, so the earlier view left the frame;
   walk-out-and-back episodes keep it in sight and are no memory test): the default cache
   (window 16, sink 1) against a cache cut to the newest frame (window 1, sink 0).
   ``memory_teacher_forced``: gain = PSNR(full) - PSNR(last frame) vs ground truth, averaged
   over return-leg frames (after the largest turn) minus the same over outbound-leg frames
   (the control); >= 3 dB.
   ``memory_rollout``: return-to-view self-consistency (PSNR of the generated frame at the
   return against the same rollout's frame at the earlier visit), full minus last-frame
   cache; >= 3 dB. Both arms share one free rollout up to the largest turn of each episode;
   from there the last-frame arm regenerates the return leg with the cache cut to the newest
   frame, so the two differ only in what the cache remembers on the way back. (Cutting the
   cache for the whole rollout instead, reported for information, compares against a model
   that has already lost the scene at the first turn away - it cannot know the views that
   come into sight, predicts their mean and stays grey - and grey frames match each other.)
   The same return frames against the true view are reported too.
4. ``speed``: ms per generated frame, batch 1, default window, after a warmup, with 1 torch
   thread and with the process's default thread count; the slower must be <= 60 ms.
5. ``determinism``: two free rollouts of one trajectory give identical frames (torch.equal).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from calibrate.cache import KVCache
from calibrate.evaluate.metrics import json_safe, psnr, window_label
from calibrate.io import write_text_atomic
from calibrate.types import weights_fingerprint
from calibrate.world.model import TinyWorld
from calibrate.world.render import make_scene, render_batch
from calibrate.world.rollout import rollout
from calibrate.world.trajectories import (
    FAMILIES,
    SEED_RANGES,
    Trajectory,
    make_trajectories,
    make_trajectory,
    revisit_pairs,
    wrap_angle,
)
from calibrate.world.weights import default_weights_path, load_weights

log = logging.getLogger(__name__)

FORMAT = "tinyworld-benchmark"
FORMAT_VERSION = "1.0"
COMMAND = "python -m benchmarks.tinyworld"
SPLIT = "evaluation"
BAR_FAMILIES = ("orbit", "dolly", "pan", "random_walk")
DEFAULT_WINDOW, DEFAULT_SINK = 16, 1
LAST_FRAME_WINDOW, LAST_FRAME_SINK = 1, 0
# Inclusive frame numbers (frame 0 is the given true frame, never scored).
ROLLOUT_WINDOWS: tuple[tuple[int, int | None], ...] = ((1, 16), (17, 64), (65, None))
MIN_FRAMES = 18  # the rollout bars need at least one frame of the 17-64 window

ONE_STEP_MIN_GAIN_DB = 3.0
ROLLOUT_EARLY_MIN_GAIN_DB = 3.0  # frames 1-16, >=
ROLLOUT_MID_MIN_GAIN_DB = 0.0  # frames 17-64, strictly >
MEMORY_MIN_GAIN_DB = 3.0
TURN_AWAY_DEG = 60.0  # an episode is a memory test when the camera turned at least this far away
MAX_MS_PER_FRAME = 60.0
SPEED_WARMUP_FRAMES = 16
SPEED_REPEATS = 3


# ---------------------------------------------------------------------------------------------
# Trajectories and ground truth


class Clips:
    """Trajectories of equal length, rolled out together: poses/actions [B, N, 3], truth [B, N, 3, H, W]."""

    def __init__(self, trajs: Sequence[Trajectory]):
        if not trajs or len({t.num_frames for t in trajs}) != 1:
            raise ValueError("Clips needs at least one trajectory, all of the same length")
        self.trajs = list(trajs)
        self.poses_BN3 = torch.stack([t.poses for t in trajs])
        self.actions_BN3 = torch.stack([t.actions for t in trajs])
        # Each trajectory's seed picks its own room.
        self.true_BN3HW = render_batch([make_scene(t.seed) for t in trajs], self.poses_BN3)


def run_rollout(model: TinyWorld, clips: Clips, window: int, sink_frames: int, teacher_forced: bool) -> Tensor:
    """Frames [B, N, 3, H, W] of a free (or teacher-forced) rollout through a fresh cache."""
    cache = KVCache(model.cfg.num_layers, window=window, sink_frames=sink_frames)
    true = clips.true_BN3HW if teacher_forced else None
    return rollout(model, cache, clips.true_BN3HW[:, 0], clips.poses_BN3, clips.actions_BN3, true)


def _mean(x: Tensor) -> float:
    """JSON-safe mean (NaN, e.g. of an empty selection, becomes the worst value)."""
    return json_safe(x.double().mean() if x.numel() else float("nan"))


def _gain(model_db: float, baseline_db: float) -> dict[str, float]:
    return {"model_db": model_db, "baseline_db": baseline_db, "gain_db": json_safe(model_db - baseline_db)}


# ---------------------------------------------------------------------------------------------
# Bars 1 and 2: one-step and rollout quality per family


def pooled_psnr(a: Tensor, b: Tensor, max_db: float = 100.0) -> float:
    """PSNR of the mean squared error pooled over all frames given (the PSNR of the clip).

    The bars use this rather than a mean of per-frame PSNR: where the camera stands still,
    "copy the previous frame" is exact and a per-frame PSNR hits its cap (100 dB), which then
    dominates the mean; pooling the error keeps every frame in and gives still frames their
    true weight (zero error), not an arbitrary cap.
    """
    mse = (a.double() - b.double()).pow(2).mean().item()
    return min(max_db, -10.0 * math.log10(mse)) if mse > 0 else max_db


def one_step_table(model: TinyWorld, groups: dict[str, Clips], window: int, sink_frames: int) -> dict[str, dict]:
    """Per family: teacher-forced PSNR of frames 1..N-1 vs "copy the previous true frame"."""
    table = {}
    for family, clips in groups.items():
        pred = run_rollout(model, clips, window, sink_frames, teacher_forced=True)
        g = clips.true_BN3HW
        row = _gain(pooled_psnr(pred[:, 1:], g[:, 1:]), pooled_psnr(g[:, :-1], g[:, 1:]))
        row["pass"] = row["gain_db"] >= ONE_STEP_MIN_GAIN_DB
        # For information: the mean of per-frame PSNR (still frames give the copy 100 dB) and
        # the same on moving frames only.
        model_BN, copy_BN = psnr(pred[:, 1:], g[:, 1:]), psnr(g[:, :-1], g[:, 1:])
        row["per_frame_mean"] = _gain(_mean(model_BN), _mean(copy_BN))
        moving_BN = (g[:, 1:] != g[:, :-1]).flatten(2).any(dim=-1)
        row["num_still_frames"] = int((~moving_BN).sum())
        row["moving_frames"] = _gain(_mean(model_BN[moving_BN]), _mean(copy_BN[moving_BN])) if moving_BN.any() else None
        table[family] = row
    return table


def rollout_table(model: TinyWorld, groups: dict[str, Clips], window: int, sink_frames: int) -> dict[str, dict]:
    """Per family and frame window: free-rollout PSNR vs "hold the first frame"."""
    table = {}
    for family, clips in groups.items():
        pred = run_rollout(model, clips, window, sink_frames, teacher_forced=False)
        g = clips.true_BN3HW
        hold = g[:, :1].expand_as(g)
        windows = {}
        for start, stop in ROLLOUT_WINDOWS:
            if start < g.shape[1]:
                sl = slice(start, None if stop is None else stop + 1)
                windows[window_label(start, stop)] = _gain(pooled_psnr(pred[:, sl], g[:, sl]), pooled_psnr(hold[:, sl], g[:, sl]))
        early, mid = windows["1-16"]["gain_db"], windows["17-64"]["gain_db"]
        table[family] = {
            "windows": windows,
            "pass_1_16": early >= ROLLOUT_EARLY_MIN_GAIN_DB,
            "pass_17_64": mid > ROLLOUT_MID_MIN_GAIN_DB,
        }
    return table


# ---------------------------------------------------------------------------------------------
# Bar 3: memory through the cache


def turn_away_episodes(traj: Trajectory) -> list[tuple[int, int, int]]:
    """(earlier, turn, return) frame indices of the turn-away-and-return episodes of a trajectory.

    An episode is an outermost revisit pair (a return to a pose seen before, not nested in a
    longer one) whose camera turned at least TURN_AWAY_DEG away in between, so that the view
    left the frame; `turn` is the frame of the largest turn. Walk-out-and-back episodes, where
    the earlier view stays in sight, are not memory tests and are left out of the bars.
    """
    pairs = revisit_pairs(traj)
    out = []
    for i, j in pairs:
        if any(j2 < j and i < i2 for i2, j2 in pairs):
            continue
        yaw = wrap_angle(traj.poses[j + 1 : i, 2] - traj.poses[j, 2]).abs()
        if len(yaw) and yaw.max().item() >= math.radians(TURN_AWAY_DEG):
            out.append((j, j + 1 + int(yaw.argmax()), i))
    return out


def memory_bars(model: TinyWorld, clips: Clips, window: int, sink_frames: int) -> dict[str, dict]:
    """Full cache vs newest-frame-only cache on turn-away-and-return episodes of `revisit`.

    Teacher-forced: PSNR vs ground truth on the return legs (frames after the largest turn, up
    to the return) and on the outbound legs (the control). Free rollout: return-to-view
    self-consistency, PSNR of the generated return frame against the same rollout's earlier
    frame at that pose (and, for information, against the true view); the last-frame arm
    branches off the full-cache rollout at the largest turn (see the module docstring), and
    the whole rollout under the last-frame cache is reported for information. Means over an
    empty selection become the worst value, so such a bar fails instead of vanishing.
    """
    caches = {"full_cache": (window, sink_frames), "last_frame_cache": (LAST_FRAME_WINDOW, LAST_FRAME_SINK)}
    g = clips.true_BN3HW
    episodes = [turn_away_episodes(t) for t in clips.trajs]
    # per episode: the outbound leg, and the return leg split by kind of frame - dwelling at the
    # turned-away pose (camera still: the last frame already shows the view), retracing the
    # outbound path, and the frame back at the earlier pose, reached in one snap (the view before
    # was far away) or gradually (the view before was next to it)
    return_BN = torch.zeros(g.shape[:2], dtype=torch.bool)
    outbound_BN, dwell_BN, snap_BN, gradual_BN = (torch.zeros_like(return_BN) for _ in range(4))
    for b, eps in enumerate(episodes):
        poses = clips.trajs[b].poses
        for j, turn, i in eps:
            outbound_BN[b, j + 1 : turn + 1] = True
            return_BN[b, turn + 1 : i + 1] = True
            for k in range(turn + 1, i):
                dwell_BN[b, k] = bool(torch.equal(poses[k], poses[k - 1]))
            jump = abs(wrap_angle(poses[i, 2] - poses[i - 1, 2]).item())
            (snap_BN if jump >= math.radians(TURN_AWAY_DEG) / 2 else gradual_BN)[b, i] = True
    retrace_BN = return_BN & ~dwell_BN & ~snap_BN & ~gradual_BN
    kinds = {"outbound": outbound_BN, "return": return_BN, "dwell": dwell_BN, "retrace": retrace_BN}

    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values) if values else math.nan

    def pair_psnr(frames_BN3HW: Tensor, reference_BN3HW: Tensor) -> float:
        return mean(psnr(frames_BN3HW[b, i : i + 1], reference_BN3HW[b, j : j + 1]).item()
                    for b, eps in enumerate(episodes) for j, _, i in eps)

    def truth_psnr(frames_BN3HW: Tensor) -> float:
        return mean(psnr(frames_BN3HW[b, i : i + 1], g[b, i : i + 1]).item() for b, eps in enumerate(episodes) for _, _, i in eps)

    tf, free, vs_truth = {}, {}, {}
    for name, (w, s) in caches.items():
        pred = run_rollout(model, clips, w, s, teacher_forced=True)
        tf_BN = psnr(pred, g)
        tf[name] = {"return_db": mean(tf_BN[return_BN].tolist()), "outbound_db": mean(tf_BN[outbound_BN].tolist()),
                    "snap_return_frame_db": mean(tf_BN[snap_BN].tolist()),
                    "gradual_return_frame_db": mean(tf_BN[gradual_BN].tolist()),
                    "dwell_db": mean(tf_BN[dwell_BN].tolist()), "retrace_db": mean(tf_BN[retrace_BN].tolist()),
                    # for information: the PSNR of each leg's pooled squared error (as bars 1 and 2)
                    **{f"{kind}_pooled_db": pooled_psnr(pred[m], g[m]) if m.any() else math.nan
                       for kind, m in kinds.items()}}
    full = run_rollout(model, clips, window, sink_frames, teacher_forced=False)
    # the last-frame arm: from the largest turn on, each return leg regenerated with only the
    # newest frame visible (a window-1, sink-0 cache holds nothing older, so a fresh one is that cut)
    branch = full.clone()
    for b, eps in enumerate(episodes):
        for _, turn, i in eps:
            cut = KVCache(model.cfg.num_layers, window=LAST_FRAME_WINDOW, sink_frames=LAST_FRAME_SINK)
            leg = rollout(model, cut, full[b : b + 1, turn], clips.poses_BN3[b : b + 1, turn : i + 1],
                          clips.actions_BN3[b : b + 1, turn : i + 1])
            branch[b, turn + 1 : i + 1] = leg[0, 1:]
    whole = run_rollout(model, clips, LAST_FRAME_WINDOW, LAST_FRAME_SINK, teacher_forced=False)
    for name, frames in (("full_cache", full), ("last_frame_cache", branch), ("whole_rollout_last_frame_cache", whole)):
        free[name] = pair_psnr(frames, frames)
        vs_truth[name] = truth_psnr(frames)
    return_gain = tf["full_cache"]["return_db"] - tf["last_frame_cache"]["return_db"]
    outbound_gain = tf["full_cache"]["outbound_db"] - tf["last_frame_cache"]["outbound_db"]
    pooled_gain = {k: tf["full_cache"][f"{k}_pooled_db"] - tf["last_frame_cache"][f"{k}_pooled_db"] for k in ("return", "outbound")}
    return {
        "teacher_forced": {
            **{name: {k: json_safe(v) for k, v in legs.items()} for name, legs in tf.items()},
            "return_gain_db": json_safe(return_gain),
            "outbound_gain_db": json_safe(outbound_gain),
            "value_db": json_safe(return_gain - outbound_gain),
            "pooled_value_db": json_safe(pooled_gain["return"] - pooled_gain["outbound"]),
            "num_return_frames": int(return_BN.sum()),
            "num_dwell_frames": int(dwell_BN.sum()),
            "num_retrace_frames": int(retrace_BN.sum()),
            "num_outbound_frames": int(outbound_BN.sum()),
            "num_snap_returns": int(snap_BN.sum()),
            "num_gradual_returns": int(gradual_BN.sum()),
        },
        "rollout": {
            "full_cache_db": json_safe(free["full_cache"]),
            "last_frame_cache_db": json_safe(free["last_frame_cache"]),
            "gain_db": json_safe(free["full_cache"] - free["last_frame_cache"]),
            "full_cache_return_vs_truth_db": json_safe(vs_truth["full_cache"]),
            "last_frame_cache_return_vs_truth_db": json_safe(vs_truth["last_frame_cache"]),
            "vs_truth_gain_db": json_safe(vs_truth["full_cache"] - vs_truth["last_frame_cache"]),
            "whole_rollout_last_frame_cache_db": json_safe(free["whole_rollout_last_frame_cache"]),
            "whole_rollout_gain_db": json_safe(free["full_cache"] - free["whole_rollout_last_frame_cache"]),
            "whole_rollout_last_frame_cache_return_vs_truth_db": json_safe(vs_truth["whole_rollout_last_frame_cache"]),
            "ground_truth_db": json_safe(pair_psnr(g, g)),
            "num_pairs": sum(len(eps) for eps in episodes),
        },
    }


# ---------------------------------------------------------------------------------------------
# Bars 4 and 5: speed and determinism


def speed(model: TinyWorld, traj: Trajectory, window: int, sink_frames: int, thread_counts: Sequence[int]) -> list[dict]:
    """Median ms per generated frame of a batch-1 free rollout, per torch thread count."""
    clips = Clips([traj])
    warm = Clips([make_trajectory(traj.family, traj.seed, min(SPEED_WARMUP_FRAMES, traj.num_frames))])
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            run_rollout(model, warm, window, sink_frames, teacher_forced=False)
            times = []
            for _ in range(SPEED_REPEATS):
                t0 = time.perf_counter()
                run_rollout(model, clips, window, sink_frames, teacher_forced=False)
                times.append(time.perf_counter() - t0)
            ms = 1000.0 * statistics.median(times) / max(traj.num_frames - 1, 1)
            runs.append({"threads": threads, "ms_per_frame": ms})
    finally:
        torch.set_num_threads(before)
    return runs


def determinism(model: TinyWorld, traj: Trajectory, window: int, sink_frames: int) -> dict:
    """Two free rollouts of one trajectory through fresh caches: identical frames?"""
    clips = Clips([traj])
    a = run_rollout(model, clips, window, sink_frames, teacher_forced=False)
    b = run_rollout(model, clips, window, sink_frames, teacher_forced=False)
    return {"identical": bool(torch.equal(a, b)), "max_abs_diff": float((a - b).abs().max())}


# ---------------------------------------------------------------------------------------------
# The whole benchmark


def _bar(description: str, value: float, threshold: float, comparison: str, unit: str, passed: bool) -> dict:
    return {
        "description": description, "value": json_safe(value), "threshold": threshold,
        "comparison": comparison, "unit": unit, "pass": bool(passed),
    }


def benchmark(
    model: TinyWorld, *, num_trajectories: int, num_frames: int, num_memory_trajectories: int, speed_frames: int,
    default_threads: int, window: int = DEFAULT_WINDOW, sink_frames: int = DEFAULT_SINK,
) -> dict:
    """Measure every bar; returns the JSON-ready report body (bars + tables)."""
    if num_trajectories < 1 or num_memory_trajectories < 1:
        raise ValueError("--num-trajectories and --memory-trajectories must be >= 1")
    if num_frames < MIN_FRAMES:
        raise ValueError(f"--num-frames must be >= {MIN_FRAMES} (the rollout bars score frames 1-16 and 17+)")
    if speed_frames < 2:
        raise ValueError("--speed-frames must be >= 2")
    # Disjoint evaluation seeds: families cycle over seeds lo..; then memory; then speed.
    trajs = make_trajectories(FAMILIES, SPLIT, num_trajectories * len(FAMILIES), num_frames)
    groups = {f: Clips([t for t in trajs if t.family == f]) for f in FAMILIES}
    next_seed = len(trajs)
    memory_clips = Clips(make_trajectories("revisit", SPLIT, num_memory_trajectories, num_frames, base_seed=next_seed))
    speed_traj = make_trajectory("random_walk", SEED_RANGES[SPLIT][0] + next_seed + num_memory_trajectories, speed_frames)

    t0 = time.perf_counter()
    one_step = one_step_table(model, groups, window, sink_frames)
    log.info("one-step table: %.1f s", time.perf_counter() - t0)
    roll = rollout_table(model, groups, window, sink_frames)
    log.info("rollout table: %.1f s", time.perf_counter() - t0)
    memory = memory_bars(model, memory_clips, window, sink_frames)
    log.info("memory bars: %.1f s", time.perf_counter() - t0)
    speed_runs = speed(model, speed_traj, window, sink_frames, sorted({1, default_threads}))
    log.info("speed: %.1f s", time.perf_counter() - t0)
    det = determinism(model, groups[BAR_FAMILIES[0]].trajs[0], window, sink_frames)

    gated = BAR_FAMILIES
    slowest = max(r["ms_per_frame"] for r in speed_runs)
    bars = {
        "one_step": _bar(
            "teacher-forced gain over copy-previous-frame, worst bar family",
            min([one_step[f]["gain_db"] for f in gated]), ONE_STEP_MIN_GAIN_DB, ">=", "dB",
            all(one_step[f]["pass"] for f in gated)),
        "rollout_1_16": _bar(
            "free-rollout gain over hold-first-frame in frames 1-16, worst bar family",
            min([roll[f]["windows"]["1-16"]["gain_db"] for f in gated]), ROLLOUT_EARLY_MIN_GAIN_DB, ">=", "dB",
            all(roll[f]["pass_1_16"] for f in gated)),
        "rollout_17_64": _bar(
            "free-rollout gain over hold-first-frame in frames 17-64, worst bar family",
            min([roll[f]["windows"]["17-64"]["gain_db"] for f in gated]), ROLLOUT_MID_MIN_GAIN_DB, ">", "dB",
            all(roll[f]["pass_17_64"] for f in gated)),
        "memory_teacher_forced": _bar(
            "revisit, teacher-forced: (full - last-frame cache) gain on return legs minus on outbound legs",
            memory["teacher_forced"]["value_db"], MEMORY_MIN_GAIN_DB, ">=", "dB",
            memory["teacher_forced"]["value_db"] >= MEMORY_MIN_GAIN_DB),
        "memory_rollout": _bar(
            "revisit, free rollout: return-to-view self-consistency, full minus last-frame cache",
            memory["rollout"]["gain_db"], MEMORY_MIN_GAIN_DB, ">=", "dB",
            memory["rollout"]["gain_db"] >= MEMORY_MIN_GAIN_DB),
        "speed": _bar(
            f"batch-1 rollout at window {window}, slowest of threads {[r['threads'] for r in speed_runs]}",
            slowest, MAX_MS_PER_FRAME, "<=", "ms/frame", slowest <= MAX_MS_PER_FRAME),
        "determinism": _bar(
            "two free rollouts of one trajectory: max abs difference (0 = identical)",
            det["max_abs_diff"], 0.0, "==", "", det["identical"]),
    }
    return {
        "bars": bars,
        "pass": all(b["pass"] for b in bars.values()),
        "bar_families": list(BAR_FAMILIES),
        "one_step": one_step,
        "rollout": roll,
        "memory": memory,
        "speed": {"frames": speed_frames, "warmup_frames": min(SPEED_WARMUP_FRAMES, speed_frames), "repeats": SPEED_REPEATS,
                  "trajectory": {"family": speed_traj.family, "seed": speed_traj.seed}, "runs": speed_runs},
        "determinism": det,
    }


# ---------------------------------------------------------------------------------------------
# Report


def _yn(passed: bool | None) -> str:
    return "-" if passed is None else ("PASS" if passed else "FAIL")


def _f(x: float) -> str:
    return f"{x:.2f}"


def render_markdown(report: dict) -> str:
    """The human-readable report: how it was made, the bars, then the tables behind them."""
    cfg, w = report["config"], report["weights"]
    lines = [
        "# TinyWorld benchmark",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- weights: `{w['path']}` (fingerprint `{w['fingerprint']}`)",
        f"- held-out seeds: {cfg['split']} range; {cfg['num_trajectories']} trajectories x {cfg['num_frames']} frames "
        f"per family, {cfg['memory_trajectories']} revisit trajectories for memory; cache window "
        f"{cfg['window']}, sink {cfg['sink_frames']}",
        f"- default torch threads: {cfg['default_threads']}; load average at start: {cfg['load_average']}; "
        f"wall time {report['elapsed_s']:.0f} s",
        f"- overall: **{_yn(report['pass'])}**",
        "",
        "## Bars",
        "",
        "| bar | value | needs | result | what |",
        "|---|---:|---:|---|---|",
    ]
    for name, b in report["bars"].items():
        lines.append(f"| {name} | {b['value']:.3g} {b['unit']} | {b['comparison']} {b['threshold']:g} | "
                     f"{_yn(b['pass'])} | {b['description']} |")
    gated = set(report["bar_families"])
    lines += ["", "## One step (teacher-forced) vs copy previous true frame, PSNR dB", "",
              "| family | model | copy prev | gain | bar | still frames | per-frame mean: model / copy / gain "
              "| moving frames only: model / copy / gain |",
              "|---|---:|---:|---:|---|---:|---:|---:|"]
    trio = lambda g: "n/a" if g is None else f"{_f(g['model_db'])} / {_f(g['baseline_db'])} / {_f(g['gain_db'])}"
    for fam, r in report["one_step"].items():
        lines.append(f"| {fam} | {_f(r['model_db'])} | {_f(r['baseline_db'])} | {_f(r['gain_db'])} | "
                     f"{_yn(r['pass'] if fam in gated else None)} | {r['num_still_frames']} | "
                     f"{trio(r['per_frame_mean'])} | {trio(r['moving_frames'])} |")
    lines += ["", "PSNR here (and in the rollout table) is of the squared error pooled over all frames and "
              "trajectories (the PSNR of the clip). A mean of per-frame PSNR is shown for information: where the "
              "camera stands still the copy is exact and scores the 100 dB cap, which dominates that mean."]
    labels = list(next(iter(report["rollout"].values()))["windows"])
    lines += ["", "## Free rollout vs hold first frame, PSNR dB (model / hold / gain)", "",
              "| family | " + " | ".join(f"frames {lab}" for lab in labels) + " | bar 1-16 | bar 17-64 |",
              "|---|" + "---:|" * len(labels) + "---|---|"]
    for fam, r in report["rollout"].items():
        cells = [f"{_f(c['model_db'])} / {_f(c['baseline_db'])} / {_f(c['gain_db'])}" for c in r["windows"].values()]
        flags = [_yn(r["pass_1_16"] if fam in gated else None), _yn(r["pass_17_64"] if fam in gated else None)]
        lines.append(f"| {fam} | " + " | ".join(cells + flags) + " |")
    tf, fr = report["memory"]["teacher_forced"], report["memory"]["rollout"]
    lines += [
        "", "## Memory on revisit (turn-away-and-return episodes): full cache vs last-frame-only cache, PSNR dB", "",
        "| measure | full cache | last frame | gain |", "|---|---:|---:|---:|",
        f"| teacher-forced, return legs ({tf['num_return_frames']} frames) | {_f(tf['full_cache']['return_db'])} | "
        f"{_f(tf['last_frame_cache']['return_db'])} | {_f(tf['return_gain_db'])} |",
        f"| teacher-forced, outbound legs ({tf['num_outbound_frames']} frames) | {_f(tf['full_cache']['outbound_db'])} | "
        f"{_f(tf['last_frame_cache']['outbound_db'])} | {_f(tf['outbound_gain_db'])} |",
        *[f"| teacher-forced, return legs: {what} ({tf[f'num_{kind}_frames']} frames, information) | "
          f"{_f(tf['full_cache'][f'{kind}_db'])} | {_f(tf['last_frame_cache'][f'{kind}_db'])} | "
          f"{_f(tf['full_cache'][f'{kind}_db'] - tf['last_frame_cache'][f'{kind}_db'])} |"
          for kind, what in (("dwell", "dwelling at the turned-away pose"), ("retrace", "retracing the outbound path"))],
        *[f"| teacher-forced, return frame after a {kind} return ({tf[f'num_{kind}_returns']} frames, information) | "
          f"{_f(tf['full_cache'][f'{kind}_return_frame_db'])} | {_f(tf['last_frame_cache'][f'{kind}_return_frame_db'])} | "
          f"{_f(tf['full_cache'][f'{kind}_return_frame_db'] - tf['last_frame_cache'][f'{kind}_return_frame_db'])} |"
          for kind in ("snap", "gradual")],
        *[f"| teacher-forced, {leg} legs, PSNR of the pooled error (information) | "
          f"{_f(tf['full_cache'][f'{leg}_pooled_db'])} | {_f(tf['last_frame_cache'][f'{leg}_pooled_db'])} | "
          f"{_f(tf['full_cache'][f'{leg}_pooled_db'] - tf['last_frame_cache'][f'{leg}_pooled_db'])} |"
          for leg in ("return", "outbound")],
        f"| rollout, return vs earlier view ({fr['num_pairs']} episodes; last-frame arm cut at the largest turn) | "
        f"{_f(fr['full_cache_db'])} | {_f(fr['last_frame_cache_db'])} | {_f(fr['gain_db'])} |",
        f"| rollout, return frame vs true view (information) | {_f(fr['full_cache_return_vs_truth_db'])} | "
        f"{_f(fr['last_frame_cache_return_vs_truth_db'])} | {_f(fr['vs_truth_gain_db'])} |",
        f"| rollout, return vs earlier view, last-frame cache for the whole rollout (information) | "
        f"{_f(fr['full_cache_db'])} | {_f(fr['whole_rollout_last_frame_cache_db'])} | {_f(fr['whole_rollout_gain_db'])} |",
        f"| rollout, return frame vs true view, last-frame cache for the whole rollout (information) | "
        f"{_f(fr['full_cache_return_vs_truth_db'])} | {_f(fr['whole_rollout_last_frame_cache_return_vs_truth_db'])} | "
        f"{_f(fr['full_cache_return_vs_truth_db'] - fr['whole_rollout_last_frame_cache_return_vs_truth_db'])} |",
        "",
        f"Return-leg gain minus outbound-leg gain: {_f(tf['value_db'])} dB (the bar: mean of per-frame PSNR); "
        f"{_f(tf['pooled_value_db'])} dB with the PSNR of the pooled error, the aggregate of bars 1 and 2. The "
        "two differ because dwell frames, where the camera stands still and both caches nearly copy the last "
        "frame, score 40+ dB: a per-frame mean weighs a change in those near-zero errors like one in the return "
        "frame's. For context: ground-truth "
        f"revisit PSNR {_f(fr['ground_truth_db'])} dB (the return pose is exact). Self-consistency "
        "compares two generated frames, so a rollout that has gone grey scores high with or without memory: "
        "with the last-frame cache for the whole rollout the model loses the scene at the first turn away "
        "(it cannot know the views coming into sight, predicts their mean) and its grey frames match each "
        "other; the bar's last-frame arm therefore shares the full-cache rollout up to each episode's largest "
        "turn and differs only in what the cache holds on the way back.",
        "", "## Speed and determinism", "",
        "| torch threads | ms / frame |", "|---:|---:|",
    ]
    lines += [f"| {r['threads']} | {r['ms_per_frame']:.2f} |" for r in report["speed"]["runs"]]
    sp, det = report["speed"], report["determinism"]
    lines += ["", f"Batch 1, {sp['frames']} frames ({sp['trajectory']['family']} seed {sp['trajectory']['seed']}), "
              f"median of {sp['repeats']} after a {sp['warmup_frames']}-frame warmup. Determinism: identical = "
              f"{det['identical']} (max |diff| {det['max_abs_diff']:g}).", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default=None, help="TinyWorld weights (default: the shipped file)")
    parser.add_argument("--out", default="artifacts/benchmarks", help="folder for tinyworld.json and tinyworld.md")
    parser.add_argument("--num-trajectories", type=int, default=8, help="trajectories per family")
    parser.add_argument("--num-frames", type=int, default=96, help="frames per trajectory (64+ for the bars)")
    parser.add_argument("--memory-trajectories", type=int, default=8, help="revisit trajectories for the memory bars")
    parser.add_argument("--speed-frames", type=int, default=256, help="frames of the timed rollout")
    args = parser.parse_args(argv)

    default_threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        weights = Path(args.weights) if args.weights else default_weights_path()
        model = load_weights(weights)
        body = benchmark(
            model, num_trajectories=args.num_trajectories, num_frames=args.num_frames,
            num_memory_trajectories=args.memory_trajectories, speed_frames=args.speed_frames,
            default_threads=default_threads,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "weights": {"path": os.path.relpath(weights), "fingerprint": weights_fingerprint(model)},
        "config": {
            "split": SPLIT, "seed_range": list(SEED_RANGES[SPLIT]), "num_trajectories": args.num_trajectories,
            "num_frames": args.num_frames, "memory_trajectories": args.memory_trajectories,
            "speed_frames": args.speed_frames, "window": DEFAULT_WINDOW, "sink_frames": DEFAULT_SINK,
            "default_threads": default_threads,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        },
        "elapsed_s": time.perf_counter() - start,
        **body,
    }
    out = Path(args.out)
    markdown = render_markdown(report)
    write_text_atomic(out / "tinyworld.json", json.dumps(report, indent=2, allow_nan=False) + "\n")
    write_text_atomic(out / "tinyworld.md", markdown)
    print(markdown)
    print(f"wrote {out / 'tinyworld.json'} and {out / 'tinyworld.md'}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sys.exit(main())
