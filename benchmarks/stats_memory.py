"""Benchmark: peak memory of `task=stats` does not grow with the rollout length.

    python -m benchmarks.stats_memory [--out artifacts/benchmarks] [--lengths 128,1024]

Runs `python -m calibrate task=stats` once per trajectory length (same families and number of
trajectories) in a fresh process and reads that process's peak resident set size from the OS
(`getrusage(RUSAGE_CHILDREN).ru_maxrss`, measured by a fresh intermediate process per run so
the maxima do not mix). Target: peak RSS at 1024 frames <= 1.2x peak RSS at 128 frames.
Writes `stats_memory.md` and `stats_memory.json`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import command_line
from calibrate.io import write_text_atomic

PROBE = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mib(num_frames: int, num_trajectories: int, run_dir: Path) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "calibrate", "task=stats", f"trajectories.num_frames={num_frames}",
           f"trajectories.num_trajectories={num_trajectories}", "trajectories.families=[orbit,revisit,stress]",
           f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", PROBE, *cmd], capture_output=True, text=True, check=True).stdout.split()
    if out[0] != "0":
        raise RuntimeError(f"task=stats failed (exit {out[0]}): {' '.join(cmd)}")
    return int(out[1]) / 1024.0, time.time() - t0  # ru_maxrss is in KiB on Linux


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--lengths", default="128,1024")
    p.add_argument("--trajectories", type=int, default=3)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            rss, seconds = peak_rss_mib(n, args.trajectories, Path(tmp) / f"run{n}")
            rows.append({"num_frames": n, "peak_rss_mib": round(rss, 1), "seconds": round(seconds, 1)})
            print(f"{n:5d} frames: peak RSS {rss:8.1f} MiB ({seconds:.0f} s)")
    ratio = rows[-1]["peak_rss_mib"] / rows[0]["peak_rss_mib"]
    command = command_line("stats_memory", argv)
    result = {"rows": rows, "ratio": round(ratio, 4), "target": 1.2, "met": ratio <= 1.2, "command": command}
    lines = ["# Peak memory of task=stats vs rollout length", "",
             f"Command: `{command}`  ", f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}", "",
             f"{args.trajectories} trajectories (orbit, revisit, stress), fresh process per run, peak RSS from getrusage.", "",
             "| frames per trajectory | peak RSS (MiB) | wall time (s) |", "|---|---|---|"]
    lines += [f"| {r['num_frames']} | {r['peak_rss_mib']} | {r['seconds']} |" for r in rows]
    lines += ["", f"Ratio {lengths[-1]} / {lengths[0]} frames: **{ratio:.3f}** (target <= 1.2: "
              f"{'met' if result['met'] else 'NOT met'})."]
    write_text_atomic(Path(args.out) / "stats_memory.md", "\n".join(lines) + "\n")
    write_text_atomic(Path(args.out) / "stats_memory.json", json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
