"""Is the shipped recipe what the default run fits on this machine? Time the default run and diff the two.

    python -m benchmarks.reproducibility [--recipe PATH] [--against recipes/tinyworld-ours-2bit.safetensors]
                                         [--out artifacts/benchmarks/reproducibility.md]

Without `--recipe` it runs the default `python -m calibrate` in a child process (into
artifacts/runs/reproducibility/<time>) and measures it: wall time, the child's user CPU and peak
RSS (`resource.getrusage`), the torch threads it chose (its log's "torch threads" line: by the
load unless OMP_NUM_THREADS is set), the load average around it. Then it compares that recipe with `--against`, as README's "Reproducibility" states them:
the scheme (every choice) and every integer tensor equal, float tensors within ANOTHER_CPU (the
bound `tests/test_reliability.py` holds two MKL kernel sets to), the fit record's scores allowed to
differ in their last digits. The report names the CPU (/proc/cpuinfo) and MKL_CBWR.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks import command_line, cpu_model
from calibrate.io import write_text_atomic

ANOTHER_CPU = {"mean": (1e-6, 0.0), "unit": (0.0, 1e-4), "sink_unit": (0.0, 1e-4), "rotation": (1e-4, 0.0)}  # role: (atol, rtol), README
EXACT_METADATA = ("format", "format_version", "model", "scheme", "memory", "calibration")


def default_run(run_dir: Path) -> dict:
    """Run the default `python -m calibrate` into `run_dir`; its recipe and what it cost."""
    load0, t0 = os.getloadavg(), time.time()
    run = subprocess.run([sys.executable, "-m", "calibrate", f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
    wall = time.time() - t0
    if run.returncode != 0:
        sys.exit(f"error: python -m calibrate failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = (run_dir / "__main__.log").read_text() if (run_dir / "__main__.log").is_file() else ""
    threads = next((line.split("torch threads: ", 1)[1] for line in log.splitlines() if "torch threads: " in line), "?")
    return {"recipe": run_dir / "recipe.safetensors", "wall_s": wall, "user_s": usage.ru_utime, "threads": threads,
            "peak_rss_mib": usage.ru_maxrss / 1024, "load_start": [round(x, 1) for x in load0],
            "load_end": [round(x, 1) for x in os.getloadavg()]}


def diff(path_a: Path, path_b: Path) -> dict:
    """Per role: tensors, how many differ, the largest absolute and relative difference, within bounds."""
    fa, fb = safe_open(str(path_a), "pt"), safe_open(str(path_b), "pt")
    ma, mb = fa.metadata(), fb.metadata()
    out = {"metadata": {k: ma.get(k) == mb.get(k) for k in EXACT_METADATA}, "roles": {},
           "same_names": set(fa.keys()) == set(fb.keys())}
    for name in sorted(set(fa.keys()) & set(fb.keys())):
        a, b = fa.get_tensor(name), fb.get_tensor(name)
        role = name.rsplit(".", 1)[1]
        r = out["roles"].setdefault(role, {"tensors": 0, "differ": 0, "max_abs": 0.0, "max_rel": 0.0,
                                           "dtype": str(a.dtype).removeprefix("torch."), "within": True})
        r["tensors"] += 1
        if a.shape != b.shape or a.dtype != b.dtype:
            r["differ"] += 1
            r["within"] = False
            continue
        if torch.equal(a, b):
            continue
        r["differ"] += 1
        if not a.is_floating_point():
            r["within"] = False
            continue
        d = (a.double() - b.double()).abs()
        r["max_abs"] = max(r["max_abs"], float(d.max()))
        r["max_rel"] = max(r["max_rel"], float((d / b.double().abs().clamp_min(1e-30)).max()))
        atol, rtol = ANOTHER_CPU.get(role, (0.0, 0.0))
        r["within"] &= bool(torch.isclose(a, b, atol=atol, rtol=rtol).all())
    return out


def markdown(res: dict, run: dict | None, recipe: Path, against: Path, command: str) -> str:
    d = res["diff"]
    roles = d["roles"]
    ok = d["same_names"] and all(d["metadata"].values()) and all(r["within"] for r in roles.values())
    lines = ["# Reproducibility: the default run's recipe against the shipped one", "",
             f"- command: `{command}`; date: {res['date']}",
             f"- machine: {res['cpu']}; torch {torch.__version__}; "
             f"MKL_CBWR={os.environ.get('MKL_CBWR', '(unset)')}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}"]
    if run:
        lines.append(f"- the default `python -m calibrate`: **{run['wall_s']:.0f} s wall**, {run['user_s']:.0f} s user CPU, "
                     f"{run['peak_rss_mib']:.0f} MiB peak RSS, torch threads {run['threads']} (load average "
                     f"{run['load_start']} at the start, {run['load_end']} at the end)")
    lines += [f"- compared: `{recipe}` against `{against}`", "",
              "| metadata section | equal |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in d["metadata"].items()]
    lines += ["", "| role | dtype | tensors | differ | max abs | max rel | bound (atol, rtol) | within |",
              "|---|---|---:|---:|---:|---:|---|---|"]
    for role, r in roles.items():
        bound = ANOTHER_CPU.get(role, (0.0, 0.0)) if r["dtype"].startswith("float") else "equal"
        lines.append(f"| {role} | {r['dtype']} | {r['tensors']} | {r['differ']} | {r['max_abs']:.2g} | {r['max_rel']:.2g} | "
                     f"{bound} | {'yes' if r['within'] else '**no**'} |")
    differ = sum(r["differ"] for r in roles.values())
    total = sum(r["tensors"] for r in roles.values())
    lines += ["", f"{differ} of {total} tensors differ; "
              + ("the scheme and every integer tensor are equal and the floats within the README's bounds."
                 if ok else "**outside what the README states** (see the rows marked no)."), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="a recipe to compare (default: run the default python -m calibrate)")
    p.add_argument("--against", default="recipes/tinyworld-ours-2bit.safetensors")
    p.add_argument("--out", default="artifacts/benchmarks/reproducibility.md")
    args = p.parse_args(argv)
    for path in [args.against] + ([args.recipe] if args.recipe else []):
        if not Path(path).is_file():
            print(f"error: {path}: no such recipe file", file=sys.stderr)
            return 2
    run = None
    if args.recipe is None:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H-%M-%S")
        run = default_run(Path("artifacts/runs/reproducibility") / stamp)
    recipe = Path(args.recipe) if args.recipe else run["recipe"]
    res = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
           "diff": diff(recipe, Path(args.against)), "run": run}
    command = command_line("reproducibility", argv)
    md = markdown(res, run, recipe, Path(args.against), command)
    out = Path(args.out)
    write_text_atomic(out, md)
    write_text_atomic(out.with_suffix(".json"), json.dumps(res, indent=1, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
