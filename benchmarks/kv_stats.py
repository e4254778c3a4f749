"""How much of a model's pre-rotary keys and values is content? Both models, per layer and family.

    python -m benchmarks.kv_stats [--models tinyworld,wanworld] [--num-trajectories 4]
                                  [--num-frames 96] [--start-frame 16] [--out artifacts/benchmarks]

Rolls each model out (full-precision cache, window 16, sink 1; held-out evaluation seeds) and
reads every appended frame's pre-rotary K and V at the cache seam (free rollouts: what a cache
holds in use; `--modes free,teacher_forced` adds rollouts whose cache holds the true frames, so
the keys of true content are measured apart from how well the model rolls out): `MomentCache` is a `KVCache`
whose `observe` folds them into streaming float64 moments; the model is not hooked. Frames
`--start-frame` on are counted (the cache's frame index: for TinyWorld the frame the step
reads, for WanWorld the latent frame itself). Per layer, head and K/V (x = one token's
head_dim vector; b trajectory, t frame, s token slot of the frame):

- ``changing``: the share of the variance that changes over time. The total sum of squares
  about the head's mean splits into the per-slot mean over time m_bs (what a slot always holds
  in one rollout: its position code, the scene's constant) and the rest, sum (x_bts - m_bs)^2:
  ``changing`` = rest / total.
- ``c80`` / ``c95``: principal components (of the head's covariance: centred) needed for 80% /
  95% of the variance; the JSON also has the uncentred count (of the second moment).
- ``max/med``: the largest channel's max |x| over the median channel's (outlier channels).
- ``delta``: consecutive-frame relative change, mean over (b, t) of ||x_t - x_{t-1}|| / ||x_{t-1}||
  (Frobenius over the frame's slots and channels).

Heads are averaged (c80/c95, changing: also the range over heads). Targets (issue 27): on the
moving families pan and orbit, WanWorld's K ``changing`` >= 30% and K ``c80`` >= 16, as reported
for real causal Wan models.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from benchmarks import command_line, write_report
from calibrate.cache import Attended, KVCache
from calibrate.io import write_text_atomic
from calibrate.world.trajectories import make_trajectories

log = logging.getLogger(__name__)

COMMAND = "python -m benchmarks.kv_stats"
FORMAT, FORMAT_VERSION = "kv-stats-benchmark", "1.0"
FAMILIES = ("orbit", "pan", "dolly", "random_walk", "stress", "static", "revisit")
MOVING = ("pan", "orbit")
TARGET_CHANGING, TARGET_C80 = 0.30, 16
WINDOW, SINK = 16, 1
MODES = ("free", "teacher_forced")
MODE_LABEL = {"free": "own frames", "teacher_forced": "true frames"}
CPU = torch.device("cpu")


class Moments:
    """Streaming float64 moments of one layer's K or V, [B, H, T, D] frames (B trajectories)."""

    def __init__(self):
        self.frames = 0
        self.slot_sum = self.slot_sq = self.total_sum = self.gram = self.absmax = self.prev = None
        self.delta_sum, self.delta_count = None, 0

    def update(self, x: Tensor) -> None:
        x = x.detach().double().cpu()
        if self.slot_sum is None:
            B, H, T, D = x.shape
            self.slot_sum, self.slot_sq = torch.zeros(B, H, T, D, dtype=torch.float64), torch.zeros(B, H, T, D, dtype=torch.float64)
            self.total_sum, self.gram = torch.zeros(H, D, dtype=torch.float64), torch.zeros(H, D, D, dtype=torch.float64)
            self.absmax, self.delta_sum = torch.zeros(H, D, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
        self.frames += 1
        self.slot_sum += x
        self.slot_sq += x * x
        self.total_sum += x.sum(dim=(0, 2))
        flat = x.permute(1, 0, 2, 3).flatten(1, 2)  # [H, B*T, D]
        self.gram += flat.transpose(1, 2) @ flat
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=(0, 2)))
        if self.prev is not None:
            change = (x - self.prev).flatten(2).norm(dim=-1) / self.prev.flatten(2).norm(dim=-1).clamp_min(1e-12)
            self.delta_sum += change.sum(dim=0)
            self.delta_count += x.shape[0]
        self.prev = x

    def summary(self) -> dict:
        B, H, T, D = self.slot_sum.shape
        count = B * T * self.frames
        mean_HD = self.total_sum / count
        total_H = (self.slot_sq.sum(dim=(0, 2)) - count * mean_HD**2).sum(-1)
        changing_H = (self.slot_sq - self.slot_sum**2 / self.frames).sum(dim=(0, 2, 3))
        cov = self.gram / count - mean_HD.unsqueeze(2) * mean_HD.unsqueeze(1)

        def needed(m: Tensor, share: float) -> list[int]:
            ev = torch.linalg.eigvalsh(m).flip(-1).clamp_min(0)
            frac = ev.cumsum(-1) / ev.sum(-1, keepdim=True)
            return [int((f < share - 1e-12).sum()) + 1 for f in frac]

        med = self.absmax.median(dim=-1).values
        return {
            "changing": (changing_H / total_H).tolist(),
            "c80": needed(cov, 0.80), "c95": needed(cov, 0.95),
            "c80_uncentred": needed(self.gram / count, 0.80), "c95_uncentred": needed(self.gram / count, 0.95),
            "max_over_median": (self.absmax.amax(-1) / med.clamp_min(1e-12)).tolist(),
            "delta": (self.delta_sum / max(self.delta_count, 1)).tolist(),
            "frames": self.frames, "trajectories": B, "tokens_per_frame": T, "head_dim": D,
        }


