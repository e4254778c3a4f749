"""How many latent frames of KV cache fit on 24 / 48 / 80 GiB beside Wan2.1-T2V-1.3B, per scheme.

    python -m benchmarks.capacity [--model self_forcing] [--budgets 24GiB,48GiB,80GiB] [--out artifacts/benchmarks]

Runs `python -m calibrate task=capacity model=MODEL memory.device_budget=BUDGET` once per budget
(the byte model only: no weights, no replay), collects each run's capacity.json and writes one
table: per scheme its bits/element, the bytes one more chunk of history costs, the latent frames
on the device at each budget and the host bytes for the rest of the rollout at the first budget.
Also records each command's wall time and CPU time (the CLI's own process, `OMP_NUM_THREADS=1`).
Writes `capacity.md` and `capacity.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from calibrate.io import write_text_atomic

GIB = 2**30


def run(model: str, budget: str, run_dir: Path) -> tuple[dict, float, float]:
    """(capacity.json, wall seconds, CPU seconds of the child) of one CLI run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "calibrate", "task=capacity", f"model={model}",
                           f"memory.device_budget={budget}", f"hydra.run.dir={run_dir}"],
                          env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(done.stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads((run_dir / "capacity.json").read_text()), wall, cpu


def markdown(model: str, budgets: list[str], reports: list[dict], times: list[tuple[float, float]]) -> str:
    first = reports[0]
    m = first["model"]
    lines = [
        f"# Capacity of `model={model}`: latent frames of KV cache beside the weights",
        "",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `python -m benchmarks.capacity --model {model} --budgets {','.join(budgets)}`, which runs "
        f"`python -m calibrate task=capacity model={model} memory.device_budget=BUDGET` per budget",
        f"- model: {m['num_layers']} layers x {m['num_kv_heads']} KV heads x head_dim {m['head_dim']}, "
        f"{m['tokens_per_chunk']} tokens per chunk of {m['chunk_frames']} latent frames, "
        f"{first['sink_frames']} sink chunk(s); {m['num_params']:,} parameters = "
        f"{first['weight_bytes'] / GIB:.2f} GiB in bf16, taken off each budget ({m['source']})",
        f"- rollout: {first['rollout_frames']} latent frames ({first['rollout_chunks']} chunks; 5 min of 16 fps video); "
        "\"all\" = the whole rollout stays on the device",
        "- not counted: text encoder, VAE, activations, CUDA context (`capacity.reserve` keeps room for them)",
        "- time per command (1 thread, sharing the CPU with other work): "
        + ", ".join(f"{b}: {w:.1f} s wall, {c:.1f} s CPU" for b, (w, c) in zip(budgets, times)),
        "",
        "| scheme | bits/elem | MiB per chunk | " + " | ".join(f"latent frames, {b}" for b in budgets)
        + f" | host GiB for the rest, {budgets[0]} | counted |",
        "|---|---:|---:|" + "---:|" * len(budgets) + "---:|---|",
    ]
    for i, row in enumerate(first["rows"]):
        if row.get("window") is None:
            continue
        frames = []
        for rep in reports:
            r = rep["rows"][i]
            frames.append("all" if r.get("whole_rollout") else str(r["latent_frames"]))
        host = "-" if row["host_bytes"] is None else f"{row['host_bytes'] / GIB:.1f}"
        lines.append(f"| {row['scheme']} | {row['bits_per_element']:.2f} | {row['bytes_per_chunk'] / 2**20:.1f} | "
                     + " | ".join(frames) + f" | {host} | {row['counted']} |")
    lines += ["", "Notes per scheme (from the first budget's run):", ""]
    lines += [f"- {r['scheme']}: {r['note']}" for r in first["rows"] if r.get("note")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="self_forcing")
    parser.add_argument("--budgets", default="24GiB,48GiB,80GiB")
    parser.add_argument("--out", type=Path, default=Path("artifacts/benchmarks"))
    args = parser.parse_args()
    budgets = args.budgets.split(",")
    reports, times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for b in budgets:
            rep, wall, cpu = run(args.model, b, Path(tmp) / b)
            reports.append(rep)
            times.append((wall, cpu))
    md = markdown(args.model, budgets, reports, times)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "capacity.md", md)
    write_text_atomic(args.out / "capacity.json", json.dumps({"model": args.model, "budgets": budgets,
                                                              "reports": reports, "seconds": times}, indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
