"""The runtime against the float caches, side by side in one run.

    python -m benchmarks.runtime [--recipe PATH] [--out artifacts/benchmarks] [--quick]

1. TinyWorld, batch 1 (and batch 8), window 16 + 1 sink, a 64-frame orbit: ms per generated frame of the
   model's own float32 cache, the float16 recipe, the shipped (default, predictive) recipe and
   per-frame baselines, the shipped recipe with its decode through `torch.compile` (inductor: what
   the GPU path runs; its compile time falls in the first repeat; every layer's code is another
   `self` to the same two functions, so they reach dynamo's default limit of 8 graphs each within
   the first rollout, and a call that matches none of those graphs runs uncompiled, as a user gets
   it by default: the log says so), and under a memory plan
   (16 recall slots from a host tier of 64 frames, recall by pose); runs interleaved, best of
   three, and the ATen operators each calls per frame (torch.profiler: a count that does not move
   with the machine's load); and where the shipped recipe's fast path spends its time, step by step.
2. Wan-shaped attention (one layer, 12 heads x 128, 1560 tokens per frame, synthetic K/V that
   drift like video): one generated frame's attention over 8, 32 and 128 history frames, float16
   SDPA over a preallocated float16 ring vs the quantized caches: time, peak memory (torch's CPU
   allocations during the call, from the profiler, plus the cache's resident buffers, less the
   output) and bytes measured vs predicted.
3. `task=compare` of the default schemes and `task=check` of the shipped recipe (the reference
   runtime these once were timed against is now the tests' oracle, tests/reference_runtime.py).

Times are CPU seconds of this process (`time.process_time`), which a shared machine disturbs
less than wall time; both are written. `--recipe` replaces the shipped recipe in part 1.
Writes `runtime.md` and `runtime.json` (`--name` another stem, e.g. for another machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks import cpu_model
from benchmarks.predictive_fit import Moments, predictive_recipe
from calibrate.cache import KVCache, Rope
from calibrate.fastcache import FastKVCache
from calibrate.fit.plan_search import with_plan
from calibrate.plan import MemoryPlan
from calibrate.io import write_text_atomic
from calibrate.recipe import load_recipe
from calibrate.schemes import build_baseline
from calibrate.types import ModelInfo

MIB = 2**20
SHIPPED = Path("recipes/tinyworld-ours-2bit.safetensors")
PLAN_SLOTS = 16  # recall slots of the memory-plan rows (a host tier of 64 frames, recall by pose)
BATCH = 8  # part 1's second table: `evaluate`'s batch
BATCH_SKIP = ("compile", "plan", "quarot2")  # caches left out of the batch-8 table (time)


def clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = clock()
    return cpu - t0[0], wall - t0[1]


# ---- 1. TinyWorld ------------------------------------------------------------------------------------
def tinyworld(recipe_path: Path, frames: int, repeats: int, batch: int = 1, skip: tuple[str, ...] = ()) -> list[dict]:
    """ms per generated frame of each cache on `batch` orbit rollouts (but those whose names hold
    one of `skip`); ATen operators counted at batch 1."""
    from calibrate.adapters import TinyWorldAdapter
    from calibrate.world.trajectories import make_trajectories
    from calibrate.world.weights import load_weights

    world = TinyWorldAdapter(load_weights(None))
    trajs = make_trajectories(["orbit"], "evaluation", batch, frames, 0)
    shipped = load_recipe(recipe_path, world.info)
    fp16 = build_baseline("fp16", world.info)
    kind = shipped.scheme.layers[0].k.kind
    L = world.info.num_layers
    plan = MemoryPlan(10**12, window=16, sink_frames=1, recall_slots=PLAN_SLOTS, host_frames=64)  # recall by pose
    planned = with_plan(shipped, plan)
    caches = {
        "float32 cache (KVCache, the model's own)": lambda: KVCache(L, 16, 1),
        "fp16 recipe": lambda: FastKVCache(fp16, 16, 1),
        f"shipped recipe ({kind})": lambda: FastKVCache(shipped, 16, 1),
        f"shipped recipe ({kind}), decode through torch.compile (inductor)": lambda: FastKVCache(shipped, 16, 1, compile="inductor"),
        f"shipped recipe + plan {plan.label()}": lambda: FastKVCache(planned),
        **{n: (lambda n=n: FastKVCache(build_baseline(n, world.info), 16, 1)) for n in ("naive2", "kivi2", "quarot2")},
    }
    caches = {name: make for name, make in caches.items() if not any(word in name for word in skip)}
    best: dict[str, list[float]] = {name: [math.inf, math.inf] for name in caches}
    cpu = torch.device("cpu")
    for _ in range(repeats):
        for name, make in caches.items():
            cache = make()
            t0 = clock()
            world.rollout(trajs, cache, cpu)
            c, w = since(t0)
            best[name] = [min(best[name][0], c), min(best[name][1], w)]
            if hasattr(cache, "predicted_nbytes"):
                assert cache.nbytes() == cache.predicted_nbytes(frames, batch), name
    rows = []
    for name, (c, w) in best.items():
        rows.append({"cache": name, "ms_per_frame_cpu": 1e3 * c / (frames - 1), "ms_per_frame_wall": 1e3 * w / (frames - 1),
                     **({} if "compile" in name or batch > 1 else  # a fresh compiled cache compiles again: not counted
                        {"aten_ops_per_frame": aten_ops(lambda: world.rollout(trajs, caches[name](), cpu)) / (frames - 1)})})
    base = {r["cache"]: r["ms_per_frame_cpu"] for r in rows}
    for r in rows:
        r["x_fp16_fast"] = r["ms_per_frame_cpu"] / base["fp16 recipe"]
        r["x_float32_cache"] = r["ms_per_frame_cpu"] / base["float32 cache (KVCache, the model's own)"]
    return rows


def aten_ops(run) -> int:
    """The ATen operators `run()` calls (torch.profiler): the same count on every machine and load,
    where the CPU time of a shared machine varies by 10-30% from run to run."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def chain_breakdown(recipe_path: Path, frames: int, repeats: int) -> dict:
    """Where the predictive fast path's time goes: ms per generated frame (all layers) of the recipe's
    TinyWorld rollout inside each step of `fast_chain.ChainStore` and its `ChainCode`, timed around their methods (best of
    `repeats` per step), beside the float16 recipe's whole frame."""
    from calibrate import fast_chain
    from calibrate.fast_chain_code import ChainCode
    from calibrate.adapters import TinyWorldAdapter
    from calibrate.world.trajectories import make_trajectories
    from calibrate.world.weights import load_weights

    world = TinyWorldAdapter(load_weights(None))
    trajs = make_trajectories(["orbit"], "evaluation", 1, frames, 0)
    recipe, fp16 = load_recipe(recipe_path, world.info), build_baseline("fp16", world.info)
    cpu = torch.device("cpu")
    spent: dict[str, float] = {}
    owners = {"scan": fast_chain.ChainStore, "values": ChainCode, "encode": ChainCode, "_commit": fast_chain.ChainStore,
              "_block": fast_chain.ChainStore}
    originals = {name: getattr(owner, name) for name, owner in owners.items()}

    def timed(name, f):
        def g(*a, **k):
            t0 = time.process_time()
            out = f(*a, **k)
            spent[name] = spent.get(name, 0.0) + time.process_time() - t0
            return out
        return g

    best: dict[str, float] = {}
    try:
        for name, f in originals.items():
            setattr(owners[name], name, timed(name, f))
        for _ in range(repeats):
            spent.clear()
            for label, r in (("total", recipe), ("fp16 recipe, total", fp16)):
                t0 = time.process_time()
                world.rollout(trajs, FastKVCache(r, 16, 1), cpu)
                spent[label] = time.process_time() - t0
            for k, v in spent.items():
                best[k] = min(best.get(k, math.inf), 1e3 * v / (frames - 1))
    finally:
        for name, f in originals.items():
            setattr(owners[name], name, f)
    return {"scan (unpack the codes, integer states of the chain)": best["scan"],
            "values (v (unit R^T) + mean, one product)": best["values"],
            "rotary of the keys, blocks": best["_block"] - best["values"],
            "encode the new frame": best["encode"],
            "the rest of the commit (hold bits against the reference, packing codes, modes, the anchor)":
                best["_commit"] - best["encode"],
            "everything else (model, attention, the seam)": best["total"] - best["scan"] - best["_commit"] - best["_block"],
            "total": best["total"], "fp16 recipe, total": best["fp16 recipe, total"]}


