"""Does WanWorld meet its bars? Measured on held-out rooms (the evaluation seed range).

    python -m benchmarks.wanworld [--weights PATH] [--out artifacts/benchmarks]
                                  [--num-trajectories N] [--num-frames N] [--memory-trajectories N]

Writes ``wanworld.json`` and ``wanworld.md`` into ``--out`` and prints the table. Numbers are
reported as measured; a bar that fails is reported as failing. WanWorld's latents are a
space-to-depth of the RGB frames (calibrate/wanworld/latents.py), so every PSNR here is the RGB
frames' PSNR. The rollouts are the `wan_diffusers` adapter's (`model=wanworld`): frame 0 is the
given true frame, each later frame is sampled in 4 flow-matching steps with seeded noise.

The bars mirror benchmarks/tinyworld.py (bar families orbit, dolly, pan, random_walk; revisit,
stress and static are reported for information):

1. ``one_step``: teacher-forced (the cache holds the true frames 0..t-1, frame t is sampled),
   PSNR of frames 1..N-1 pooled over frames and trajectories, against copying the previous true
   frame; gain > 0 dB on every bar family.
2. ``rollout_1_64``: free rollout against holding the first frame, frames 1-64 pooled; gain
   > 0 dB on every bar family (frames 1-16, 17-64 and 65+ are reported).
3. Memory through the cache on the turn-away-and-return episodes of ``revisit``: the default
   cache (window 16, sink 1) against one that holds only the newest frame. In Wan's rollout a
   chunk is appended *after* it is generated and the window counts the chunk being generated,
   so "newest frame only" is window 2, sink 0 (window 1 would leave the denoising passes no
   history at all; TinyWorld's window 1 holds the newest frame because its step appends the
   previous frame). ``memory_teacher_forced``: return-leg gain minus outbound-leg gain (mean of
   per-frame PSNR vs truth), >= 3 dB as TinyWorld's; ``memory_rollout``: return-to-view
   self-consistency, full minus newest-frame cache, the latter branching off the full-cache
   rollout at each episode's largest turn, >= 3 dB as TinyWorld's (see benchmarks/tinyworld.py).
4. ``determinism``: two free rollouts of one trajectory give identical frames (torch.equal).

Speed (ms per generated frame, batch 1, 4 denoising passes + 1 clean pass) is reported for
information, with no bar.
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

from benchmarks.tinyworld import _bar, _f, _gain, _mean, _yn, pooled_psnr, turn_away_episodes
from calibrate.adapters.wan_diffusers import WanAdapter, WanSettings
from calibrate.cache import KVCache
from calibrate.evaluate.metrics import json_safe, psnr, window_label
from calibrate.io import write_text_atomic
from calibrate.types import Trajectory
from calibrate.wanworld.weights import default_weights_path, load_adapter
from calibrate.world.trajectories import FAMILIES, SEED_RANGES, make_trajectories, make_trajectory, wrap_angle

log = logging.getLogger(__name__)

FORMAT = "wanworld-benchmark"
FORMAT_VERSION = "1.0"
COMMAND = "python -m benchmarks.wanworld"
SPLIT = "evaluation"
BAR_FAMILIES = ("orbit", "dolly", "pan", "random_walk")
DEFAULT_WINDOW, DEFAULT_SINK = 16, 1
NEWEST_WINDOW, NEWEST_SINK = 2, 0  # Wan: the window counts the chunk being generated (module docstring)
ROLLOUT_WINDOWS: tuple[tuple[int, int | None], ...] = ((1, 16), (17, 64), (65, None))
MIN_FRAMES = 18
ONE_STEP_MIN_GAIN_DB = 0.0  # strictly >
ROLLOUT_MIN_GAIN_DB = 0.0  # strictly >
MEMORY_MIN_GAIN_DB = 3.0
TURN_AWAY_DEG = 60.0
SPEED_REPEATS = 3
CPU = torch.device("cpu")


def settings() -> WanSettings:
    """The `model=wanworld` preset's rollout settings (conf/model/wanworld.yaml)."""
    return WanSettings(chunk_frames=1, latent_height=16, latent_width=16)


def run(adapter: WanAdapter, trajs: Sequence[Trajectory], truth: Tensor, window: int, sink: int,
        teacher_forced: bool = False) -> Tensor:
    cache = KVCache(adapter.info.num_layers, window, sink)
    return adapter.rollout(list(trajs), cache, CPU, truth=truth, teacher_forced=teacher_forced)


