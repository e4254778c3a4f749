"""Scale: the default `task=calibrate` on random Wan models with Wan2.1-1.3B's per-layer shape.

    python -m benchmarks.scale [--sizes 64,390,1560,4680] [--frames 8] [--out artifacts/benchmarks]

Each size is diffusers' `WanTransformer3DModel` with Wan2.1-T2V-1.3B's blocks (12 heads x 128,
width 1536, ffn 8960, text 4096, 16 latent channels, patches 1x2x2) but 2 layers, random weights
(seed 0) saved as a diffusers model directory, so `model.weights=` loads it the way a real
checkpoint loads. Tokens per cache frame: 64 (16x16 latents), 390 (30x52), 1560 (60x104) and
4680 (60x104, chunks of 3 latent frames as Self-Forcing). Every size runs
`python -m calibrate model=wan_diffusers ...` end to end in its own process, with every fit
setting at its default; cut for CPU time (stated in the report): one trajectory of `--frames`
cache frames in every set (calibration, closed loop, evaluation, check), one denoising step
(`model.wan.denoise_timesteps=[1000]`), window 4 + 1 sink. Measured per phase (the run's own
`phase` log records): wall time and peak RSS (VmHWM, reset at each phase start), the trace's
bytes, objective calls and their time. The cost model (`benchmarks/cost_model.py`) predicts each
phase from FLOPs and this CPU's measured throughput, and extrapolates to Wan2.1-1.3B.

Writes `scale.md` and `scale.json`. One thread (`OMP_NUM_THREADS=1`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import cost_model as cm

SIZES = {64: (16, 16, 1), 390: (30, 52, 1), 1560: (60, 104, 1), 4680: (60, 104, 3)}  # latents h, w, chunk
BLOCKS = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
              eps=1e-6, rope_max_seq_len=1024)
LAYERS, WINDOW, SINKS, TEXT_TOKENS = 2, 4, 1, 8
REPO = Path(__file__).resolve().parents[1]


# ---- measuring one run (the worker process) ------------------------------------------------------------
def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class PhaseMeter(logging.Handler):
    """Wall time and peak RSS of every phase the run logs (calibration.phase)."""

    def __init__(self):
        super().__init__()
        self.phases: dict[str, dict] = {}
        self._start: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        name, event = getattr(record, "phase", None), getattr(record, "event", None)
        if name is None:
            return
        if event == "start":
            _reset_hwm()
            self._start[name] = time.perf_counter()
        elif event == "end":
            self.phases[name] = {"seconds": time.perf_counter() - self._start[name], "peak_rss_mib": _hwm_kib() / 1024}


def worker(overrides: list[str], out: Path) -> None:
    """Run `python -m calibrate *overrides` in this process, measuring phases, the trace and the objective."""
    from calibrate import trace
    from calibrate.recipe import load_recipe
    from calibrate.fit import predictive_codes, predictive_search

    meter = PhaseMeter()
    logging.getLogger("calibrate.calibration").addHandler(meter)
    logging.getLogger("calibrate.calibration").setLevel(logging.INFO)
    measured = {"objective_calls": 0, "objective_heads": 0, "objective_seconds": 0.0, "head_sequences": 0,
                "reconstruct_seconds": 0.0}

    def timed(fn, count, secs, weight=lambda a: 1):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out_ = fn(*a, **kw)
            measured[count] += weight(a)
            measured[secs] += time.perf_counter() - t0
            return out_
        return wrapper

    # objective calls and the heads they score (a layer's H, or one head after an upgrade); reconstructions
    # as coded head sequences (one head's frames through quant/predictive.py)
    objective = predictive_search.head_objective
    predictive_search.head_objective = timed(objective, "objective_heads", "objective_seconds",
                                             lambda a: a[0].q.shape[1])
    predictive_search.head_objective = timed(predictive_search.head_objective, "objective_calls", "unused_seconds")
    measured["unused_seconds"] = 0.0
    predictive_codes.fake_quant_sequence = timed(predictive_codes.fake_quant_sequence, "head_sequences",
                                                  "reconstruct_seconds")
    allocate = trace.Trace._allocate

    def allocate_and_measure(self, B, A):
        allocate(self, B, A)
        measured["trace_bytes"] = self.nbytes()
        measured["trace_slots"] = self.plan.num_slots
    trace.Trace._allocate = allocate_and_measure
    sys.argv = ["calibrate", *overrides]
    t0 = time.perf_counter()
    from calibrate.__main__ import main
    try:
        main()
    except SystemExit as e:
        if e.code:
            raise
    measured["seconds"] = time.perf_counter() - t0
    measured["phases"] = meter.phases
    fit_record = json.loads(load_recipe(Path(_override(overrides, "hydra.run.dir")) / "recipe.safetensors")
                            .metadata["fit"])
    measured["upgrades"] = len(fit_record["upgrades"])
    measured["base_bits"], measured["bits_per_element"] = fit_record["base_bits"], fit_record["bits_per_element"]
    measured["candidates"] = len(fit_record.get("closed_loop", {}).get("scores", {})) or 1  # 1: no closed loop
    out.write_text(json.dumps(measured, indent=2))


def _override(overrides: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


# ---- the sizes ---------------------------------------------------------------------------------
def make_model(directory: Path) -> None:
    """A random 2-layer Wan with 1.3B's blocks, saved as a diffusers model directory (float32)."""
    import diffusers

    torch.manual_seed(0)
    diffusers.WanTransformer3DModel(num_layers=LAYERS, **BLOCKS).save_pretrained(directory)