# ---- 2. Wan-shaped attention ------------------------------------------------------------------------------
H, T, D = 12, 1560, 128
WAN_LAYER = ModelInfo("wan-shaped layer (synthetic)", 1, H, D, T, "synthetic")


class Drift:
    """Synthetic K/V [1, H, T, D]: a random walk in a decaying spectrum, rotated per head."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.basis = torch.linalg.qr(torch.randn(2, H, D, D, generator=self.g))[0]
        self.scale = torch.logspace(0, -2, D)
        self.z = [torch.randn(1, H, T, D, generator=self.g) * self.scale for _ in range(2)]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.z = [z + 0.1 * torch.randn(z.shape, generator=self.g) * self.scale for z in self.z]
        return self.z[0] @ self.basis[0], self.z[1] @ self.basis[1]


def peak_bytes(fn):
    """(peak bytes torch allocated on the CPU during fn, its result): the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    cur = peak = 0
    for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if e.name() == "[memory]":
            cur += e.nbytes()
            peak = max(peak, cur)
    return peak, out


class FP16Ring:
    """The float16 baseline: K/V of the window in a preallocated float16 ring, SDPA over it."""

    def __init__(self, frames: int):
        self.k = torch.zeros(1, H, frames * T, D, dtype=torch.float16)
        self.v = torch.zeros_like(self.k)
        self.frames, self.n = frames, 0

    def attend(self, q, k, v, rope: Rope):
        s = (self.n % self.frames) * T
        self.k[:, :, s: s + T] = rope.apply(k).half()
        self.v[:, :, s: s + T] = v.half()
        self.n += 1
        used = min(self.n, self.frames) * T
        return F.scaled_dot_product_attention(q.half(), self.k[:, :, :used], self.v[:, :, :used]).float()

    def nbytes(self) -> int:
        return 2 * self.k.numel() * 2