class MomentCache(KVCache):
    """The full-precision cache that folds every appended frame's pre-rotary K and V, from frame
    `start` on, into per-layer `Moments` (through `observe`: recording never changes a rollout)."""

    def __init__(self, num_layers: int, window: int, sink_frames: int, start: int):
        super().__init__(num_layers, window, sink_frames)
        self.start = start
        self.k = [Moments() for _ in range(num_layers)]
        self.v = [Moments() for _ in range(num_layers)]

    def observe(self, seen: Attended) -> None:
        if seen.index >= self.start:
            self.k[seen.layer].update(seen.k_BHTD)
            self.v[seen.layer].update(seen.v_BHTD)


class FrameRecorder(KVCache):
    """The full-precision cache that also keeps every appended frame's pre-rotary K and V as the model
    passed them, per (layer, "k" or "v"), oldest first (through `observe`: a rollout is unchanged)."""

    def __init__(self, num_layers: int, window: int, sink_frames: int):
        super().__init__(num_layers, window, sink_frames)
        self.frames: dict[tuple[int, str], list[Tensor]] = {}

    def observe(self, seen: Attended) -> None:
        self.frames.setdefault((seen.layer, "k"), []).append(seen.k_BHTD)
        self.frames.setdefault((seen.layer, "v"), []).append(seen.v_BHTD)