def overrides(size: int, frames: int, weights: Path, run_dir: Path) -> list[str]:
    h, w, chunk = SIZES[size]
    n = frames * chunk
    return ["model=wan_diffusers", f"model.weights={weights}", f"model.wan.latent_height={h}",
            f"model.wan.latent_width={w}", f"model.wan.chunk_frames={chunk}", "model.wan.denoise_timesteps=[1000]",
            f"model.cache.window={WINDOW}", f"model.cache.sink_frames={SINKS}", "device=cpu",
            "trajectories.num_trajectories=1", f"trajectories.num_frames={n}", "trajectories.batch_size=1",
            "fit.closed_loop_trajectories=1", f"fit.closed_loop_frames={n}",
            "check.num_trajectories=1", f"check.num_frames={n}", f"hydra.run.dir={run_dir}"]


def run_size(size: int, frames: int, weights: Path, work: Path) -> dict:
    import shutil

    out = work / f"measured_{size}.json"
    shutil.rmtree(work / f"run_{size}", ignore_errors=True)  # an earlier run's partial results would be reused
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "benchmarks.scale", "--worker", str(out), "--",
           *overrides(size, frames, weights, work / f"run_{size}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"size {size} failed:\n{proc.stderr[-3000:]}")
    measured = json.loads(out.read_text())
    measured["wall_seconds"] = time.perf_counter() - t0
    measured["peak_rss_mib"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    return measured


# ---- this CPU's throughput ------------------------------------------------------------------------
def _rate(fn, units: float = 1.0, seconds: float = 1.5) -> float:
    """units per second of `fn` (after one warm-up call)."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or n < 2:
        fn()
        n += 1
    return units * n / (time.perf_counter() - t0)


def peak_rss_mib(measured: dict) -> float:
    """The run's peak RSS: the largest phase's. `time -v`'s maximum alone is the last phase's, since
    each phase resets the high-water mark (`_reset_hwm`) and the kernel reports the reset value."""
    return max([measured["peak_rss_mib"], *(p["peak_rss_mib"] for p in measured["phases"].values())])


def throughput(tokens: int, slots: int, frames: int) -> cm.Throughput:
    """This CPU at one size, one thread: the model's GEMM, the cache's attention and the objective's
    attention at the trace's shape (FLOP/s), and the units the cost model times rather than counts:
    recording one cache frame of one layer, attending through the fast runtime's packed cache
    beyond the float cache's cost, coding one frame of one head (`slots` tokens), fitting one
    head's code. The fixed part of a model pass is fitted later, on the smallest size
    (`fit_per_pass`)."""
    from calibrate.cache import KVCache, Rope
    from calibrate.fit.predictive import fit_head
    from calibrate.quant.predictive import fake_quant_sequence
    from calibrate.replay import Recorder, RecordingCache
    from calibrate.types import ModelInfo

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, 1536, generator=g), torch.randn(1536, 8960, generator=g)
    linear = _rate(lambda: x @ w, 2.0 * tokens * 1536 * 8960)
    q, k = torch.randn(1, 12, tokens, 128, generator=g), torch.randn(1, 12, 4 * tokens, 128, generator=g)
    attention = _rate(lambda: torch.einsum("bhtd,bhnd->bhtn", q, k).softmax(-1) @ k,
                      4.0 * 12 * 128 * tokens * 4 * tokens)
    info = ModelInfo("bench", 1, 12, 128, tokens, "-")
    frame = lambda: (torch.randn(1, 12, tokens, 128, generator=g),) * 3 + (Rope(torch.rand(1, tokens, 64, generator=g)),)
    caches = {"plain": attend_s(KVCache(1, WINDOW, SINKS), frame, WINDOW + SINKS),
              "recording": attend_s(RecordingCache(1, WINDOW, SINKS, Recorder.create(info, 4096)), frame,
                                    WINDOW + SINKS)}
    quantized = quantized_attend_s(info, frame)
    from calibrate.fit.objective import LayerTrace, attention_outputs

    trace = LayerTrace(*(torch.randn(1, 12, frames, slots, 128, generator=g) for _ in range(3)), window=WINDOW,
                       sink_frames=SINKS)
    hats = (trace.k + 0.1, trace.v + 0.1)
    objective = _rate(lambda: attention_outputs(trace, *hats), cm.objective_flops(
        cm.Model(1, 12, 128, 1536, 8960, slots), cm.Run(frames=frames, window=WINDOW, sinks=SINKS, passes=1,
                                                         trace_tokens=slots))["attention"])
    cov = torch.randn(128, 128, generator=g, dtype=torch.float64)
    cov = cov @ cov.T / 128
    code = lambda: fit_head(torch.zeros(128), cov, cov * 0.1, 2.0)
    params = code()
    seq = torch.randn(1, frames, slots, 128, generator=g)
    return cm.Throughput(linear=linear, attention=attention, objective=objective,
                         record_s=caches["recording"] - caches["plain"], quantized_s=quantized - caches["plain"],
                         step_s=1.0 / _rate(lambda: fake_quant_sequence(seq, params), frames), code_s=1.0 / _rate(code),
                         note=f"measured here at {tokens} tokens, 1 thread")


def quantized_attend_s(info, frame) -> float:
    """Seconds of one attend of one layer through the fast runtime with a 2.5-bit predictive recipe
    (frames coded, the history decoded a block at a time), the window full: `frame()` gives inputs."""
    from benchmarks.predictive_fit import Moments, predictive_recipe
    from calibrate.fastcache import FastKVCache

    moments = Moments(1)
    for _ in range(3):
        q, k, v, rope = frame()
        moments.add(0, "k", rope.apply(k))
        moments.add(0, "v", v)
    return attend_s(FastKVCache.from_recipe(predictive_recipe(info, moments, 2.5), WINDOW, SINKS), frame,
                    WINDOW + SINKS + 1)


def attend_s(cache, frame, warm: int) -> float:
    """Seconds of one attend of layer 0 once `warm` frames filled the cache: `frame()` gives inputs."""
    for _ in range(warm):
        cache.attend(0, *frame())
    args = frame()
    return 1.0 / _rate(lambda: cache.attend(0, *args))


def units_at(size: int, frames: int) -> cm.Throughput:
    """`throughput` at a size, the trace's slots as the default fit keeps them."""
    return throughput(size, min(size, cm.Run(frames=1, window=1, sinks=0, passes=1).trace_tokens), frames)


def fit_per_pass(m: cm.Model, run: cm.Run, tp: cm.Throughput, measured: dict) -> float:
    """The fixed part of one model pass, from one run's rollout phases: (measured - FLOP time) / passes."""
    from dataclasses import replace

    rollouts = [p for p in ("closed loop", "evaluation", "check set") if p in measured["phases"]]  # closed loop: off by default
    flop_time = cm.seconds(m, run, replace(tp, per_pass_s=0.0))
    n = cm.passes(run)
    spare = sum(measured["phases"][p]["seconds"] - flop_time[p] for p in rollouts)
    return max(spare / sum(n[p] for p in rollouts), 0.0)


# ---- the report -------------------------------------------------------------------------------------
def model_of(size: int, layers: int = LAYERS, param_bytes: int = 4, text_tokens: int = TEXT_TOKENS) -> cm.Model:
    return cm.Model(layers=layers, heads=12, head_dim=128, width=1536, ffn=8960, tokens=size, text_tokens=text_tokens,
                    param_bytes=param_bytes)


def run_of(frames: int, measured: dict) -> cm.Run:
    """The run each size made (module docstring), with its measured counts of upgrades and candidates."""
    return cm.Run(frames=frames, window=WINDOW, sinks=SINKS, passes=2, calibration=1,
                  closed_loop=int(measured["candidates"] > 1),
                  candidates=measured["candidates"], evaluation=1, check=1, batch=1, upgrades=measured["upgrades"])


PHASES = ("replay", "fit", "closed loop", "evaluation", "check set")

# Wan2.1-T2V-1.3B calibrated by default (Self-Forcing's setting: chunks of 3 latent frames, 4 denoising steps,
# a window of 7 chunks + 1 sink), 7 calibration trajectories of 40 chunks (120 latent frames), no closed loop
# (off by default), evaluation 7 x 40 chunks, check set 4 x 126 frames = 42 chunks,
# the default trace (4 trajectories x 48 frames, <= 512 slots, <= 8 GiB, bfloat16).
WAN13 = cm.Model(layers=30, heads=12, head_dim=128, width=1536, ffn=8960, tokens=4680, text_tokens=512, param_bytes=2)


def wan13_run(batch: int, gpus: int = 1) -> cm.Run:
    return cm.Run(frames=40, window=7, sinks=1, passes=5, calibration=7, closed_loop=0, candidates=1,
                  evaluation=7, check=4, check_frames=42, batch=batch, trace_element=2)


# H100 SXM: bf16 dense 989 TFLOP/s, FP32 67 TFLOP/s peak. Assumed: 40% of bf16 peak for the model's GEMMs; the
# cache attends in float32 (CUDA cores, fused kernel): 40 TFLOP/s; recording a frame of one layer 15 ms (the
# attention mass recomputes q.k: 0.54 TFLOP at 40 TFLOP/s, float64 Gram matrices 11 GFLOP, histograms); a coded
# frame of one head 0.3 ms (~20 kernel launches); a head's code fitted 20 ms (on the host, as here); 20 ms of
# fixed cost per model pass (30 layers of kernel launches and the cache's Python).
H100 = cm.Throughput(linear=400e12, attention=40e12, record_s=0.015, step_s=3e-4, code_s=0.02, per_pass_s=0.02,
                     note="assumed H100 SXM: GEMMs 400 TFLOP/s (40% of bf16 peak), float32 attention 40 TFLOP/s, "
                          "15 ms to record a frame of one layer, 0.3 ms per coded frame of one head, 20 ms per head "
                          "code, 20 ms fixed per model pass")


def extrapolate(gpus: int = 1, batch: int = 4) -> dict:
    """Wan2.1-1.3B's default calibration by the cost model: bytes on the GPU and the host, hours.

    With several GPUs the replay shards trajectories (7 over `gpus`: ceil(7 / gpus) each) and the fit
    layers; the evaluation and the check set run on the main process."""
    run = wan13_run(batch)
    t = cm.seconds(WAN13, run, H100)
    t["replay"] *= -(-run.calibration // gpus) / run.calibration
    t["fit"] /= gpus
    gpu = cm.peak_bytes(WAN13, run)
    host = {"reservoirs": 3 * 4096 * WAN13.layers * WAN13.heads * WAN13.head_dim * 4,
            "loading the weights": WAN13.params * 2,
            "kept rollout latents (evaluation, 7 x 120 frames, fp + quantized)": 2 * 7 * 120 * 16 * 60 * 104 * 4}
    return {"seconds": t, "hours": sum(t.values()) / 3600, "gpu_bytes": gpu, "host_bytes": host,
            "batch": batch, "gpus": gpus, "slots": cm.trace_slots(WAN13, run)}


def predictions(results: dict) -> dict[str, dict[str, float]]:
    """Predicted seconds per phase and size: each size's measured units, and the fixed part of a model
    pass fitted on the smallest size (where it dominates)."""
    sizes = results["sizes"]
    smallest = min(sizes, key=int)
    base = cm.Throughput(**sizes[smallest]["throughput"])
    per_pass = fit_per_pass(model_of(int(smallest)), run_of(results["frames"], sizes[smallest]), base, sizes[smallest])
    out = {}
    for size, m in sizes.items():
        tp = cm.Throughput(**{**m["throughput"], "per_pass_s": per_pass})
        out[size] = cm.seconds(model_of(int(size)), run_of(results["frames"], m), tp)
    out["per_pass_s"] = per_pass
    return out


def markdown(results: dict) -> str:
    pred = predictions(results)
    lines = ["# Scale: the default `task=calibrate` on Wan2.1-1.3B-shaped models", "",
             f"- date: {results['date']}; command: `OMP_NUM_THREADS=1 python -m benchmarks.scale`; torch {results['torch']}",
             f"- this 2-core CPU, one thread; {results.get('sharing', 'sharing the CPU with one other job (a training run)')}",
             f"- models: diffusers `WanTransformer3DModel` with Wan2.1-1.3B's blocks (12 heads x 128, width 1536, "
             f"ffn 8960, text 4096), {LAYERS} layers, random weights, float32, loaded from a model directory "
             "(`model.weights=`)",
             f"- cut for CPU time: 1 trajectory of {results['frames']} cache frames in every set (calibration, closed "
             f"loop, evaluation, check set), one denoising step (`model.wan.denoise_timesteps=[1000]`: 2 passes per "
             f"cache frame), window {WINDOW} + {SINKS} sink; every fit setting at its default "
             f"(trace <= 512 slots and <= 8 GiB, 3 x 3 step grid, mixed precision, "
             f"{'closed loop, the default then' if any(m['candidates'] > 1 for m in results['sizes'].values()) else 'no closed loop'})", "",
             "## Measured, per size", "",
             "| tokens / cache frame | wall | peak RSS | trace | objective calls (head passes) | s / call | "
             "coded head sequences | upgrades |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, m in results["sizes"].items():
        lines.append(f"| {size} | {m['wall_seconds']:.0f} s | {peak_rss_mib(m):.0f} MiB | "
                     f"{m.get('trace_bytes', 0) / 2**20:.1f} MiB ({m.get('trace_slots', 0)} slots) | "
                     f"{m['objective_calls']} ({m['objective_heads']}) | "
                     f"{m['objective_seconds'] / max(m['objective_calls'], 1):.3f} | {m['head_sequences']} | "
                     f"{m['upgrades']} |")
    lines += ["", "## Per phase: measured / predicted by the cost model (error)", "",
              "| tokens | " + " | ".join(f"{p} (s)" for p in PHASES) + " |", "|---:|" + "---:|" * len(PHASES)]
    worst = {}
    for size, m in results["sizes"].items():
        cells = []
        for p in PHASES:
            if p not in m["phases"]:
                cells.append("-")
                continue
            got, want = m["phases"][p]["seconds"], pred[size][p]
            worst[(size, p)] = (want - got) / got
            cells.append(f"{got:.1f} / {want:.1f} ({worst[(size, p)]:+.0%})")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    out_of = [f"{p} at {s}" for (s, p), e in worst.items() if abs(e) > 0.25]
    lines += ["", f"Largest error {max(abs(e) for e in worst.values()):.0%}; beyond 25%: "
                  f"{', '.join(out_of) or 'none'}. Units timed on this CPU per size (`throughput`: "
                  f"{results.get('units_note', 'right before its run')}); the fixed part "
                  f"of a model pass ({pred['per_pass_s'] * 1e3:.0f} ms) fitted on the smallest size.", "",
              "## Peak RSS per phase", "", "| tokens | " + " | ".join(PHASES) + " |", "|---:|" + "---:|" * len(PHASES)]
    for size, m in results["sizes"].items():
        lines.append(f"| {size} | " + " | ".join(f"{m['phases'][p]['peak_rss_mib']:.0f} MiB" if p in m["phases"] else "-"
                                                for p in PHASES) + " |")
    lines += ["", "## Wan2.1-1.3B by the cost model", "",
              "30 layers, 4680 tokens per cache frame (chunks of 3 latent frames at 480x832), 4 denoising steps + 1 "
              "clean pass, window 7 chunks + 1 sink (Self-Forcing's), the default calibration set (7 trajectories of "
              "40 chunks = 120 latent frames), no closed loop (off by default), evaluation 7 x 40 chunks, "
              "check set 4 x 42 chunks (126 frames), default fit settings (trace 7 trajectories x 40 frames in "
              "bfloat16), bfloat16 weights.", "", f"Throughput: {H100.note}.", ""]
    for gpus in (1, 8):
        e = extrapolate(gpus)
        g = e["gpu_bytes"]
        lines.append(f"- **{gpus} GPU{'s' if gpus > 1 else ''}** (batch {e['batch']}): {e['hours']:.2f} h "
                     f"({', '.join(f'{k} {v / 60:.0f} min' for k, v in e['seconds'].items() if v)}); GPU memory peak "
                     f"{max(g['replay'], g['fit']) / 2**30:.0f} GiB (replay {g['replay'] / 2**30:.1f}, fit "
                     f"{g['fit'] / 2**30:.1f}; trace {g['trace'] / 2**30:.1f} GiB = {e['slots'][2]} slots); host "
                     f"{sum(e['host_bytes'].values()) / 2**30:.1f} GiB")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,390,1560,4680")
    parser.add_argument("--frames", type=int, default=8, help="cache frames per trajectory in every set")
    parser.add_argument("--out", type=Path, default=Path("artifacts/benchmarks"))
    parser.add_argument("--work", type=Path, default=None, help="where models and runs go (default: a temp dir)")
    parser.add_argument("--report", action="store_true", help="write scale.md again from scale.json")
    parser.add_argument("--units", action="store_true", help="re-time the units of every size in scale.json, then report")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.worker is not None:
        worker([a for a in rest if a != "--"], args.worker)
        return
    if args.units:  # re-time every size's units into scale.json, the runs' measurements kept
        from calibrate.io import write_text_atomic

        results = json.loads((args.out / "scale.json").read_text())
        for size in results["sizes"]:
            tp = units_at(int(size), results["frames"])
            results["sizes"][size]["throughput"] = tp.__dict__
            print(size, tp, flush=True)
        results["units_note"] = f"re-timed {datetime.now(timezone.utc).isoformat(timespec='seconds')} with `--units`"
        write_text_atomic(args.out / "scale.json", json.dumps(results, indent=2) + "\n")
        args.report = True
    if args.report:  # the report again from scale.json (the cost model changes, the measurements do not)
        from calibrate.io import write_text_atomic

        results = json.loads((args.out / "scale.json").read_text())
        write_text_atomic(args.out / "scale.md", markdown(results))
        print(markdown(results))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; sizes are {sorted(SIZES)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="calibrate-scale-"))
    weights = work / "wan_2layers"
    if not (weights / "config.json").exists():
        make_model(weights)
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": platform.processor(),
               "torch": torch.__version__, "frames": args.frames, "sizes": {}}
    for size in sizes:
        print(f"size {size}: timing this CPU's units", flush=True)
        tp = units_at(size, args.frames)
        print(f"size {size}: running", flush=True)
        measured = run_size(size, args.frames, weights, work)
        measured["throughput"] = tp.__dict__
        results["sizes"][str(size)] = measured
        print(json.dumps(measured), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    from calibrate.io import write_text_atomic

    write_text_atomic(args.out / "scale.json", json.dumps(results, indent=2) + "\n")
    write_text_atomic(args.out / "scale.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