def one_step_table(adapter: WanAdapter, groups: dict[str, tuple[list, Tensor]], window: int, sink: int) -> dict:
    table = {}
    for family, (trajs, g) in groups.items():
        pred = run(adapter, trajs, g, window, sink, teacher_forced=True)
        row = _gain(pooled_psnr(pred[:, 1:], g[:, 1:]), pooled_psnr(g[:, :-1], g[:, 1:]))
        row["pass"] = row["gain_db"] > ONE_STEP_MIN_GAIN_DB
        model_BN, copy_BN = psnr(pred[:, 1:], g[:, 1:]), psnr(g[:, :-1], g[:, 1:])
        moving_BN = (g[:, 1:] != g[:, :-1]).flatten(2).any(dim=-1)
        row["num_still_frames"] = int((~moving_BN).sum())
        row["moving_frames"] = _gain(_mean(model_BN[moving_BN]), _mean(copy_BN[moving_BN])) if moving_BN.any() else None
        table[family] = row
    return table


def rollout_table(adapter: WanAdapter, groups: dict[str, tuple[list, Tensor]], window: int, sink: int) -> dict:
    table = {}
    for family, (trajs, g) in groups.items():
        pred = run(adapter, trajs, g, window, sink)
        hold = g[:, :1].expand_as(g)
        windows = {}
        for start, stop in ((1, 64),) + ROLLOUT_WINDOWS:
            if start < g.shape[1]:
                sl = slice(start, None if stop is None else stop + 1)
                windows[window_label(start, stop)] = _gain(pooled_psnr(pred[:, sl], g[:, sl]), pooled_psnr(hold[:, sl], g[:, sl]))
        table[family] = {"windows": windows, "pass_1_64": windows["1-64"]["gain_db"] > ROLLOUT_MIN_GAIN_DB}
    return table


def memory_bars(adapter: WanAdapter, trajs: list[Trajectory], g: Tensor, window: int, sink: int) -> dict:
    """Full cache vs newest-frame cache on turn-away-and-return episodes (benchmarks/tinyworld.py's
    `memory_bars`, with Wan's rollout)."""
    episodes = [turn_away_episodes(t) for t in trajs]
    return_BN = torch.zeros(g.shape[:2], dtype=torch.bool)
    outbound_BN, snap_BN = torch.zeros_like(return_BN), torch.zeros_like(return_BN)
    for b, eps in enumerate(episodes):
        poses = trajs[b].poses
        for j, turn, i in eps:
            outbound_BN[b, j + 1 : turn + 1] = True
            return_BN[b, turn + 1 : i + 1] = True
            snap_BN[b, i] = abs(wrap_angle(poses[i, 2] - poses[i - 1, 2]).item()) >= math.radians(TURN_AWAY_DEG) / 2

    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values) if values else math.nan

    def pair_psnr(frames: Tensor, reference: Tensor) -> float:
        return mean(psnr(frames[b, i : i + 1], reference[b, j : j + 1]).item() for b, eps in enumerate(episodes) for j, _, i in eps)

    caches = {"full_cache": (window, sink), "newest_frame_cache": (NEWEST_WINDOW, NEWEST_SINK)}
    tf = {}
    for name, (w, s) in caches.items():
        tf_BN = psnr(run(adapter, trajs, g, w, s, teacher_forced=True), g)
        tf[name] = {"return_db": mean(tf_BN[return_BN].tolist()), "outbound_db": mean(tf_BN[outbound_BN].tolist()),
                    "snap_return_frame_db": mean(tf_BN[snap_BN].tolist())}
    full = run(adapter, trajs, g, window, sink)
    branch = full.clone()
    for b, eps in enumerate(episodes):
        for _, turn, i in eps:
            t = trajs[b]
            leg = Trajectory(t.family, t.seed, t.poses[turn : i + 1], t.actions[turn : i + 1])
            out = run(adapter, [leg], full[b : b + 1, turn : turn + 1], NEWEST_WINDOW, NEWEST_SINK)
            branch[b, turn + 1 : i + 1] = out[0, 1:]
    return_gain = tf["full_cache"]["return_db"] - tf["newest_frame_cache"]["return_db"]
    outbound_gain = tf["full_cache"]["outbound_db"] - tf["newest_frame_cache"]["outbound_db"]
    truth_psnr = lambda f: mean(psnr(f[b, i : i + 1], g[b, i : i + 1]).item() for b, eps in enumerate(episodes) for _, _, i in eps)
    return {
        "teacher_forced": {**{n: {k: json_safe(v) for k, v in legs.items()} for n, legs in tf.items()},
                           "return_gain_db": json_safe(return_gain), "outbound_gain_db": json_safe(outbound_gain),
                           "value_db": json_safe(return_gain - outbound_gain),
                           "num_return_frames": int(return_BN.sum()), "num_outbound_frames": int(outbound_BN.sum()),
                           "num_snap_returns": int(snap_BN.sum())},
        "rollout": {"full_cache_db": json_safe(pair_psnr(full, full)),
                    "newest_frame_cache_db": json_safe(pair_psnr(branch, branch)),
                    "gain_db": json_safe(pair_psnr(full, full) - pair_psnr(branch, branch)),
                    "full_cache_return_vs_truth_db": json_safe(truth_psnr(full)),
                    "newest_frame_cache_return_vs_truth_db": json_safe(truth_psnr(branch)),
                    "num_pairs": sum(len(eps) for eps in episodes)},
    }