def wan_attention(histories: list[int], predictive_up_to: int) -> list[dict]:
    drift = Drift()
    moments = Moments(1)
    for _ in range(6):
        k, v = drift()
        moments.add(0, "k", k)
        moments.add(0, "v", v)
    recipes = {"predictive 2.5 bits": predictive_recipe(WAN_LAYER, moments, 2.5),
               "naive2": build_baseline("naive2", WAN_LAYER), "kivi2": build_baseline("kivi2", WAN_LAYER)}
    rope = Rope(torch.zeros(1, T, D // 2))  # post-rotary keys here: the rotary itself costs the same for every cache
    frame_fp16 = 2 * H * T * D * 2
    rows = []
    for F_hist in histories:
        caches = {"fp16 SDPA (ring)": FP16Ring(F_hist + 1)}
        for name, recipe in recipes.items():
            if name.startswith("predictive") and F_hist > predictive_up_to:
                continue
            caches[name] = FastKVCache.from_recipe(recipe, window=F_hist + 1, sink_frames=0)
        for name, cache in caches.items():
            src = Drift()
            t0 = clock()
            for _ in range(F_hist):
                k, v = src()
                if isinstance(cache, FP16Ring):
                    cache.attend(torch.zeros(1, H, 1, D), k, v, rope)
                else:
                    cache.append(0, k, v, rope)
            fill = since(t0)[0]
            k, v = src()
            q = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(1))
            resident = cache.nbytes() if isinstance(cache, FP16Ring) else cache.capacity_nbytes()
            attend = (lambda: cache.attend(q, k, v, rope)) if isinstance(cache, FP16Ring) else (lambda: cache.attend(0, q, k, v, rope))
            t0 = clock()
            peak, out = peak_bytes(attend)
            cpu, wall = since(t0)
            row = {"history_frames": F_hist, "cache": name, "attend_s_cpu": cpu, "attend_s_wall": wall, "fill_s_cpu": fill,
                   "resident_mib": resident / MIB, "transient_mib": (peak - out.numel() * out.element_size()) / MIB}
            row["peak_mib"] = row["resident_mib"] + row["transient_mib"]
            if not isinstance(cache, FP16Ring):
                live, pred = cache.nbytes(), cache.predicted_nbytes(F_hist + 1)
                row.update(packed_mib=live / MIB, predicted_mib=pred / MIB, bytes_equal=live == pred,
                           target_mib=(1.5 * live + frame_fp16) / MIB,
                           target_allocated_mib=(1.5 * cache.capacity_nbytes() + frame_fp16) / MIB)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---- 3. compare and check ----------------------------------------------------------------------------------
def fresh(run_dir: Path) -> Path:
    """An empty run directory: a run dir's partial results would let a rerun skip the work it times."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    return run_dir


def pipeline_runs(out: Path, frames: int) -> list[dict]:
    from calibrate import pipeline
    from calibrate.config import Config

    rows = []
    base = Config()
    schemes = list(base.schemes) + ([] if "ours" in base.schemes else ["ours"])
    runs = (("compare", f"compare, {len(schemes)} schemes, 7 trajectories x {frames} frames", pipeline.run_compare,
             replace(base, task="compare", schemes=schemes, trajectories=replace(base.trajectories, num_frames=frames),
                     eval=replace(base.eval, strips=False))),
            ("check", "check, shipped recipe (check set: 4 trajectories x 128 frames)", pipeline.run_check,
             replace(base, task="check", recipe=str(SHIPPED))))
    for name, task, run, cfg in runs:
        run_dir = fresh(out / name)
        t0 = clock()
        run(cfg, run_dir)
        cpu, wall = since(t0)
        rows.append({"task": task, "s_cpu": cpu, "s_wall": wall})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- report ------------------------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    m = res["machine"]
    lines = ["# Runtime: time and memory", "",
             f"- date: {res['date']}; command: `{res['command']}`",
             f"- machine: {m['cpu']}, shared with other work (load average {m['load_start']} at the start, "
             f"{m['load_end']} at the end), torch {m['torch']}, {m['threads']} thread; times are CPU seconds of this "
             "process (wall in the JSON)", ""]
    lines += ["## TinyWorld, batch 1, window 16 + 1 sink", "",
              "| cache | ms / frame (CPU) | x fp16 recipe | x float32 KVCache | ATen ops / frame |", "|---|---:|---:|---:|---:|"]
    for r in res["tinyworld"]:
        ops = f"{r['aten_ops_per_frame']:.0f}" if "aten_ops_per_frame" in r else "-"
        lines.append(f"| {r['cache']} | {r['ms_per_frame_cpu']:.2f} | {r['x_fp16_fast']:.2f} | {r['x_float32_cache']:.2f} | {ops} |")
    lines += ["", "ATen ops / frame: the operators one rollout calls (torch.profiler), per generated frame: the same on "
              "every run, where CPU time on a shared machine moves by 10-30%."]
    if res.get("tinyworld_batch"):
        lines += ["", f"The same at batch {BATCH} (the batch `evaluate` and `compare` roll out): the ratio that remains "
                  "when the operators' fixed cost is shared by 8 rollouts is the decode's arithmetic.", "",
                  "| cache | ms / frame (CPU) | x fp16 recipe | x float32 KVCache |", "|---|---:|---:|---:|"]
        lines += [f"| {r['cache']} | {r['ms_per_frame_cpu']:.2f} | {r['x_fp16_fast']:.2f} | {r['x_float32_cache']:.2f} |"
                  for r in res["tinyworld_batch"]]
    if res.get("breakdown"):
        lines += ["", "Where the shipped recipe's fast path spends its time (ms per generated frame, 4 layers; "
                  "timers around the methods of `fast_chain.ChainStore` and `ChainCode`, best of 3):", "", "| step | ms / frame |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in res["breakdown"].items()]
    lines += ["", "## Wan-shaped attention (12 heads x 128, 1560 tokens per frame), one generated frame", "",
              "| history | cache | attend s (CPU) | resident MiB | transient MiB | peak MiB | packed MiB (= predicted) | "
              "target 1.5 x packed + frame MiB |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["wan_attention"]:
        packed = f"{r['packed_mib']:.1f} ({'=' if r['bytes_equal'] else '!='} {r['predicted_mib']:.1f})" if "packed_mib" in r else "-"
        target = f"{r['target_mib']:.1f} (allocated: {r['target_allocated_mib']:.1f})" if "target_mib" in r else "-"
        lines.append(f"| {r['history_frames']} | {r['cache']} | {r['attend_s_cpu']:.2f} | {r['resident_mib']:.1f} | "
                     f"{r['transient_mib']:.1f} | {r['peak_mib']:.1f} | {packed} | {target} |")
    if res.get("pipeline"):
        lines += ["", "## task=compare and task=check", "", "| task | s (CPU) | s (wall) |", "|---|---:|---:|"]
        for r in res["pipeline"]:
            lines.append(f"| {r['task']} | {r['s_cpu']:.0f} | {r['s_wall']:.0f} |")
    lines += ["", res["notes"], ""]
    return "\n".join(lines)


NOTES = """Notes. Peak = the cache's resident buffers before the call + the most torch allocated during
the call, less the returned output (the profiler's CPU memory events); the float16 ring's resident
bytes are its K/V. "packed" counts the forms the kept frames are held in (what
`memory.predicted_cache_bytes` predicts, and equal to it); "allocated" adds the slots not in use
at the moment (the anchor frame's delta slot, one free slot), which a second target column
uses. The predictive cache is measured up to the history its O(F) decode per append allows to
fill in reasonable time on this CPU (filling F frames decodes the chain F times)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=SHIPPED, help="the TinyWorld recipe of part 1 (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/benchmarks"), help="a directory")
    parser.add_argument("--name", default="runtime", help="the reports' file stem")
    parser.add_argument("--quick", action="store_true", help="histories 8 and 32 only, no compare/check")
    parser.add_argument("--compare-frames", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    recipe = args.recipe
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "OMP_NUM_THREADS=1 python -m benchmarks.runtime " + " ".join(sys.argv[1:]),
           "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_start": [round(x, 1) for x in os.getloadavg()],
                       "torch": torch.__version__, "threads": torch.get_num_threads()}, "notes": NOTES}
    res["tinyworld"] = tinyworld(recipe, 64, 3)
    print(json.dumps(res["tinyworld"], indent=1), flush=True)
    res["tinyworld_batch"] = tinyworld(recipe, 64, 3, BATCH, BATCH_SKIP)
    print(json.dumps(res["tinyworld_batch"], indent=1), flush=True)
    res["breakdown"] = chain_breakdown(recipe, 64, 3)
    print(json.dumps(res["breakdown"], indent=1), flush=True)
    res["wan_attention"] = wan_attention([8, 32] if args.quick else [8, 32, 128], predictive_up_to=32)
    runs = Path("artifacts/runs/benchmark-runtime")  # run dirs of compare/check (git-ignored)
    res["pipeline"] = [] if args.quick else pipeline_runs(runs, args.compare_frames)
    res["machine"]["load_end"] = [round(x, 1) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / f"{args.name}.json", json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    write_text_atomic(args.out / f"{args.name}.md", md)
    print(md)


if __name__ == "__main__":
    main()