def run_study(module: str, argv: Sequence[str] | None, models: str, frames: int, start: int, out: str,
              measure: Callable[[str], dict], markdown: Callable[[list[dict], str, float], str]) -> int:
    """The rest of a K/V study's main once its arguments are parsed: `--frames` must leave frames
    after `start`; `measure` each of the comma-separated `models` (an unknown model, missing weights
    or recipe: one line, exit 2); `markdown(results, command, minutes)` written with the results as
    `<out>/<module>.md` and `.json`, atomically, and printed."""
    if frames <= start + 1:
        print(f"error: --frames must be above {start + 1} (frames {start} on are measured)", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        results = [measure(name) for name in models.split(",") if name]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = command_line(module, argv)
    md = markdown(results, command, (time.time() - t0) / 60)
    write_report(out, module, md, results)
    return 0


def load_world(name: str, weights: str | None = None):
    from calibrate.config import ModelConfig
    from calibrate.pipeline import load_adapter

    cfg = ModelConfig(name=name, weights=weights)
    if name == "wanworld":
        from benchmarks.wanworld import settings

        cfg.wan = settings()
    return load_adapter(cfg, CPU)


def measure(world, family: str, num_trajectories: int, num_frames: int, start: int, base_seed: int,
            teacher_forced: bool = False) -> list[dict]:
    trajs = make_trajectories([family], "evaluation", num_trajectories, num_frames, base_seed=base_seed)
    cache = MomentCache(world.info.num_layers, WINDOW, SINK, start)
    if not teacher_forced:
        world.rollout(trajs, cache, CPU, keep_frames=False)
    elif hasattr(world, "model"):  # TinyWorld: its rollout reads the true frame t-1 at every step
        from calibrate.world.rollout import rollout

        truth = world.ground_truth(trajs, CPU)
        rollout(world.model, cache, truth[:, 0], torch.stack([t.poses for t in trajs]),
                torch.stack([t.actions for t in trajs]), truth, keep_frames=False)
    else:  # Wan: the cache receives the true chunk after each generated one
        world.rollout(trajs, cache, CPU, keep_frames=False, teacher_forced=True)
    return [{"k": cache.k[layer].summary(), "v": cache.v[layer].summary()} for layer in range(world.info.num_layers)]


def mean(xs) -> float:
    return sum(xs) / len(xs)


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# K/V statistics: how much of the pre-rotary keys and values is content", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`",
             f"- held-out evaluation seeds (from offset {cfg['base_seed']}), {cfg['num_trajectories']} trajectories x "
             f"{cfg['num_frames']} frames per family, frames {cfg['start_frame']}+ counted; cache window {WINDOW}, sink {SINK}",
             f"- 1 torch thread, sharing the CPU with other jobs; wall time {report['elapsed_s']:.0f} s", "",
             "Per head: **changing** = share of the variance not explained by each token slot's mean over time; "
             "**c80/c95** = principal components (centred) for 80%/95% of the variance; **max/med** = largest "
             "channel's max |x| over the median channel's; **delta** = consecutive-frame relative change. "
             "Means over heads; changing also as min-max over heads. See benchmarks/kv_stats.py.", ""]
    lines += ["## Headline (mean over layers)", "",
              "| model | cache holds | family | K changing | K c80 / c95 | K max/med | K delta | V changing | V c80 / c95 | V max/med | V delta |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = [(m, MODE_LABEL[mode], f[mode]) for mode in MODES for m, f in report["models"].items() if mode in f]
    for model, mode, fams in rows:
        for fam, layers in fams.items():
            cells = []
            for kind in ("k", "v"):
                ch = mean([mean(l[kind]["changing"]) for l in layers])
                cells += [f"{100 * ch:.1f}%", f"{mean([mean(l[kind]['c80']) for l in layers]):.1f} / "
                          f"{mean([mean(l[kind]['c95']) for l in layers]):.1f}",
                          f"{mean([mean(l[kind]['max_over_median']) for l in layers]):.1f}",
                          f"{mean([mean(l[kind]['delta']) for l in layers]):.3f}"]
            lines.append(f"| {model} | {mode} | {fam} | " + " | ".join(cells) + " |")
    for mode, t in report.get("targets", {}).items():
        lines += ["", f"## Targets, {MODE_LABEL[mode]} in the cache (WanWorld, moving families: K changing >= 30% and "
                      f"K c80 >= 16, every layer)", "",
                  "| family | layer | K changing | K c80 | met |", "|---|---:|---:|---:|---|"]
        for row in t["rows"]:
            lines.append(f"| {row['family']} | {row['layer']} | {100 * row['changing']:.1f}% | {row['c80']:.1f} | "
                         f"{'yes' if row['met'] else 'no'} |")
        lines += ["", f"All met: **{'yes' if t['met'] else 'no'}**."]
    for model, entry in report["models"].items():
        info = entry["info"]
        for mode in (m for m in MODES if m in entry):
            lines += ["", f"## {model}: per layer, {MODE_LABEL[mode]} in the cache ({info['num_layers']} layers x "
                          f"{info['num_kv_heads']} heads x head_dim {info['head_dim']}, {info['tokens_per_frame']} tokens "
                          f"per frame)", "",
                      "| family | layer | K changing (min-max) | K c80 / c95 | K max/med | K delta | V changing (min-max) | V c80 / c95 | V max/med | V delta |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            lines += _layer_rows(entry[mode])
    return "\n".join(lines) + "\n"


def _layer_rows(fams: dict) -> list[str]:
    lines = []
    for fam, layers in fams.items():
        for i, l in enumerate(layers):
            cells = []
            for kind in ("k", "v"):
                s = l[kind]
                cells += [f"{100 * mean(s['changing']):.1f}% ({100 * min(s['changing']):.1f}-{100 * max(s['changing']):.1f})",
                          f"{mean(s['c80']):.1f} / {mean(s['c95']):.1f}", f"{mean(s['max_over_median']):.1f}",
                          f"{mean(s['delta']):.3f}"]
            lines.append(f"| {fam} | {i} | " + " | ".join(cells) + " |")
    return lines


def targets(fams: dict) -> dict:
    rows = []
    for fam in MOVING:
        for i, l in enumerate(fams[fam]):
            ch, c80 = mean(l["k"]["changing"]), mean(l["k"]["c80"])
            rows.append({"family": fam, "layer": i, "changing": ch, "c80": c80,
                         "met": ch >= TARGET_CHANGING and c80 >= TARGET_C80})
    return {"rows": rows, "met": all(r["met"] for r in rows)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tinyworld,wanworld")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--num-trajectories", type=int, default=4)
    parser.add_argument("--num-frames", type=int, default=96)
    parser.add_argument("--start-frame", type=int, default=16)
    parser.add_argument("--base-seed", type=int, default=0, help="offset into the evaluation seed range")
    parser.add_argument("--modes", default="free", help=f"any of {', '.join(MODES)} (comma-separated)")
    parser.add_argument("--wanworld-weights", default=None, help="WanWorld weights (default: the shipped file)")
    parser.add_argument("--out", default="artifacts/benchmarks")
    args = parser.parse_args(argv)
    if any(m not in MODES for m in args.modes.split(",")):
        print(f"error: --modes must be a comma-separated subset of {', '.join(MODES)}", file=sys.stderr)
        return 2
    if args.num_frames <= args.start_frame + 1:
        print("error: --num-frames must exceed --start-frame + 1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    models = {}
    for name in args.models.split(","):
        world = load_world(name, args.wanworld_weights if name == "wanworld" else None)
        info = world.info
        models[name] = {"info": {"num_layers": info.num_layers, "num_kv_heads": info.num_kv_heads, "head_dim": info.head_dim,
                                 "tokens_per_frame": info.tokens_per_frame, "fingerprint": info.fingerprint}}
        for mode in args.modes.split(","):
            fams = {}
            for i, fam in enumerate(args.families.split(",")):
                fams[fam] = measure(world, fam, args.num_trajectories, args.num_frames, args.start_frame,
                                    args.base_seed + i * args.num_trajectories, teacher_forced=mode == "teacher_forced")
                log.info("%s %s %s: %.0f s", name, mode, fam, time.perf_counter() - start)
            models[name][mode] = fams
    report = {"format": FORMAT, "format_version": FORMAT_VERSION,
              "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": {"modes": args.modes.split(","), "num_trajectories": args.num_trajectories, "num_frames": args.num_frames,
                         "start_frame": args.start_frame, "base_seed": args.base_seed, "window": WINDOW, "sink": SINK},
              "elapsed_s": time.perf_counter() - start, "models": models}
    if "wanworld" in models:
        report["targets"] = {mode: targets(fams) for mode, fams in models["wanworld"].items()
                             if mode in MODES and all(f in fams for f in MOVING)}
    out = Path(args.out)
    markdown = render_markdown(report)
    write_text_atomic(out / "kv_stats.json", json.dumps(report, indent=2, allow_nan=False) + "\n")
    write_text_atomic(out / "kv_stats.md", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sys.exit(main())