def speed(adapter: WanAdapter, traj: Trajectory, window: int, sink: int) -> float:
    """Median ms per generated frame of a batch-1 free rollout (after one warmup rollout)."""
    truth = adapter.world.ground_truth([traj], CPU, 1)
    run(adapter, [make_trajectory(traj.family, traj.seed, 8)], truth, window, sink)
    times = []
    for _ in range(SPEED_REPEATS):
        t0 = time.perf_counter()
        run(adapter, [traj], truth, window, sink)
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times) / max(traj.num_frames - 1, 1)


def determinism(adapter: WanAdapter, traj: Trajectory, window: int, sink: int) -> dict:
    a = adapter.rollout([traj], KVCache(adapter.info.num_layers, window, sink), CPU)
    b = adapter.rollout([traj], KVCache(adapter.info.num_layers, window, sink), CPU)
    return {"identical": bool(torch.equal(a, b)), "max_abs_diff": float((a - b).abs().max())}


def benchmark(adapter: WanAdapter, *, num_trajectories: int, num_frames: int, num_memory_trajectories: int,
              speed_frames: int, families: Sequence[str] = FAMILIES, window: int = DEFAULT_WINDOW,
              sink_frames: int = DEFAULT_SINK) -> dict:
    if num_trajectories < 1 or num_memory_trajectories < 1:
        raise ValueError("--num-trajectories and --memory-trajectories must be >= 1")
    if num_frames < MIN_FRAMES:
        raise ValueError(f"--num-frames must be >= {MIN_FRAMES}")
    trajs = make_trajectories(list(families), SPLIT, num_trajectories * len(families), num_frames)
    groups = {}
    for f in families:
        ts = [t for t in trajs if t.family == f]
        groups[f] = (ts, adapter.world.ground_truth(ts, CPU))
    next_seed = len(trajs)
    mem = make_trajectories(["revisit"], SPLIT, num_memory_trajectories, num_frames, base_seed=next_seed)
    speed_traj = make_trajectory("random_walk", SEED_RANGES[SPLIT][0] + next_seed + num_memory_trajectories, speed_frames)
    t0 = time.perf_counter()
    one_step = one_step_table(adapter, groups, window, sink_frames)
    log.info("one-step table: %.1f s", time.perf_counter() - t0)
    roll = rollout_table(adapter, groups, window, sink_frames)
    log.info("rollout table: %.1f s", time.perf_counter() - t0)
    memory = memory_bars(adapter, mem, adapter.world.ground_truth(mem, CPU), window, sink_frames)
    log.info("memory bars: %.1f s", time.perf_counter() - t0)
    ms = speed(adapter, speed_traj, window, sink_frames)
    gated = [f for f in BAR_FAMILIES if f in groups]
    if not gated:
        raise ValueError(f"--families must include a bar family ({', '.join(BAR_FAMILIES)})")
    det = determinism(adapter, groups[gated[0]][0][0], window, sink_frames)
    bars = {
        "one_step": _bar("teacher-forced gain over copy-previous-frame, worst bar family",
                         min(one_step[f]["gain_db"] for f in gated), ONE_STEP_MIN_GAIN_DB, ">", "dB",
                         all(one_step[f]["pass"] for f in gated)),
        "rollout_1_64": _bar("free-rollout gain over hold-first-frame in frames 1-64, worst bar family",
                             min(roll[f]["windows"]["1-64"]["gain_db"] for f in gated), ROLLOUT_MIN_GAIN_DB, ">", "dB",
                             all(roll[f]["pass_1_64"] for f in gated)),
        "memory_teacher_forced": _bar(
            "revisit, teacher-forced: (window 16 - newest-frame cache) gain on return legs minus on outbound legs",
            memory["teacher_forced"]["value_db"], MEMORY_MIN_GAIN_DB, ">=", "dB",
            memory["teacher_forced"]["value_db"] >= MEMORY_MIN_GAIN_DB),
        "memory_rollout": _bar(
            "revisit, free rollout: return-to-view self-consistency, window 16 minus newest-frame cache",
            memory["rollout"]["gain_db"], MEMORY_MIN_GAIN_DB, ">=", "dB", memory["rollout"]["gain_db"] >= MEMORY_MIN_GAIN_DB),
        "determinism": _bar("two free rollouts of one trajectory: max abs difference (0 = identical)",
                            det["max_abs_diff"], 0.0, "==", "", det["identical"]),
    }
    return {"bars": bars, "pass": all(b["pass"] for b in bars.values()), "bar_families": list(gated),
            "one_step": one_step, "rollout": roll, "memory": memory,
            "speed": {"frames": speed_frames, "ms_per_frame": ms, "threads": torch.get_num_threads(),
                      "trajectory": {"family": speed_traj.family, "seed": speed_traj.seed}},
            "determinism": det}


