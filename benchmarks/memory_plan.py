"""Memory plans at equal device bytes: window x bits x host tier x recall by pose, on long returns.

    OMP_NUM_THREADS=1 python -m benchmarks.memory_plan [--num-trajectories 8] [--num-frames 512]
                                                       [--recipe recipes/tinyworld-ours-2bit.safetensors]
                                                       [--out artifacts/benchmarks]

Writes ``memory_plan.json``, ``memory_plan.md`` and ``memory_plan.png`` into ``--out`` and prints
the table. Every plan gets the device budget of the float16 cache of window 16 + 1 sink (the
runtime refuses a plan over it) and rolls out, with the runtime (packed codes, the tiered
cache of calibrate/tiers.py), on held-out ``long_revisit`` trajectories (evaluation seeds): the
camera looks around, wanders away for 64-512 frames and comes back (snap or walk) to replay the
look-around. Frames are split into *returns* (a return to a pose seen >= 64 frames earlier:
``revisit_pairs``) and *other* frames (in no revisit pair).

Per plan:

- free rollout: return-to-view self-consistency (PSNR of a return frame against the same
  rollout's frame at the earlier visit), PSNR of return frames and of other frames vs truth;
- teacher-forced rollout (the true frame t-1 as input, so the cache holds what was really seen):
  PSNR vs truth of return and other frames. A free rollout invents what the camera had not seen
  and later returns can only be as true as that invention; teacher-forced, what memory returns
  is the truth, so this is where "return-view PSNR vs ground truth" can show memory;
- bytes per trajectory: the device tier (measured from the runtime's tensors at the end, and
  predicted), the host tier, and the traffic host -> device and device -> host per generated
  frame (also as a fraction of the device tier);
- ms per generated frame of the free rollout (CPU time of this process, batch of all trajectories).

Targets (issue 20): the best plan with recall beats the float16 window-16 cache by >= 5 dB on
returns (self-consistency, free; and PSNR vs truth, teacher-forced); other frames lose <= 0.5 dB
against it (PSNR vs truth, both arms). "Best" is the recall plan with the highest mean of its
return self-consistency gain and its other-frame gain (the plan search's score,
fit/plan_search.py), reported next to every plan. Misses are reported as they are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from calibrate.evaluate.metrics import json_safe, psnr
from calibrate.fit.plan_search import split_frames, with_plan
from calibrate.io import write_text_atomic
from calibrate.memory import fp16_cache_bytes, steady_state_frames
from calibrate.plan import MemoryPlan
from calibrate.recipe import load_recipe
from calibrate.fastcache import FastKVCache
from calibrate.schemes import build_baseline
from calibrate.tiers import predicted_host_bytes, steady_device_bytes
from calibrate.types import weights_fingerprint
from calibrate.adapters import TinyWorldAdapter
from calibrate.world.render import make_scene, render_batch
from calibrate.world.rollout import rollout
from calibrate.world.trajectories import SEED_RANGES, STEP_LIMITS, make_trajectories
from calibrate.world.weights import default_weights_path, load_weights

COMMAND = "python -m benchmarks.memory_plan"
SPLIT = "evaluation"
REF_WINDOW, REF_SINKS = 16, 1
HOST_FRAMES = 1024
RETURN_GAIN_DB = 5.0
OTHER_LOSS_DB = 0.5


@dataclass(frozen=True)
class PlanSpec:
    scheme: str  # "fp16" or "ours" (the recipe given)
    window: int
    recall_slots: int = 0

    @property
    def name(self) -> str:
        return f"{self.scheme}/w{self.window}+{REF_SINKS}s" + (f"+{self.recall_slots}r" if self.recall_slots else "")


PLANS = (
    PlanSpec("fp16", 16),  # the reference: what the budget is quoted from
    PlanSpec("fp16", 8, 8),
    PlanSpec("fp16", 4, 12),
    PlanSpec("ours", 16),  # the predictive codes run only at the window they were fitted for (16)
    PlanSpec("ours", 16, 16),
)


def run_plan(model, recipe, trajs, poses, actions, truth, teacher_forced: bool) -> tuple[torch.Tensor, dict]:
    plan = recipe.scheme.policy.plan
    cache = FastKVCache.from_recipe(recipe, plan.window, plan.sink_frames, "cpu")
    start = time.process_time()
    frames = rollout(model, cache, truth[:, 0], poses, actions, truth if teacher_forced else None)
    seconds = time.process_time() - start
    B, n = len(trajs), cache.num_frames_seen
    tiers = cache.tiers
    bytes_ = {"device_measured": cache.nbytes() / B, "device_predicted": cache.predicted_nbytes(n, B) / B,
              "device_steady": steady_device_bytes(recipe.model, recipe.scheme, plan),
              "host_measured": (tiers.host.nbytes() if tiers else 0) / B,
              "host_predicted": predicted_host_bytes(recipe.model, recipe.scheme, plan, n, B) / B if tiers else 0,
              "h2d_per_frame": (tiers.bytes_to_device if tiers else 0) / B / (n - 1 if n > 1 else 1),
              "d2h_per_frame": (tiers.bytes_to_host if tiers else 0) / B / (n - 1 if n > 1 else 1),
              "ms_per_frame": 1000 * seconds / max(poses.shape[1] - 1, 1)}
    return frames, bytes_


def arrival_kind(traj, t: int) -> str:
    """'snap' when the camera reached frame t in one step beyond the family's limits, else 'gradual'."""
    p = traj.poses.double()
    move = (p[t, :2] - p[t - 1, :2]).norm().item()
    turn = abs(math.degrees(math.remainder(p[t, 2].item() - p[t - 1, 2].item(), 2 * math.pi)))
    max_move, max_turn = STEP_LIMITS["long_revisit"]
    return "snap" if move > max_move + 1e-5 or turn > max_turn + 1e-3 else "gradual"


