"""Benchmark: the blind-spot comparison of every scheme, written under artifacts/benchmarks/.

    python -m benchmarks.compare                         # compare.md: 7 held-out 256-frame rollouts
    python -m benchmarks.compare --name stress_1024 --trajectories stress_suite --frames 1024
    python -m benchmarks.compare --model wanworld --name compare_wanworld --frames 96 \
        --schemes fp16,naive2,kivi2,kivi2_lowmem,kivi4,quarot2,kvquant2,qvg2,qvg2_lowmem,turbo2.5,ours eval.attention=false

Runs `python -m calibrate task=compare` (pipeline.run_compare) with the given schemes into
--run-dir, then copies its report.md (with the command that made it and how long it took) and
its plots to artifacts/benchmarks/<name>.md and <name>_*.png, and adds an equal-memory view:
every scheme at <= 2.5 bits/element, ranked by PSNR vs the fp rollout on frames 128 on.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from benchmarks import command_line
from calibrate import pipeline
from calibrate.config import CONF_DIR, to_config
from calibrate.evaluate import report as report_mod
from calibrate.io import write_text_atomic

SCHEMES = "fp16,naive2,kivi2,kivi2_lowmem,kivi4,quarot2,kvquant2,qvg2,qvg2_lowmem,qvg2_static,turbo2.5,jensen2,nvfp4,ours"


def equal_memory(rep: dict, budget: float = 2.5) -> str:
    rows = [r for r in report_mod.blind_spot_rows(rep) if r["bits"] <= budget + 1e-9]
    rows.sort(key=lambda r: -r["long_psnr_ref"])
    lines = [f"## Equal memory: every scheme at <= {budget} bits/element", "",
             "| scheme | bits/elem | PSNR_ref 0-16 | worst late window | flicker | revisit (fp) | short-clip trap? |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rev = "-" if r["revisit"] is None else f"{r['revisit']:.1f} ({r['revisit_fp']:.1f})"
        lines.append(f"| {r['scheme']} | {r['bits']:.2f} | {r['short_psnr_ref']:.1f} | {r['long_psnr_ref']:.1f} | "
                     f"{r['flicker']:.5f} | {rev} | {'YES' if r['trap'] else 'no'} |")
    return "\n".join(lines) + "\n"


def strip_links(md: str, run_dir: Path) -> str:
    """The report's frame strips are GIFs of about 2 MB each: they stay in the run directory, and the
    committed report names where instead of linking a file the repository does not hold."""
    return re.sub(r"!\[[^\]]*\]\((strip_[^)]+\.gif)\)",
                  lambda m: f"`{(run_dir / m.group(1)).as_posix()}` (a run output, not committed)", md)


def partial_stamps(run_dir: Path) -> dict[str, int]:
    """Each partial result file of an evaluation in `run_dir` (evaluate/run.py) and its mtime in ns."""
    return {f.name: f.stat().st_mtime_ns for f in (run_dir / "partial").glob("*.safetensors")}


def reused_schemes(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Schemes whose partial files (`<scheme>.<batch>.safetensors`) all stayed as they were: reused."""
    schemes: dict[str, bool] = {}
    for name, stamp in after.items():
        scheme = name.removesuffix(".safetensors").rsplit(".", 1)[0]
        schemes[scheme] = schemes.get(scheme, True) and before.get(name) == stamp
    return sorted(s for s, kept in schemes.items() if kept)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="compare")
    p.add_argument("--schemes", default=SCHEMES)
    p.add_argument("--trajectories", default="calibration", help="a conf/trajectories set (split: evaluation)")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--model", default="tinyworld", help="a conf/model preset (tinyworld, wanworld)")
    p.add_argument("overrides", nargs="*", help="more `python -m calibrate` overrides, e.g. eval.attention=false")
    args = p.parse_args(argv)
    overrides = ["task=compare", f"model={args.model}", f"schemes=[{args.schemes}]", f"trajectories={args.trajectories}"]
    if args.frames:
        overrides.append(f"trajectories.num_frames={args.frames}")
    overrides += args.overrides
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    run_dir = Path(args.run_dir or f"artifacts/runs/bench_{args.name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    t0, before = time.time(), partial_stamps(run_dir)
    try:
        pipeline.run_compare(cfg, run_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    minutes = (time.time() - t0) / 60
    rep = json.loads((run_dir / "report.json").read_text())
    out = Path(args.out)
    command = command_line("compare", argv)
    md = (run_dir / "report.md").read_text()
    for png in run_dir.glob("*.png"):
        shutil.copyfile(png, out / f"{args.name}_{png.name}")
        md = md.replace(f"]({png.name})", f"]({args.name}_{png.name})")
    md = strip_links(md, run_dir)
    reused = reused_schemes(before, partial_stamps(run_dir))
    note = (f"; this run reused the evaluations of {', '.join(reused)} from an earlier run in its run directory "
            "(the same recipes and settings)" if reused else "")
    header = (f"Command: `{command}` (= `python -m calibrate {' '.join(overrides)}`), {minutes:.1f} min on this 2-core "
              f"CPU, torch threads {torch.get_num_threads()}{note}.\n\n`ours` is the shipped recipe "
              f"(`recipes/{args.model}-ours-2bit.safetensors`).\n\n")
    title, _, rest = md.partition("\n")
    # report.md names the command of the process that made it: this script's arguments, not a calibrate command
    rest = re.sub(r"\nCommand: `python -m calibrate [^\n]*\n", "\n", rest, count=1)
    write_text_atomic(out / f"{args.name}.md", f"{title}\n\n{header}{equal_memory(rep)}\n{rest}")
    print(f"wrote {out / (args.name + '.md')} ({minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