def render_markdown(report: dict) -> str:
    cfg, w = report["config"], report["weights"]
    lines = [
        "# WanWorld benchmark", "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- weights: `{w['path']}` (fingerprint `{w['fingerprint']}`)",
        f"- held-out seeds: {cfg['split']} range; {cfg['num_trajectories']} trajectories x {cfg['num_frames']} frames "
        f"per family, {cfg['memory_trajectories']} revisit trajectories for memory; cache window {cfg['window']}, "
        f"sink {cfg['sink_frames']}; sampler timesteps {cfg['denoise_timesteps']}, shift {cfg['shift']}",
        f"- torch threads: {cfg['threads']} (sharing the CPU with other jobs); load average at start: "
        f"{cfg['load_average']}; wall time {report['elapsed_s']:.0f} s",
        f"- overall: **{_yn(report['pass'])}**", "",
        "## Bars", "",
        "| bar | value | needs | result | what |",
        "|---|---:|---:|---|---|",
    ]
    for name, b in report["bars"].items():
        lines.append(f"| {name} | {b['value']:.3g} {b['unit']} | {b['comparison']} {b['threshold']:g} | "
                     f"{_yn(b['pass'])} | {b['description']} |")
    gated = set(report["bar_families"])
    trio = lambda g: "n/a" if g is None else f"{_f(g['model_db'])} / {_f(g['baseline_db'])} / {_f(g['gain_db'])}"
    lines += ["", "## One step (teacher-forced) vs copy previous true frame, PSNR dB", "",
              "| family | model | copy prev | gain | bar | still frames | moving frames only, per-frame mean: model / copy / gain |",
              "|---|---:|---:|---:|---|---:|---:|"]
    for fam, r in report["one_step"].items():
        lines.append(f"| {fam} | {_f(r['model_db'])} | {_f(r['baseline_db'])} | {_f(r['gain_db'])} | "
                     f"{_yn(r['pass'] if fam in gated else None)} | {r['num_still_frames']} | {trio(r['moving_frames'])} |")
    lines += ["", "PSNR of the squared error pooled over frames and trajectories (as in tinyworld.md)."]
    labels = list(next(iter(report["rollout"].values()))["windows"])
    lines += ["", "## Free rollout vs hold first frame, PSNR dB (model / hold / gain)", "",
              "| family | " + " | ".join(f"frames {lab}" for lab in labels) + " | bar 1-64 |",
              "|---|" + "---:|" * len(labels) + "---|"]
    for fam, r in report["rollout"].items():
        cells = [trio(c) for c in r["windows"].values()]
        lines.append(f"| {fam} | " + " | ".join(cells + [_yn(r["pass_1_64"] if fam in gated else None)]) + " |")
    tf, fr = report["memory"]["teacher_forced"], report["memory"]["rollout"]
    full, newest = tf["full_cache"], tf["newest_frame_cache"]
    lines += [
        "", "## Memory on revisit (turn-away-and-return episodes): window 16 + sink vs newest frame only, PSNR dB", "",
        "| measure | window 16 | newest frame | gain |", "|---|---:|---:|---:|",
        f"| teacher-forced, return legs ({tf['num_return_frames']} frames) | {_f(full['return_db'])} | "
        f"{_f(newest['return_db'])} | {_f(tf['return_gain_db'])} |",
        f"| teacher-forced, outbound legs ({tf['num_outbound_frames']} frames) | {_f(full['outbound_db'])} | "
        f"{_f(newest['outbound_db'])} | {_f(tf['outbound_gain_db'])} |",
        f"| teacher-forced, return frame after a snap return ({tf['num_snap_returns']} frames, information) | "
        f"{_f(full['snap_return_frame_db'])} | {_f(newest['snap_return_frame_db'])} | "
        f"{_f(full['snap_return_frame_db'] - newest['snap_return_frame_db'])} |",
        f"| rollout, return vs earlier view ({fr['num_pairs']} episodes; newest-frame arm cut at the largest turn) | "
        f"{_f(fr['full_cache_db'])} | {_f(fr['newest_frame_cache_db'])} | {_f(fr['gain_db'])} |",
        f"| rollout, return frame vs true view (information) | {_f(fr['full_cache_return_vs_truth_db'])} | "
        f"{_f(fr['newest_frame_cache_return_vs_truth_db'])} | "
        f"{_f(fr['full_cache_return_vs_truth_db'] - fr['newest_frame_cache_return_vs_truth_db'])} |",
        "", f"Return-leg gain minus outbound-leg gain: {_f(tf['value_db'])} dB (mean of per-frame PSNR). The newest-frame "
        "cache is window 2, sink 0 in Wan's rollout (see the script's docstring).",
        "", "## Speed and determinism", "",
        f"{report['speed']['ms_per_frame']:.1f} ms per generated frame (batch 1, {report['speed']['frames']} frames, "
        f"{report['speed']['threads']} torch thread(s), sharing the CPU with other jobs; 4 denoising passes + 1 clean "
        f"pass per frame; median of {SPEED_REPEATS}). Determinism: identical = {report['determinism']['identical']} "
        f"(max |diff| {report['determinism']['max_abs_diff']:g}).", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default=None, help="WanWorld weights (default: the shipped file)")
    parser.add_argument("--out", default="artifacts/benchmarks", help="folder for wanworld.json and wanworld.md")
    parser.add_argument("--num-trajectories", type=int, default=8, help="trajectories per family")
    parser.add_argument("--num-frames", type=int, default=96, help="frames per trajectory (65+ for every window)")
    parser.add_argument("--memory-trajectories", type=int, default=8, help="revisit trajectories for the memory bars")
    parser.add_argument("--speed-frames", type=int, default=64, help="frames of the timed rollout")
    parser.add_argument("--families", default=",".join(FAMILIES), help="families of the one-step and rollout tables")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        weights = Path(args.weights) if args.weights else default_weights_path()
        adapter = load_adapter(str(weights), settings(), CPU)
        body = benchmark(adapter, num_trajectories=args.num_trajectories, num_frames=args.num_frames,
                         num_memory_trajectories=args.memory_trajectories, speed_frames=args.speed_frames,
                         families=args.families.split(","))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    s = settings()
    report = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "weights": {"path": os.path.relpath(weights), "fingerprint": adapter.info.fingerprint},
        "config": {"split": SPLIT, "seed_range": list(SEED_RANGES[SPLIT]), "num_trajectories": args.num_trajectories,
                   "num_frames": args.num_frames, "memory_trajectories": args.memory_trajectories,
                   "window": DEFAULT_WINDOW, "sink_frames": DEFAULT_SINK, "denoise_timesteps": s.denoise_timesteps,
                   "shift": s.shift, "threads": torch.get_num_threads(),
                   "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None},
        "elapsed_s": time.perf_counter() - start,
        **body,
    }
    out = Path(args.out)
    markdown = render_markdown(report)
    write_text_atomic(out / "wanworld.json", json.dumps(report, indent=2, allow_nan=False) + "\n")
    write_text_atomic(out / "wanworld.md", markdown)
    print(markdown)
    print(f"wrote {out / 'wanworld.json'} and {out / 'wanworld.md'}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sys.exit(main())