def scores(frames, truth, trajs) -> dict:
    """Means over return frames (and, for information, over arrivals: the first frame of each
    return, by snap or gradual) and over other frames."""
    values: dict[str, list[float]] = {}
    for b, traj in enumerate(trajs):
        returns, others = split_frames(traj)
        starts = {t for t, _ in returns} - {t + 1 for t, _ in returns}
        gt = psnr(frames[b], truth[b])
        for t, s in returns:
            cons = psnr(frames[b, t:t + 1], frames[b, s:s + 1]).item()
            groups = ["return"] + ([f"arrival_{arrival_kind(traj, t)}"] if t in starts else [])
            for group in groups:
                values.setdefault(f"{group}_consistency", []).append(cons)
                values.setdefault(f"{group}_truth", []).append(gt[t].item())
        values.setdefault("other_truth", []).extend(gt[t].item() for t in others)
    out = {k: json_safe(sum(v) / len(v)) for k, v in values.items()}
    out.update({f"num_{k[:-len('_truth')]}": len(v) for k, v in values.items() if k.endswith("_truth")})
    out["num_returns"] = out.pop("num_return", 0)
    return out


def benchmark(model, ours, num_trajectories: int, num_frames: int, log=print) -> dict:
    info = TinyWorldAdapter(model).info
    budget = fp16_cache_bytes(info, steady_state_frames(REF_WINDOW, REF_SINKS), REF_WINDOW, REF_SINKS)
    recipes = {"fp16": build_baseline("fp16", info), "ours": ours}
    trajs = make_trajectories("long_revisit", SPLIT, num_trajectories, num_frames)
    poses = torch.stack([t.poses for t in trajs])
    actions = torch.stack([t.actions for t in trajs])
    truth = render_batch([make_scene(t.seed) for t in trajs], poses)
    rows = {}
    for spec in PLANS:
        plan = MemoryPlan(budget, window=spec.window, sink_frames=REF_SINKS, recall_slots=spec.recall_slots,
                          host_frames=HOST_FRAMES if spec.recall_slots else 0)
        recipe = with_plan(recipes[spec.scheme], plan)
        row = {"scheme": spec.scheme, "window": spec.window, "sinks": REF_SINKS, "recall_slots": spec.recall_slots,
               "host_frames": plan.host_frames}
        for arm, tf in (("free", False), ("teacher_forced", True)):
            frames, bytes_ = run_plan(model, recipe, trajs, poses, actions, truth, tf)
            row[arm] = scores(frames, truth, trajs)
            row.setdefault("bytes", bytes_)
            row[f"{arm}_ms_per_frame"] = bytes_["ms_per_frame"]
            log(f"{spec.name} {arm}: {row[arm]} ({bytes_['ms_per_frame']:.0f} ms/frame)")
        rows[spec.name] = row
    ref = rows[PLANS[0].name]
    for row in rows.values():
        row["gains"] = {
            "return_consistency_db": row["free"]["return_consistency"] - ref["free"]["return_consistency"],
            "return_truth_free_db": row["free"]["return_truth"] - ref["free"]["return_truth"],
            "return_truth_tf_db": row["teacher_forced"]["return_truth"] - ref["teacher_forced"]["return_truth"],
            "other_truth_free_db": row["free"]["other_truth"] - ref["free"]["other_truth"],
            "other_truth_tf_db": row["teacher_forced"]["other_truth"] - ref["teacher_forced"]["other_truth"]}
        g = row["gains"]
        row["score_db"] = (g["return_consistency_db"] + g["other_truth_free_db"]) / 2
    recall = {n: r for n, r in rows.items() if r["recall_slots"]}
    best = max(recall, key=lambda n: recall[n]["score_db"])
    g = rows[best]["gains"]
    targets = [
        {"target": f"returns: self-consistency (free) >= +{RETURN_GAIN_DB:g} dB over fp16 w16", "value": g["return_consistency_db"],
         "met": g["return_consistency_db"] >= RETURN_GAIN_DB},
        {"target": f"returns: PSNR vs truth (teacher-forced) >= +{RETURN_GAIN_DB:g} dB over fp16 w16", "value": g["return_truth_tf_db"],
         "met": g["return_truth_tf_db"] >= RETURN_GAIN_DB},
        {"target": f"returns: PSNR vs truth (free) >= +{RETURN_GAIN_DB:g} dB over fp16 w16", "value": g["return_truth_free_db"],
         "met": g["return_truth_free_db"] >= RETURN_GAIN_DB},
        {"target": f"other frames: PSNR vs truth (free) loses <= {OTHER_LOSS_DB:g} dB", "value": g["other_truth_free_db"],
         "met": g["other_truth_free_db"] >= -OTHER_LOSS_DB},
        {"target": f"other frames: PSNR vs truth (teacher-forced) loses <= {OTHER_LOSS_DB:g} dB", "value": g["other_truth_tf_db"],
         "met": g["other_truth_tf_db"] >= -OTHER_LOSS_DB},
        {"target": "every plan's device tier within the budget; measured bytes == predicted", "value": None,
         "met": all(r["bytes"]["device_steady"] <= budget and r["bytes"]["device_measured"] == r["bytes"]["device_predicted"]
                    and r["bytes"]["host_measured"] == r["bytes"]["host_predicted"] for r in rows.values())},
    ]
    return {"budget_bytes": budget, "plans": rows, "best_recall_plan": best, "targets": targets,
            "trajectories": [[t.family, t.seed, t.num_frames] for t in trajs]}


