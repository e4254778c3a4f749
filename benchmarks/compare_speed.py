"""How much faster `task=compare` is than before the fast runtime: the same command, run in a
checkout of an earlier commit and in this tree, one after the other on this machine.

    OMP_NUM_THREADS=1 python -m benchmarks.compare_speed [--baseline 4092998] [--frames 48] [--repeats 2]

The command is the default comparison plus the shipped recipe (8 schemes: fp16, naive2, kivi2, kivi4,
quarot2, kvquant2, qvg2, ours) on the default 7 held-out trajectories cut to `--frames` frames,
without strips:

    python -m calibrate task=compare schemes=[...,ours] trajectories.num_frames=F eval.strips=false

Each tree runs its own code, its own TinyWorld weights and its own shipped recipe (the recipe's
tensors are the same in both). `--baseline` defaults to 4092998, main just before the fast runtime
(issue 18's "today"). The baseline is checked out with `git worktree add --detach` into a temporary
folder that is removed afterwards; run outputs go to temporary folders too. The two trees alternate,
`--repeats` times, and the best wall time of each is kept (a shared machine only ever adds time).
Writes `compare_speed.md` and `compare_speed.json` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from calibrate.io import write_text_atomic

BASELINE = "4092998"
SCHEMES = "[fp16,naive2,kivi2,kivi4,quarot2,kvquant2,qvg2,ours]"


def timed_compare(tree: Path, frames: int, out: Path) -> tuple[float, float]:
    """(wall s, CPU s of the child) of one `task=compare` run in `tree`."""
    cmd = [sys.executable, "-m", "calibrate", "task=compare", f"schemes={SCHEMES}",
           f"trajectories.num_frames={frames}", "eval.strips=false", f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = os.times()
    if proc.returncode != 0:
        sys.exit(f"compare_speed: task=compare failed in {tree} (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="the commit to compare against (default: before the fast runtime)")
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("artifacts/benchmarks"))
    args = parser.parse_args()
    here = Path.cwd()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    load0 = os.getloadavg()
    best = {}
    with tempfile.TemporaryDirectory(prefix="compare-speed-") as tmp:
        base_tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(base_tree), args.baseline], check=True)
        try:
            for r in range(args.repeats):
                for name, tree in (("baseline", base_tree), ("this tree", here)):
                    wall, cpu = timed_compare(tree, args.frames, Path(tmp) / f"run-{name.replace(' ', '-')}-{r}")
                    print(json.dumps({"tree": name, "repeat": r, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}), flush=True)
                    w0, c0 = best.get(name, (float("inf"), float("inf")))
                    best[name] = (min(w0, wall), min(c0, cpu))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], check=False)
    speedup = best["baseline"][0] / best["this tree"][0]
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "baseline": args.baseline, "head": head,
           "frames": args.frames, "repeats": args.repeats, "load_start": load0, "load_end": os.getloadavg(),
           "threads": os.environ.get("OMP_NUM_THREADS", "1"), "best": best, "speedup_wall": speedup}
    lines = [
        "# task=compare: this tree against the commit before the fast runtime",
        "",
        f"- date: {res['date']}; command: `OMP_NUM_THREADS={res['threads']} python -m benchmarks.compare_speed "
        f"--baseline {args.baseline} --frames {args.frames} --repeats {args.repeats}`",
        f"- machine: {os.cpu_count()} CPU cores, shared (load average {[round(x, 1) for x in load0]} at the start, "
        f"{[round(x, 1) for x in res['load_end']]} at the end); each run alone, the trees alternating; best of {args.repeats}",
        f"- the run: `python -m calibrate task=compare schemes={SCHEMES} trajectories.num_frames={args.frames} "
        "eval.strips=false` (replay for the calibrated baselines, kvquant2's fit, 8 rollouts of 7 trajectories, "
        "the full-precision rollout with every scheme's attention shadow, report)",
        "",
        "| tree | wall s | CPU s |",
        "|---|---:|---:|",
        f"| {args.baseline} (before the fast runtime) | {best['baseline'][0]:.1f} | {best['baseline'][1]:.1f} |",
        f"| {head} (this tree) | {best['this tree'][0]:.1f} | {best['this tree'][1]:.1f} |",
        "",
        f"Speed-up (wall): **{speedup:.2f}x** (issue 18's target: at least 2x).",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "compare_speed.json", json.dumps(res, indent=2) + "\n")
    write_text_atomic(args.out / "compare_speed.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