def plot(report: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    panels = (("free", "return_consistency", "returns: self-consistency (free), dB"),
              ("teacher_forced", "return_truth", "returns: PSNR vs truth (teacher-forced), dB"),
              ("free", "other_truth", "other frames: PSNR vs truth (free), dB"))
    for i, (arm, key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 3, i + 1)
        for name, row in report["plans"].items():
            x, y = row["bytes"]["device_steady"] / 1024, row[arm][key]
            marker = "s" if row["scheme"] == "fp16" else ("o" if not row["recall_slots"] else "^")
            ax.scatter([x], [y], marker=marker, color="tab:red" if row["scheme"] == "fp16" else "tab:blue")
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axvline(report["budget_bytes"] / 1024, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("device tier, KiB per trajectory (budget dotted)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("Memory plans at the device budget of fp16 window 16 + 1 sink (squares fp16, triangles with recall)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# Memory plans at equal device bytes", "",
        f"- date: {report['date']}; wall time {report['elapsed_s'] / 60:.1f} min on a shared 2-core CPU "
        f"(load average at start {cfg['load_average']}), 1 torch thread; runtime: {cfg.get('runtime', 'fast')}",
        f"- command: `{report['command']}`",
        f"- weights `{cfg['weights']}`, recipe `{cfg['recipe']}` ({cfg['recipe_bits']:.3f} bits/element)",
        f"- held-out trajectories: {cfg['num_trajectories']} x {cfg['num_frames']} frames of `long_revisit` "
        f"(evaluation seeds {cfg['seeds'][0]}-{cfg['seeds'][-1]}); {report['plans'][next(iter(report['plans']))]['free']['num_returns']} "
        f"return frames (>= 64 frames away), "
        f"{report['plans'][next(iter(report['plans']))]['free']['num_other']} other frames",
        f"- device budget: {report['budget_bytes']} bytes per trajectory = the float16 cache of window 16 + 1 sink; "
        f"host tier {HOST_FRAMES} frames where a plan recalls; recall by pose, yaw_radius 1.0, reuse resident. "
        "The 2.5-bit recipe's predictive codes run only at the window they were fitted for (16: "
        "`memory.check_fitted_window`), so its plans vary the recall slots; float16 plans trade window for slots",
        "", "## Plans", "",
        "| plan | device KiB (steady) | host KiB (end) | H->D / frame | D->H / frame | returns: consistency (free) "
        "| returns vs truth (TF) | returns vs truth (free) | other vs truth (free) | other vs truth (TF) | score | ms/frame (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["plans"].items():
        b, g, fr, tf = r["bytes"], r["gains"], r["free"], r["teacher_forced"]
        h2d = f"{b['h2d_per_frame'] / 1024:.1f} KiB ({100 * b['h2d_per_frame'] / b['device_steady']:.1f}%)"
        d2h = f"{b['d2h_per_frame'] / 1024:.1f} KiB"
        lines.append(
            f"| {name}{' **(best recall)**' if name == report['best_recall_plan'] else ''} | {b['device_steady'] / 1024:.0f} "
            f"| {b['host_measured'] / 1024:.0f} | {h2d} | {d2h} "
            f"| {fr['return_consistency']:.2f} ({g['return_consistency_db']:+.2f}) "
            f"| {tf['return_truth']:.2f} ({g['return_truth_tf_db']:+.2f}) | {fr['return_truth']:.2f} ({g['return_truth_free_db']:+.2f}) "
            f"| {fr['other_truth']:.2f} ({g['other_truth_free_db']:+.2f}) | {tf['other_truth']:.2f} ({g['other_truth_tf_db']:+.2f}) "
            f"| {r['score_db']:+.2f} | {r['free_ms_per_frame']:.0f} |")
    lines += ["", "Arrivals (information): the first frame of each return, reached in one snap or by a walk "
              "(self-consistency free / PSNR vs truth teacher-forced, dB):", "",
              "| plan | snap: consistency | snap: vs truth (TF) | gradual: consistency | gradual: vs truth (TF) |",
              "|---|---:|---:|---:|---:|"]
    for name, r in report["plans"].items():
        fr, tf = r["free"], r["teacher_forced"]
        cells = [f"{d[k]:.2f}" if k in d else "-" for d, k in ((fr, "arrival_snap_consistency"), (tf, "arrival_snap_truth"),
                                                                (fr, "arrival_gradual_consistency"),
                                                                (tf, "arrival_gradual_truth"))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first = next(iter(report["plans"].values()))["free"]
    lines += ["", f"({first.get('num_arrival_snap', 0)} snap and {first.get('num_arrival_gradual', 0)} gradual arrivals.)"]
    lines += ["", "PSNR in dB, mean over frames; in brackets the gain over `fp16/w16+1s`. score = mean of the return "
              "self-consistency gain and the other-frame gain (free), the plan search's score. H->D: bytes recalled "
              "into the device tier per generated frame and per trajectory (in brackets, as a share of the device tier); "
              "D->H: bytes evicted to the host tier per frame (a predictive frame moves as an anchor). Device and host "
              "bytes: measured from the runtime's tensors at the end of the rollout "
              f"{'==' if report['targets'][-1]['met'] else '!='} the byte model's prediction.",
              "", "## Targets (best plan with recall: " + report["best_recall_plan"] + ")", "",
              "| target | value | met |", "|---|---:|---|"]
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:+.2f} dB"
        lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else '**NO**'} |")
    lines += ["", "![quality vs device bytes](memory_plan.png)", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default=None, help="TinyWorld weights (default: the shipped file)")
    parser.add_argument("--recipe", default="recipes/tinyworld-ours-2bit.safetensors")
    parser.add_argument("--out", default="artifacts/benchmarks")
    parser.add_argument("--num-trajectories", type=int, default=8)
    parser.add_argument("--num-frames", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    try:
        weights = Path(args.weights) if args.weights else default_weights_path()
        model = load_weights(weights)
        ours = load_recipe(args.recipe, TinyWorldAdapter(model).info)
        body = benchmark(model, ours, args.num_trajectories, args.num_frames,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lo = SEED_RANGES[SPLIT][0]
    report = {
        "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"weights": os.path.relpath(weights), "fingerprint": weights_fingerprint(model),
                   "recipe": args.recipe, "recipe_bits": json.loads(ours.metadata.get("memory", "{}")).get("bits_per_element", 0.0),
                   "num_trajectories": args.num_trajectories, "num_frames": args.num_frames,
                   "seeds": [lo, lo + args.num_trajectories - 1], "load_average": load, "torch_threads": 1},
        "elapsed_s": time.perf_counter() - start,
        **body,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(report, out / "memory_plan.png")
    markdown = render_markdown(report)
    write_text_atomic(out / "memory_plan.json", json.dumps(report, indent=2, allow_nan=False) + "\n")
    write_text_atomic(out / "memory_plan.md", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
